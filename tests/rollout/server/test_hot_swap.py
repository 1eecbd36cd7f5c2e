"""Hot-swap on the running server: under concurrent streaming load no request fails or spans two
versions, the new weights' outputs equal a fresh engine's on the new folder, a bad checkpoint is
refused or restored, and swapping back restores the original outputs."""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest
from srv_util import PROMPTS, StreamingLoad, chat_messages, perturbed_copy, sse_events, write_test_manifest

pytestmark = pytest.mark.slow

def _greedy(url: str, tokenizer) -> list[list[int]]:
    out = []
    for text in PROMPTS:
        ids = tokenizer.apply_chat_template(chat_messages(text), add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
        r = httpx.post(url + "/v1/completions", json={"model": "flywheel", "prompt": ids, "max_tokens": 24,
                                                      "temperature": 0, "return_token_ids": True}, timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"][0]["token_ids"])
    return out


def test_hot_swap_under_streaming_load_matches_a_fresh_engine(srv_main, tiny_base, tiny_tokenizer, tiny_cfg,
                                                              tmp_path_factory):
    new = perturbed_copy(tiny_base.path, tmp_path_factory.mktemp("swap") / "fp2")
    before = _greedy(srv_main.url, tiny_tokenizer)
    v0 = srv_main.admin("GET", "/admin/status").json()["weight_version"]

    with StreamingLoad(srv_main.url) as load:
        time.sleep(3)
        r = srv_main.admin("POST", "/admin/weights", json={"path": str(new)})
        time.sleep(3)
    assert r.status_code == 200, r.text
    swap = r.json()
    assert swap["weight_version"] == v0 + 1 and swap["canary_mean_abs_dlogprob"] < 1e-3
    assert swap["pause_s"] >= swap["load_s"] > 0

    versions = {v for _, _, v, _, _ in load.results}
    failed = [x for x in load.results if x[0] != 200 or not x[3] or any("error" in e for e in sse_events(x[4]))]
    assert not failed, failed[:3]
    assert versions == {v0, v0 + 1}, versions  # traffic ran on both sides of the swap
    rows = {x["trace_id"]: x for x in srv_main.traces()}
    for _, trace_id, version, _, _ in load.results:
        assert rows[trace_id]["weight_version"] == version and rows[trace_id]["status"] == "ok"

    after = _greedy(srv_main.url, tiny_tokenizer)
    assert after != before
    from rollout.engine import make_llm, vllm_generate

    fresh = make_llm(str(new), tiny_cfg.engine)
    try:
        ids = [tiny_tokenizer.apply_chat_template(chat_messages(t), add_generation_prompt=True, tokenize=True,
                                                  return_dict=False) for t in PROMPTS]
        ids = [list(x["input_ids"] if isinstance(x, dict) else x) for x in ids]
        expected = [c.token_ids for c in vllm_generate(fresh)(ids, 0.0, 24)]
    finally:
        del fresh
    assert after == expected

    back = srv_main.admin("POST", "/admin/weights", json={"path": tiny_base.path})
    assert back.status_code == 200 and back.json()["weight_version"] == v0 + 2
    assert _greedy(srv_main.url, tiny_tokenizer) == before


def test_bad_checkpoints_are_refused_or_restored(srv_main, tiny_base, tiny_tokenizer, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("badswap")
    before = _greedy(srv_main.url, tiny_tokenizer)
    v0 = srv_main.admin("GET", "/admin/status").json()["weight_version"]

    wrong_arch = perturbed_copy(tiny_base.path, tmp / "arch")
    cfg = json.loads((wrong_arch / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (wrong_arch / "config.json").write_text(json.dumps(cfg))
    write_test_manifest(wrong_arch)
    r = srv_main.admin("POST", "/admin/weights", json={"path": str(wrong_arch)})
    assert r.status_code == 409 and "num_hidden_layers" in r.json()["error"]["message"]

    wrong_tok = perturbed_copy(tiny_base.path, tmp / "tok")
    (wrong_tok / "tokenizer.json").write_text((wrong_tok / "tokenizer.json").read_text().replace('"<|im_end|>"', '"<|end|>"', 1))
    write_test_manifest(wrong_tok)
    r = srv_main.admin("POST", "/admin/weights", json={"path": str(wrong_tok)})
    assert r.status_code == 409 and "tokenizer" in r.json()["error"]["message"]

    tampered = tmp / "tampered"
    shutil.copytree(tiny_base.path, tampered)
    (tampered / "flywheel_manifest.json").write_text(json.dumps(
        {"files_sha256": {"model.safetensors": "0" * 64}}))
    r = srv_main.admin("POST", "/admin/weights", json={"path": str(tampered)})
    assert r.status_code == 400 and "sha256" in r.json()["error"]["message"]

    # Loads, but is not what its own files say (one layer missing from the checkpoint): the canary
    # catches it and the old weights come back.
    partial = perturbed_copy(tiny_base.path, tmp / "partial", scale=0.5)
    from safetensors.torch import load_file, save_file

    tensors = load_file(partial / "model.safetensors")
    tensors.pop(next(k for k in tensors if k.endswith("mlp.down_proj.weight")))
    save_file(tensors, partial / "model.safetensors", metadata={"format": "pt"})
    write_test_manifest(partial)
    r = srv_main.admin("POST", "/admin/weights", json={"path": str(partial)})
    assert r.status_code in (400, 422), r.text
    if r.status_code == 422:
        assert "restored" in r.json()["error"]["message"]

    status = srv_main.admin("GET", "/admin/status").json()
    assert status["weight_version"] == v0 and status["gate_open"]
    assert _greedy(srv_main.url, tiny_tokenizer) == before


def test_keep_swap_resumes_in_flight_streams_on_the_new_weights(srv_main, tiny_base, tiny_tokenizer, tmp_path_factory):
    """mode "keep": in-flight streams are frozen, not drained; they finish on the new weights and
    their traces say which version sampled each token; none fails. Then back to the base."""
    new = perturbed_copy(tiny_base.path, tmp_path_factory.mktemp("keep") / "fp2")
    before = _greedy(srv_main.url, tiny_tokenizer)
    v0 = srv_main.admin("GET", "/admin/status").json()["weight_version"]
    try:
        _keep_swap_and_check(srv_main, new, v0, before, tiny_tokenizer)
    finally:  # whatever failed, the shared server goes back to the base for the tests after this one
        back = srv_main.admin("POST", "/admin/weights", json={"path": tiny_base.path, "mode": "keep"})
    assert back.status_code == 200 and back.json()["weight_version"] == v0 + 2
    assert _greedy(srv_main.url, tiny_tokenizer) == before  # the recomputed KV holds nothing of v0 + 1


def _keep_swap_and_check(srv_main, new, v0: int, before, tiny_tokenizer) -> None:
    with StreamingLoad(srv_main.url, n=6, max_tokens=256, stagger_s=0.25) as load:  # long streams: some mid-way
        assert load.streaming.wait(60), "no stream got going"
        r = srv_main.admin("POST", "/admin/weights", json={"path": str(new), "mode": "keep"})
        time.sleep(2)
    assert r.status_code == 200, r.text
    swap = r.json()
    assert swap["mode"] == "keep" and swap["weight_version"] == v0 + 1 and swap["drain_s"] == 0
    assert swap["canary_mean_abs_dlogprob"] < 1e-3
    failed = [x for x in load.results if x[0] != 200 or not x[3] or any("error" in e for e in sse_events(x[4]))]
    assert not failed, failed[:3]
    rows = {x["trace_id"]: x for x in srv_main.traces()}
    relabelled = [rows[t] for _, t, _, _, _ in load.results if rows[t]["completion_weight_versions"]]
    for row in relabelled:  # admitted under v0, sampled (from some token on) by v0 + 1
        versions = row["completion_weight_versions"]
        assert row["weight_version"] == v0 and len(versions) == len(row["completion_token_ids"])
        assert versions == sorted(versions) and set(versions) <= {v0, v0 + 1} and versions[-1] == v0 + 1
    # streams that were generating when the engine paused: resumed, not drained
    assert any(set(r["completion_weight_versions"]) == {v0, v0 + 1} for r in relabelled), [
        (r["created_at"], r["ttft_ms"], r["e2e_ms"], len(r["completion_token_ids"]),
         {v: r["completion_weight_versions"].count(v) for v in set(r["completion_weight_versions"])})
        for r in relabelled] + [swap, [x[2] for x in load.results]]
    assert _greedy(srv_main.url, tiny_tokenizer) != before


def test_the_prefix_cache_is_salted_by_weight_version(srv_main, tiny_base, tmp_path_factory):
    """A swap that keeps the prefix cache (`clear_cache: false`) still never serves a prefix
    computed under the old weights: the server salts every request's cache by its version."""
    new = perturbed_copy(tiny_base.path, tmp_path_factory.mktemp("salt") / "fp2", seed=7)
    prompt = [(i * 7) % 400 + 10 for i in range(300)]  # two full KV blocks (vLLM's CPU block: 128 tokens)

    def cached(salt: str | None = None) -> int:
        r = httpx.post(srv_main.url + "/v1/completions", timeout=60, json={
            "model": "flywheel", "prompt": prompt, "max_tokens": 1, "temperature": 0,
            **({"cache_salt": salt} if salt else {})})
        assert r.status_code == 200, r.text
        srv_main.flush()
        return {t["trace_id"]: t for t in srv_main.traces()}[r.headers["x-flywheel-trace-id"]]["num_cached_prompt_tokens"]

    cached()
    assert cached() >= 128  # same version: the prefix is reused
    assert cached("tenant-a") == 0  # a client's own salt still separates its prefixes
    try:
        r = srv_main.admin("POST", "/admin/weights", json={"path": str(new), "clear_cache": False})
        assert r.status_code == 200, r.text
        assert cached() == 0  # the old version's blocks are still cached, but not under this salt
        assert cached() >= 128
    finally:
        back = srv_main.admin("POST", "/admin/weights", json={"path": tiny_base.path})
        assert back.status_code == 200, back.text
