"""The server's pieces without an engine: config checks, the admission gate, the response parser,
the folder checks of a hot-swap, and vLLM argument building."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest
from srv_util import perturbed_copy, write_test_manifest

from rollout.engine import EngineConfig
from rollout.server.config import ServeConfig, SpeculativeConfig, vllm_cli_args
from rollout.server.engine import Gate
from rollout.server.output import OutputParser
from rollout.server.swap import SwapError, check_folder, check_origin, checkpoint_sha256


@pytest.mark.parametrize("kwargs,field", [
    ({"port": 70000}, "port"), ({"max_queue": 0}, "max_queue"), ({"max_body_bytes": -1}, "max_body_bytes"),
    ({"drain_timeout_s": 0}, "drain_timeout_s"), ({"logprobs_mode": "raw_logits"}, "logprobs_mode"),
    ({"trace_durability": "never"}, "trace_durability"), ({"served_model_name": ""}, "served_model_name"),
])
def test_serve_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        ServeConfig(**kwargs)


def test_speculative_config_and_vllm_args():
    with pytest.raises(ValueError, match="draft_model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="ngram_min"):
        SpeculativeConfig(method="ngram", ngram_min=3, ngram_max=2)
    args = vllm_cli_args(ServeConfig(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2),
                                     logprobs_mode="raw_logprobs", tool_call_parser="hermes"), EngineConfig(), "/m",
                         port=1234)
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    assert args[args.index("--port") + 1] == "1234" and "--enable-prefix-caching" in args
    assert args[args.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in args
    assert "--speculative-config" not in vllm_cli_args(ServeConfig(tool_call_parser="none"), EngineConfig(), "/m")


def test_the_tool_parser_follows_the_chat_template(tiny_base, tmp_path):
    """serve.tool_call_parser auto: vLLM's parser for the markup the model's template renders; a
    template it cannot tell fails naming the key; none serves without tool calls."""
    import shutil

    from rollout.server.config import resolve_tool_parser

    assert resolve_tool_parser(ServeConfig(), tiny_base.path) == "hermes"
    args = vllm_cli_args(ServeConfig(), EngineConfig(), tiny_base.path)
    assert args[args.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in args
    plain = tmp_path / "plain"
    shutil.copytree(tiny_base.path, plain)
    (plain / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(ValueError, match="serve.tool_call_parser: .* renders no tool calls"):
        resolve_tool_parser(ServeConfig(), str(plain))
    (plain / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{{ tools }}{% endfor %}")
    with pytest.raises(ValueError, match="does not recognise"):
        resolve_tool_parser(ServeConfig(), str(plain))
    assert "--tool-call-parser" not in vllm_cli_args(ServeConfig(tool_call_parser="none"), EngineConfig(), str(plain))
    assert resolve_tool_parser(ServeConfig(tool_call_parser="mistral"), str(plain)) == "mistral"


def test_processed_logprobs_with_speculation_need_exact_speculative_sampling():
    import dataclasses

    from rollout.capabilities import Capabilities
    from rollout.server.app import check_speculation

    caps = Capabilities("cpu", "_C_AVX2", None, ("w8a8", "none"), -128, "toward_zero")
    spec = ServeConfig(speculative=SpeculativeConfig(method="ngram"))  # processed logprobs: the default
    check_speculation(spec, caps)
    check_speculation(ServeConfig(), dataclasses.replace(caps, spec_exact=False))
    with pytest.raises(ValueError, match="serve.logprobs_mode: processed_logprobs .* plugin off"):
        check_speculation(spec, dataclasses.replace(caps, spec_exact=False))


def test_loop_config_builds_serve_from_yaml():
    from loop.config import load_config
    from loop.configs import ConfigError

    tiny = Path(__file__).resolve().parents[3] / "conf" / "tiny.yaml"
    cfg = load_config(tiny, ["serve.port=9001", "serve.speculative.method=ngram", "serve.logprobs_mode=raw_logprobs"])
    assert cfg.serve.port == 9001 and cfg.serve.speculative.method == "ngram"
    with pytest.raises(ConfigError, match="serve.prot"):
        load_config(tiny, ["+serve.prot=1"])


def test_gate_holds_new_requests_until_the_swap_is_done():
    async def run():
        gate, order = Gate(), []

        async def request(name, hold):
            async with gate.admit():
                order.append(f"{name}+")
                await asyncio.sleep(hold)
                order.append(f"{name}-")

        first = asyncio.create_task(request("a", 0.05))
        await asyncio.sleep(0.01)
        closing = asyncio.create_task(gate.close(timeout=1))
        await asyncio.sleep(0)
        second = asyncio.create_task(request("b", 0))
        assert await closing  # drained: a finished, b is waiting
        order.append("swap")
        assert gate.waiting == 1 and gate.in_flight == 0
        gate.open()
        await asyncio.gather(first, second)
        assert order == ["a+", "a-", "swap", "b+", "b-"]
        # a request that outlives the bound makes close() report False
        slow = asyncio.create_task(request("c", 0.2))
        await asyncio.sleep(0.01)
        assert not await gate.close(timeout=0.05)
        gate.open()
        await slow

    asyncio.run(run())


def test_output_parser_rebuilds_streamed_tool_calls():
    p = OutputParser(chat=True)
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "id": "call1", "type": "function",
                                                             "function": {"name": "calculator", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"expression": '}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"2+3"}'}}]},
                      "finish_reason": "tool_calls"}]},
    ]
    raw = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    for i in range(0, len(raw), 7):  # arbitrary network chunking
        p.feed(raw[i:i + 7].encode())
    out, finish, err = p.result()
    assert finish == "tool_calls" and err is None and out["content"] is None
    assert out["tool_calls"] == [{"id": "call1", "type": "function",
                                  "function": {"name": "calculator", "arguments": '{"expression": "2+3"}'}}]
    e = OutputParser(chat=False)
    e.feed(json.dumps({"error": {"message": "bad", "code": 400}}).encode())
    assert e.result() == ({}, None, "bad")


def test_check_folder_refuses_incompatible_checkpoints(tiny_base, tmp_path):
    base = tiny_base.path
    ok = perturbed_copy(base, tmp_path / "ok")
    assert check_folder(ok, base) == checkpoint_sha256(ok) != checkpoint_sha256(base)
    with pytest.raises(SwapError, match="config.json"):
        check_folder(tmp_path / "missing", base)
    arch = perturbed_copy(base, tmp_path / "arch")
    cfg = json.loads((arch / "config.json").read_text())
    cfg["hidden_size"] *= 2
    (arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SwapError, match="config.json does not match its manifest sha256"):
        check_folder(arch, base)
    write_test_manifest(arch)
    with pytest.raises(SwapError, match="hidden_size") as e:
        check_folder(arch, base)
    assert e.value.status == 409
    tampered = tmp_path / "tampered"
    shutil.copytree(base, tampered)
    (tampered / "model.safetensors").write_bytes((tampered / "model.safetensors").read_bytes()[:-8] + b"\0" * 8)
    with pytest.raises(SwapError, match="manifest sha256"):
        check_folder(tampered, base)


def test_a_swap_loads_only_manifested_files_inside_the_allowed_roots(tiny_base, tmp_path):
    """Before c8fb06b's fix any folder was loaded: without a manifest, with entries outside it,
    with weights it did not list, from anywhere on the machine."""
    base = tiny_base.path
    roots = [str(tmp_path / "allowed")]
    ok = perturbed_copy(base, tmp_path / "allowed" / "ok")
    check_origin(ok, roots)
    assert check_folder(ok, base) == checkpoint_sha256(ok)
    outside = perturbed_copy(base, tmp_path / "elsewhere")
    for path in (outside, tmp_path / "allowed" / ".." / "elsewhere"):
        with pytest.raises(SwapError, match="outside serve.weights_roots") as e:
            check_origin(path, roots)
        assert e.value.status == 403
    (tmp_path / "allowed" / "link").symlink_to(outside)  # a link inside a root to a folder outside it
    with pytest.raises(SwapError, match="outside serve.weights_roots"):
        check_origin(tmp_path / "allowed" / "link", roots)

    bare = perturbed_copy(base, tmp_path / "bare")
    (bare / "flywheel_manifest.json").unlink()
    with pytest.raises(SwapError, match="no flywheel_manifest.json") as e:
        check_folder(bare, base)
    assert e.value.status == 400
    (tmp_path / "secret.bin").write_bytes(b"x")
    escape = perturbed_copy(base, tmp_path / "escape")
    m = json.loads((escape / "flywheel_manifest.json").read_text())
    m["files"]["../secret.bin"] = "0" * 64
    (escape / "flywheel_manifest.json").write_text(json.dumps(m))
    with pytest.raises(SwapError, match="'../secret.bin' points outside the folder"):
        check_folder(escape, base)
    extra = perturbed_copy(base, tmp_path / "extra")
    shutil.copy(extra / "model.safetensors", extra / "model-00002.safetensors")
    with pytest.raises(SwapError, match="weights files not in its manifest: model-00002.safetensors"):
        check_folder(extra, base)


def test_the_admin_token_comes_from_the_environment_or_a_file_never_the_config(monkeypatch, tmp_path):
    from loop.config import load_config
    from loop.configs import ConfigError

    with pytest.raises(ConfigError, match="serve: admin_token: a secret in the config"):
        load_config("conf/tiny.yaml", ["serve.admin_token=hunter2"])
    with pytest.raises(ConfigError, match="mlflow: tracking_uri holds a password"):
        load_config("conf/tiny.yaml", ["mlflow.tracking_uri=postgresql://u:hunter2@db/mlflow"])
    monkeypatch.delenv("FLYWHEEL_ADMIN_TOKEN", raising=False)
    assert ServeConfig().resolved_admin_token() is None
    (tmp_path / "token").write_text("from-file\n")
    assert ServeConfig(admin_token_file=str(tmp_path / "token")).resolved_admin_token() == "from-file"
    with pytest.raises(ValueError, match="serve.admin_token_file: cannot read"):
        ServeConfig(admin_token_file=str(tmp_path / "nope")).resolved_admin_token()
    monkeypatch.setenv("FLYWHEEL_ADMIN_TOKEN", "from-env")
    assert ServeConfig(admin_token_file=str(tmp_path / "token")).resolved_admin_token() == "from-env"


def test_a_server_reachable_by_others_needs_an_api_key(monkeypatch):
    with pytest.raises(ValueError, match="api_key_env must name"):
        ServeConfig(host="0.0.0.0")
    assert ServeConfig(host="::1").api_key_env is None and ServeConfig(host="localhost").resolved_api_key() is None
    cfg = ServeConfig(host="0.0.0.0", api_key_env="FLYWHEEL_TEST_API_KEY")
    monkeypatch.delenv("FLYWHEEL_TEST_API_KEY", raising=False)
    with pytest.raises(ValueError, match="serve.api_key_env: .*FLYWHEEL_TEST_API_KEY is not set"):
        cfg.resolved_api_key()
    monkeypatch.setenv("FLYWHEEL_TEST_API_KEY", "k1")
    assert cfg.resolved_api_key() == "k1"


def test_vllm_routes_that_change_the_server_are_off_and_v1_takes_the_key():
    """vLLM's own app (no engine: its handlers are not reached), as the server builds it."""
    from fastapi.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rollout.server.app import turn_off_unserved_routes

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        vllm_cli_args(ServeConfig(tool_call_parser="hermes"), EngineConfig(), "/m"))
    args.api_key = ["k1"]
    app = build_app(args, ("generate",), None)
    removed = turn_off_unserved_routes(app)
    assert "POST /scale_elastic_ep" in removed and "POST /inference/v1/abort_requests" in removed
    assert "POST /v1/responses" in removed and "POST /v1/chat/completions" not in removed
    client = TestClient(app, raise_server_exceptions=False)
    for path in ("/scale_elastic_ep", "/is_scaling_elastic_ep", "/inference/v1/generate", "/v1/messages"):
        assert client.post(path, json={}).status_code in (401, 404), path  # gone (or refused first)
        assert client.post(path, json={}, headers={"authorization": "Bearer k1"}).status_code == 404, path
    assert client.post("/v1/chat/completions", json={}).status_code == 401
    assert client.post("/v1/chat/completions", json={}, headers={"authorization": "Bearer k1"}).status_code != 401
    paths = app.openapi()["paths"]
    assert "/scale_elastic_ep" not in paths and "/v1/chat/completions" in paths
