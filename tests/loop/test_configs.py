from pathlib import Path

import pytest

from loop.config import LoopConfig, load_config
from loop.configs import ConfigError

CONF = Path(__file__).resolve().parents[2] / "conf"


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_yaml_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, LoopConfig)


@pytest.mark.parametrize("path", sorted(CONF.glob("*.yaml")), ids=lambda p: p.name)
def test_a_written_config_reads_back_equal(path, tmp_path):
    """The loop hands its config to child processes as YAML (the collect phase's server)."""
    from loop.configs import to_yaml

    cfg = load_config(path, ["trainer.lr=5e-05", "trainer.betas=[0.9,0.95]"])
    (tmp_path / "c.yaml").write_text(to_yaml(cfg))
    assert load_config(tmp_path / "c.yaml") == cfg


def test_overrides_apply_with_hydra_grammar():
    cfg = load_config(CONF / "agent_rl.yaml", ["bootstrap.sft.lr=5e-4", "engine.kv_cache_gib=2", "~run_dir"])
    assert cfg.bootstrap.sft.lr == 5e-4 and cfg.engine.kv_cache_gib == 2
    assert cfg.run_dir == LoopConfig().run_dir  # deleted from the YAML: the embedded default


@pytest.mark.parametrize("override, needle", [
    ("bootstrap.sft.lrr=1", "bootstrap.sft.lrr: unknown key (did you mean 'lr'?)"),
    ("bootstrap.sft.lr=abc", "bootstrap.sft.lr: expected float"),
    ("bootstrap.model.num_heads=5", "bootstrap.model: hidden_size 192 is not divisible by num_heads 5"),
    ("engine.dtype=int3", "engine: dtype must be"),
    ("engine.enforce_eager=3", "engine.enforce_eager: expected bool"),
    ("task=3", "task: expected a mapping"),
    ("bootstrap.sft.lr==", "bad override"),
    ("serve.w4a16_group_size=3", "serve: w4a16_group_size must be a positive even int or null (per channel)"),
])
def test_bad_values_name_the_file_and_key(override, needle):
    with pytest.raises(ConfigError) as e:
        load_config(CONF / "agent_rl.yaml", [override])
    assert needle in str(e.value) and "agent_rl.yaml" in str(e.value)


def test_typo_in_yaml_file_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine:\n  max_model_lenn: 10\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: engine.max_model_lenn: unknown key"):
        load_config(bad)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


def test_collect_holds_the_collectors_own_config():
    """One config per component: `collect.rollout` is rollout.collector.CollectorConfig, checked by
    itself at load; the phase fills in the endpoint and a fresh run id (a round of its own)."""
    from rollout.collector import CollectorConfig

    cfg = load_config(CONF / "tiny.yaml", ["collect.rollout.group_size=3", "collect.rollout.temperature=0.7"])
    assert isinstance(cfg.collect.rollout, CollectorConfig)
    a, b = cfg.collect.collector("http://127.0.0.1:1"), cfg.collect.collector("http://127.0.0.1:1")
    assert (a.group_size, a.temperature, a.base_url) == (3, 0.7, "http://127.0.0.1:1") and a.run_id != b.run_id
    with pytest.raises(ConfigError, match=r"collect.rollout: group_size must be an int >= 1"):
        load_config(CONF / "tiny.yaml", ["collect.rollout.group_size=0"])


def test_w4a16_per_channel_is_a_null_group_size():
    """`serve.w4a16_group_size=null`: W4A16 with one scale per output channel, served and trained
    (QAT) alike."""
    from loop.serving import serving_spec

    cfg = load_config(CONF / "agent_rl.yaml", ["serve.w4a16_group_size=null"])
    assert cfg.serve.w4a16_group_size is None
    spec = serving_spec("w4a16", cfg.serve.w4a16_group_size)  # what QAT (loop.train.qat_spec) trains through too
    assert spec.granularity == "channel" and spec.group_size is None
