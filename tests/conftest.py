"""Session fixtures shared by the suite: the tiny base model (built once by the real bootstrap)
and one offline vLLM engine on it. Engines take ~20-60 s to start here: share them."""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from rollout.episode import Episode
from rollout.traces import (Feedback, FeedbackStore, SamplingInfo, StackFingerprint, Trace, TraceConfig,
                            TraceWriter)

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_cfg():
    from loop.config import load_config

    # cached under the repo's .cache/ so local reruns reuse the model; CI builds it once
    return load_config(REPO / "conf" / "tiny.yaml", [f"bootstrap.cache_dir={REPO / '.cache' / 'flywheel-test'}"])


@pytest.fixture(scope="session")
def tiny_base(tiny_cfg):
    from loop.bootstrap import bootstrap

    return bootstrap(tiny_cfg.bootstrap, tiny_cfg.task)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_base):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_base.path)


@pytest.fixture(scope="session")
def tiny_llm(tiny_base, tiny_cfg):
    from rollout.engine import make_llm

    llm = make_llm(tiny_base.path, tiny_cfg.engine)
    yield llm
    del llm


# Dataset fixtures (pipelines/, trainers/): real episodes of the tiny model (the shared `tiny_llm`
# engine, token-in/token-out), turned into trace rows the way the server writes them (one per turn,
# exact ids and behaviour logprobs, episode_id/turn), and written with the real writers.

STACK = StackFingerprint(engine="vllm", engine_version="test", quant_format="none", kv_cache_dtype="auto",
                         device="cpu", device_name="test", torch_version="test", flywheel_version="test")
T0 = datetime(2026, 12, 2, 12, 0, tzinfo=timezone.utc)
GROUPS, G = 2, 4  # ds_episodes: GROUPS problems x G samples


def episode_traces(ep: Episode, episode_id: str, *, versions: list[int] | None = None,
                   logprobs_mode: str = "processed_logprobs", t0: datetime = T0, temperature: float = 1.0
                   ) -> list[Trace]:
    """One `Trace` per turn of `ep`, as the server logs a token-in/token-out completion."""
    out = []
    for k, turn in enumerate(ep.turns):
        c = turn.completion
        out.append(Trace(
            request_id=f"req-{episode_id}-{k}", model="flywheel", weight_version=(versions or [0] * 9)[k],
            checkpoint_sha256="0" * 64, stack=STACK,
            sampling=SamplingInfo(temperature=temperature, top_p=1.0, top_k=-1, max_tokens=48,
                                  logprobs_mode=logprobs_mode),
            messages=json.dumps(turn.prompt_ids), prompt_token_ids=list(turn.prompt_ids),
            completion_token_ids=list(c.token_ids), completion_logprobs=list(c.logprobs),
            output=json.dumps({"content": ""}), finish_reason=c.finish_reason, e2e_ms=1.0,
            episode_id=episode_id, turn=k, created_at=t0 + timedelta(seconds=k),
        ))
    return out


def write_traces(root: Path, traces: list[Trace], feedback: list[Feedback] = ()) -> None:
    with TraceWriter(TraceConfig(root=root, durability="interval")) as w:
        for t in traces:
            w.append_sync(t)
    with FeedbackStore(root) as store:
        for f in feedback:
            store.append_sync(f)


@pytest.fixture(scope="session")
def ds_traces():
    """`episode_traces(ep, episode_id, versions=, logprobs_mode=, t0=) -> list[Trace]`."""
    return episode_traces


@pytest.fixture(scope="session")
def ds_write():
    """`write_traces(root, traces, feedback=())`: the real TraceWriter and FeedbackStore."""
    return write_traces


@pytest.fixture(scope="session")
def ds_episodes(tiny_llm, tiny_tokenizer):
    """GROUPS problems x G episodes each at temperature 1 (a GRPO batch), with their ids."""
    from rollout.engine import vllm_generate
    from rollout.episode import run_episodes
    from rollout.tasks.calculator import TASK, make_problems

    problems = [p for p in make_problems("train", GROUPS, seed=7) for _ in range(G)]
    episodes = run_episodes(problems, tiny_tokenizer, vllm_generate(tiny_llm), task=TASK, temperature=1.0, max_tokens=48)
    return [(f"ep-{i}", ep) for i, ep in enumerate(episodes)]


@pytest.fixture(scope="session")
def spec_traffic(tiny_llm, tiny_tokenizer, tmp_path_factory):
    """A trace root: 48 problems x 2 samples at T=1, as the server traces them (one row per turn)."""
    from rollout.engine import vllm_generate
    from rollout.episode import run_episodes
    from rollout.tasks.calculator import TASK, make_problems

    problems = [p for p in make_problems("train", 48, seed=11) for _ in range(2)]
    episodes = run_episodes(problems, tiny_tokenizer, vllm_generate(tiny_llm), task=TASK, temperature=1.0, max_tokens=48)
    root = tmp_path_factory.mktemp("spec-traffic") / "data"
    write_traces(root, [t for i, ep in enumerate(episodes) for t in episode_traces(ep, f"spec-{i}")])
    return root


@pytest.fixture(scope="session")
def traffic_draft(spec_traffic, tiny_base, tmp_path_factory):
    """A draft distilled for the tiny base on `spec_traffic` (the loop's speculator phase, small)."""
    from pipelines.speculator import DraftShape, SpeculatorConfig, distill

    cfg = SpeculatorConfig(draft=DraftShape(hidden_size=32, num_layers=1, num_heads=1, num_kv_heads=1,
                                            intermediate_size=64),
                           steps=80, batch_size=16, lr=1e-2, warmup_steps=5, heldout_fraction=0.25, eval_positions=400)
    return distill(tiny_base.path, spec_traffic, tmp_path_factory.mktemp("traffic-draft") / "draft", cfg,
                   weight_versions=[0], target_version=0, progress=False)


@pytest.fixture(scope="session")
def ds_tokenizer_path(tiny_base) -> str:
    return str(tiny_base.path)


def planted_dataset(ds_episodes, root, tokenizer, episode_id=lambda i: f"rl-{i // 4}-{i % 4}", reward=lambda i: i % 2,
                    retokenized=()):
    """The shared episodes under ids `episode_id(i)` (default `<run>-<problem>-<sample>`: one round,
    groups of 4) with planted rewards `reward(i)` as feedback ("override" mode); no held-out split.
    Episodes `retokenized` (of two turns) get a turn 1 whose prompt does not extend turn 0, as a
    client re-sending text can."""
    from pipelines.traces_to_dataset import DatasetConfig, build_dataset

    traces, feedback = [], []
    for i, (_, ep) in enumerate(ds_episodes):
        tr = episode_traces(ep, episode_id(i))
        if i in retokenized:
            p1 = list(tr[1].prompt_token_ids)
            p1[len(tr[0].prompt_token_ids)] = (p1[len(tr[0].prompt_token_ids)] + 1) % 300
            tr = [tr[0], dataclasses.replace(tr[1], prompt_token_ids=p1)]
        traces += tr
        feedback.append(Feedback(trace_id=tr[-1].trace_id, episode_id=tr[-1].episode_id, reward=float(reward(i)),
                                 source="env:planted", created_at=tr[-1].created_at))
    write_traces(root / "data", traces, feedback)
    return build_dataset(DatasetConfig(trace_root=root / "data", out_dir=root / "ds", tokenizer=tokenizer,
                                       heldout_fraction=0.0, feedback_mode="override"))


@pytest.fixture(scope="session")
def ds_planted():
    """`planted_dataset(ds_episodes, root, tokenizer, episode_id=, reward=)`: an RL dataset of them."""
    return planted_dataset


@pytest.fixture(scope="session")
def rl_dataset(ds_episodes, ds_tokenizer_path, tmp_path_factory):
    """The shared episodes with planted rewards: within each group, alternate episodes score 1 and 0
    (feedback in "override" mode), so every group carries signal; no held-out split."""
    return planted_dataset(ds_episodes, tmp_path_factory.mktemp("rl-data"), ds_tokenizer_path)


@pytest.fixture(scope="session")
def gate_dataset(ds_episodes, ds_traces, ds_write, ds_tokenizer_path, tmp_path_factory):
    """The shared episodes as an RL dataset with a held-out split (episodes drawn at 0.4): what
    requantize calibrates on (train) and the KL gate measures on (heldout)."""
    from pipelines.traces_to_dataset import DatasetConfig, build_dataset
    from rollout.traces import Feedback

    root = tmp_path_factory.mktemp("gate-data")
    traces, feedback = [], []
    for i, (_, ep) in enumerate(ds_episodes):
        tr = ds_traces(ep, f"gate-{i // G}-{i % G}")
        traces += tr
        feedback.append(Feedback(trace_id=tr[-1].trace_id, episode_id=tr[-1].episode_id, reward=float(i % 2),
                                 source="env:planted", created_at=tr[-1].created_at))
    ds_write(root / "data", traces, feedback)
    ds = build_dataset(DatasetConfig(trace_root=root / "data", out_dir=root / "ds", tokenizer=ds_tokenizer_path,
                                     heldout_fraction=0.4, heldout_unit="episode", feedback_mode="override"))
    assert ds.train_episodes and ds.heldout_episodes, ds
    return ds


# Planted damage for the KL gate and the promote path (tests/pipelines/test_gate.py,
# tests/rollout/server/test_promote.py): `plant(good_folder, kind, dst)` -> a damaged copy.
PLANTED = {
    "nan": "model.norm.weight holds 1 NaN or infinite",
    "inf": "model.embed_tokens.weight holds 1 NaN or infinite",
    "architecture": "architecture differs from the serving model: num_hidden_layers",
    "shape": "tensor model.norm.weight has shape",
    "missing": "missing tensor model.layers.1.post_attention_layernorm.weight",
    "truncated": "does not match its manifest sha256",
    "truncated-rehashed": "cannot be read",
    "tokenizer": "tokenizer differs from the serving model",
}


def noisy_copy(src, dst, scale: float, only: str | None = None, seed: int = 3):
    """A copy of an HF folder with Gaussian noise (`scale` x each matrix's std) on its matrices,
    or on those whose name contains `only`."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst = Path(dst)
    shutil.copytree(src, dst)
    (dst / "flywheel_manifest.json").unlink(missing_ok=True)
    g = torch.Generator().manual_seed(seed)
    for shard in dst.glob("*.safetensors"):
        t = load_file(shard)
        for k, v in t.items():
            if v.ndim == 2 and v.is_floating_point() and (only is None or only in k):
                t[k] = (v + scale * v.std() * torch.randn(v.shape, generator=g)).contiguous()
        save_file(t, shard, metadata={"format": "pt"})
    return dst


def _rehash(folder: Path) -> None:
    """Record the folder's files as they are now in its manifest (damage that a manifest hides)."""
    import json

    from rollout.artifacts import file_sha256

    m = json.loads((folder / "flywheel_manifest.json").read_text())
    m["files"] = {p.name: file_sha256(p) for p in folder.iterdir() if p.is_file() and p.name != "flywheel_manifest.json"}
    (folder / "flywheel_manifest.json").write_text(json.dumps(m))


def _edit_tensors(folder: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    shard = next(folder.glob("*.safetensors"))
    t = load_file(shard)
    fn(t)
    save_file(t, shard, metadata={"format": "pt"})
    _rehash(folder)


def plant_damage(good, kind: str, dst) -> Path:
    """A copy of the quantized checkpoint `good` with one kind of damage (keys of PLANTED)."""
    import json
    import shutil

    import torch

    d = Path(dst)
    shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(good, d)
    if kind == "nan":
        _edit_tensors(d, lambda t: t["model.norm.weight"].__setitem__(0, float("nan")))
    elif kind == "inf":
        _edit_tensors(d, lambda t: t["model.embed_tokens.weight"].__setitem__((3, 1), float("inf")))
    elif kind == "architecture":
        c = json.loads((d / "config.json").read_text())
        c["num_hidden_layers"] += 1
        (d / "config.json").write_text(json.dumps(c))
        _rehash(d)
    elif kind == "shape":
        _edit_tensors(d, lambda t: t.__setitem__("model.norm.weight", torch.ones(t["model.norm.weight"].numel() + 8)))
    elif kind == "missing":
        _edit_tensors(d, lambda t: t.pop("model.layers.1.post_attention_layernorm.weight"))
    elif kind in ("truncated", "truncated-rehashed"):
        shard = next(d.glob("*.safetensors"))
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        if kind == "truncated-rehashed":
            _rehash(d)
    elif kind == "tokenizer":
        c = json.loads((d / "tokenizer_config.json").read_text())
        c["model_max_length"] = 7
        (d / "tokenizer_config.json").write_text(json.dumps(c))
        _rehash(d)
    else:
        raise ValueError(kind)
    return d


@pytest.fixture(scope="session")
def plant():
    """(plant_damage, noisy_copy, PLANTED)."""
    return plant_damage, noisy_copy, PLANTED
