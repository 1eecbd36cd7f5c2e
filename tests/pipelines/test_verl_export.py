"""The verl export of a dataset built from real episodes loads with the installed verl's own
dataset class (RLHFDataset) and the tiny tokenizer, one row per GRPO group, trace ids kept."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from pipelines.traces_to_dataset import DatasetConfig, build_dataset
from pipelines.verl_export import VerlExportConfig, export_verl


def test_verl_export_loads_with_verls_rlhf_dataset(ds_episodes, ds_traces, ds_write, ds_tokenizer_path,
                                                    tiny_tokenizer, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset

    traces = {eid: ds_traces(ep, eid) for eid, ep in ds_episodes}
    ds_write(tmp_path / "data", [t for ts in traces.values() for t in ts])
    m = build_dataset(DatasetConfig(trace_root=tmp_path / "data", out_dir=tmp_path / "ds",
                                    tokenizer=ds_tokenizer_path, heldout_fraction=0.0))
    export = export_verl(m, VerlExportConfig(out_dir=tmp_path / "verl", tokenizer=ds_tokenizer_path))
    problems = {ep.problem.question: ep.problem for _, ep in ds_episodes}
    assert export.rows == {"train.parquet": len(problems), "val.parquet": 0}

    cfg = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 256, "filter_overlong_prompts": True,
                            "cache_dir": str(tmp_path / "verl_cache"), "filter_overlong_prompts_workers": 1})
    ds = RLHFDataset(data_files=[export.train_file], tokenizer=tiny_tokenizer, config=cfg)
    assert len(ds) == len(problems)
    seen = set()
    for i in range(len(ds)):
        row = ds[i]
        system, user = row["raw_prompt"]
        assert system == {"role": "system", "content": ds_episodes[0][1].messages[0]["content"]}
        problem = problems[user["content"]]
        assert row["data_source"] == "flywheel/calculator" and row["ability"] == "tool_use"
        assert row["reward_model"] == {"style": "rule", "ground_truth": str(problem.answer)}
        info = row["extra_info"]
        mine = [(eid, ep) for eid, ep in ds_episodes if ep.problem.question == problem.question]
        assert sorted(info["episode_ids"]) == sorted(eid for eid, _ in mine)
        assert sorted(info["trace_ids"]) == sorted(t.trace_id for eid, _ in mine for t in traces[eid])
        assert sorted(info["rewards"]) == sorted(ep.reward for _, ep in mine)
        seen.add(info["group_id"])
    assert len(seen) == len(problems)
    assert pq.read_table(export.val_file).num_rows == 0
    with pytest.raises(FileExistsError):
        export_verl(m, VerlExportConfig(out_dir=tmp_path / "verl", tokenizer=ds_tokenizer_path))


def test_verl_export_config_names_the_bad_field(tmp_path):
    with pytest.raises(ValueError, match="ground_truth_fn"):
        VerlExportConfig(out_dir=tmp_path, tokenizer="t", ground_truth_fn="nope")
    with pytest.raises(ValueError, match="data_source"):
        VerlExportConfig(out_dir=tmp_path, tokenizer="t", data_source="")
