"""The hot-swap's failure paths on a scripted engine (the leaf that cannot be made to fail on
demand: a real vLLM engine does not refuse a prefix-cache reset or a reload when asked). The
folders, their checks, the canary arithmetic and the gate are the real ones."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from srv_util import perturbed_copy

from rollout.capabilities import Capabilities
from rollout.server.engine import Gate, GateFailed, TracingEngine, WeightState
from rollout.server.swap import HotSwapper, SwapError, checkpoint_sha256

CAPS = Capabilities("cpu", "_C", None, ("w4a16", "w8a8", "none"), 0, "nearest")


class ScriptedEngine:
    """What HotSwapper calls on vLLM's AsyncLLM. The canary's logprobs are those of the folder
    loaded last (`logprobs[path]`); `fail` names calls that raise or report failure."""

    def __init__(self, logprobs: dict[str, float], loaded: str):
        self.logprobs, self.loaded, self.fail, self.calls = logprobs, loaded, set(), []

    def get_tokenizer(self):
        return SimpleNamespace(encode=lambda text, add_special_tokens=True: list(range(1, 9)),
                               apply_chat_template=lambda messages, **kw: "".join(m["content"] for m in messages))

    async def collective_rpc(self, method, args=(), kwargs=None):
        name = method if isinstance(method, str) else method.__name__
        path = (kwargs or {}).get("weights_path")
        self.calls.append((name, path))
        if name == "reload_weights":
            if ("reload", path) in self.fail:
                raise RuntimeError(f"reload of {path} failed")
            self.loaded = path
        return [True]

    async def reset_prefix_cache(self, *args) -> bool:
        self.calls.append(("reset_prefix_cache", None))
        if "reset" in self.fail:
            self.fail.discard("reset")  # once
            return False
        return True

    async def update_weight_version(self, version: str) -> None:
        self.calls.append(("update_weight_version", version))

    async def pause_generation(self, mode: str, clear_cache: bool) -> None:
        self.calls.append(("pause_generation", mode))

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation", None))

    async def generate(self, prompt, params, request_id):
        lp = self.logprobs[self.loaded]
        ids = prompt["prompt_token_ids"]
        yield SimpleNamespace(prompt_logprobs=[None] + [{t: SimpleNamespace(logprob=lp)} for t in ids[1:]])


@pytest.fixture
def folders(tiny_base, tmp_path):
    return str(tiny_base.path), str(perturbed_copy(tiny_base.path, tmp_path / "new").resolve())


def _swapper(old: str, new: str, stack=None, ledger=None):
    inner = ScriptedEngine({old: -1.0, new: -2.0}, loaded=old)
    engine = TracingEngine(inner, WeightState(0, old, checkpoint_sha256(old), stack=stack))
    reference = lambda path, ids: [{old: -1.0, new: -2.0}[str(path)]] * (len(ids) - 1)  # noqa: E731
    return HotSwapper(engine, 0.05, drain_timeout_s=1, reference=reference, caps=CAPS, ledger=ledger), engine, inner


def test_an_in_place_swap_keeps_the_engines_stack(folders):
    old, new = folders
    second_engines_stack = object()  # what an earlier W8A8 switch left (a StackFingerprint)
    swapper, engine, _ = _swapper(old, new, stack=second_engines_stack)
    result = asyncio.run(swapper.swap(new))
    assert result.weight_version == 1 and engine.weights.path == new
    assert engine.weights.stack is second_engines_stack


def test_a_failed_prefix_cache_reset_fails_the_swap_and_restores(folders):
    old, new = folders
    swapper, engine, inner = _swapper(old, new)
    inner.fail.add("reset")
    with pytest.raises(SwapError) as e:
        asyncio.run(swapper.swap(new))
    assert e.value.status == 422 and e.value.restored and "prefix cache" in e.value.message
    assert engine.weights.path == old and inner.loaded == old and engine.gate.is_open


def test_a_failed_restore_closes_the_server_for_good(folders):
    old, new = folders
    swapper, engine, inner = _swapper(old, new)
    swapper.reference = lambda path, ids: [-1.0] * (len(ids) - 1)  # the new folder fails its canary
    inner.fail.add(("reload", old))  # ... and the old one cannot be reloaded

    async def run():
        with pytest.raises(SwapError) as e:
            await swapper.swap(new)
        assert e.value.status == 500 and not e.value.restored and "unknown weights" in e.value.message
        assert not engine.gate.is_open and "unknown weights" in engine.gate.failure
        with pytest.raises(GateFailed, match="unknown weights"):
            async with engine.gate.admit():
                pass

    asyncio.run(run())


def test_callers_waiting_at_a_gate_that_fails_are_refused():
    async def run():
        gate = Gate()
        assert await gate.close(timeout=1)
        waiter = asyncio.create_task(_enter(gate))
        await asyncio.sleep(0.01)
        gate.fail("weights unknown")
        gate.open()  # a late open() does not reopen a failed gate
        with pytest.raises(GateFailed, match="weights unknown"):
            await waiter
        assert not gate.is_open and gate.in_flight == 0

    async def _enter(gate):
        async with gate.admit():
            pass

    asyncio.run(run())


def test_a_keep_swap_pauses_in_place_relabels_and_restores_on_a_bad_canary(folders):
    old, new = folders
    swapper, engine, inner = _swapper(old, new)
    result = asyncio.run(swapper.swap(new, mode="keep"))
    assert result.mode == "keep" and engine.weights.path == new and engine.gate.is_open
    names = [c[0] for c in inner.calls]
    assert names.index("pause_generation") < names.index("reload_weights") < names.index("resume_generation")
    assert ("update_weight_version", "1") in inner.calls and "reset_prefix_cache" not in names  # the pause did it

    inner.calls.clear()
    inner.logprobs[old] = -3.0  # the engine now serves `old` wrongly: its canary fails
    with pytest.raises(SwapError) as e:
        asyncio.run(swapper.swap(old, mode="keep"))
    assert e.value.status == 422 and e.value.restored
    assert engine.weights.path == new and inner.loaded == new and engine.gate.is_open
    labels = [c[1] for c in inner.calls if c[0] == "update_weight_version"]
    assert labels == ["2", "1"]  # the rejected version's tokens keep its label; then back to 1


def test_a_folder_with_another_layer_plan_needs_a_second_engine(tmp_path):
    """An engine's layers are built for one layer plan (config.json `ignore`): a W4A16 folder with
    other full-precision layers cannot reload in place; a format change is refused elsewhere."""
    import json

    from rollout.server.swap import needs_new_engine

    def folder(name, ignore=None, bits=4, acts=None):
        d = tmp_path / name
        d.mkdir()
        config = {"architectures": ["Qwen2ForCausalLM"]}
        if ignore is not None:
            config["quantization_config"] = {"quant_method": "compressed-tensors", "ignore": ignore, "config_groups": {
                "group_0": {"weights": {"num_bits": bits}, "input_activations": acts}}}
        (d / "config.json").write_text(json.dumps(config))
        return str(d)

    serving = folder("serving", ["lm_head"])
    assert not needs_new_engine(folder("same", ["lm_head"]), CAPS, current=serving)
    assert needs_new_engine(folder("other", ["lm_head", "model.layers.0.mlp.down_proj"]), CAPS, current=serving)
    assert not needs_new_engine(folder("fp"), CAPS, current=serving)  # check_folder's 409, not a second engine
    assert needs_new_engine(folder("w8a8", ["lm_head"], bits=8, acts={"num_bits": 8}), CAPS, current=serving)


def test_a_reload_rounds_the_int8_paths_biases_as_the_start_did():
    """vLLM's in-place reload leaves the fp32 bias of AMX's int8-activation W4A16 layers unrounded
    (at start it went through the model dtype); the real-engine check is the exact rollback in
    test_promote.py on an AMX machine. Here the worker is a stand-in, the rounding the real one."""
    import torch

    from rollout.server.reload import round_int8_path_biases

    g = torch.Generator().manual_seed(0)
    int8_path, plain = torch.nn.Linear(4, 8), torch.nn.Linear(4, 8)
    int8_path.use_w4a8 = True
    for m in (int8_path, plain):
        m.bias.data = torch.randn(8, generator=g)  # fp32, as the checkpoint's values after a reload
    before = plain.bias.detach().clone()
    model = torch.nn.Sequential(int8_path, plain)
    worker = SimpleNamespace(model_runner=SimpleNamespace(
        model=model, vllm_config=SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))))
    expected = int8_path.bias.detach().to(torch.bfloat16).float()
    assert not torch.equal(int8_path.bias, expected)
    assert round_int8_path_biases(worker) == 1
    assert int8_path.bias.dtype == torch.float32 and torch.equal(int8_path.bias, expected)
    assert torch.equal(plain.bias, before)  # another kernel keeps its bias in the model dtype itself


def test_a_weight_version_names_one_checkpoint_forever(folders, tmp_path):
    """A failed keep swap served traffic as 1 and restored 0; on c8fb06b the next swap took 1
    again, for another checkpoint. The ledger hands out each number once, also across a restart."""
    import json

    from rollout.server.versions import VersionLedger, read_ledger

    old, new = folders
    ledger_path = tmp_path / "weight_versions.jsonl"
    swapper, engine, inner = _swapper(old, new, ledger=VersionLedger(ledger_path))
    inner.logprobs[new] = -3.0  # `new` fails its canary after the keep swap resumed on it
    with pytest.raises(SwapError):
        asyncio.run(swapper.swap(new, mode="keep"))
    assert engine.weights.version == 0 and engine.weights.path == old
    inner.logprobs[new] = -2.0
    assert asyncio.run(swapper.swap(new)).weight_version == 2  # 1 is burnt: its tokens named `new` once
    entries = read_ledger(ledger_path)
    assert [e["version"] for e in entries] == [1, 2] and {e["path"] for e in entries} == {new}
    by_version = {}
    for e in entries:
        assert by_version.setdefault(e["version"], e["checkpoint_sha256"]) == e["checkpoint_sha256"]
    with open(ledger_path, "a") as f:
        f.write('{"version": 7, "chec')  # a kill mid-append: that line never counted
    restarted = VersionLedger(ledger_path, start=0)
    assert restarted.allocate(checkpoint_sha256(old), old, "start") == 3
    assert json.loads(ledger_path.read_text().splitlines()[-1])["version"] == 3


def test_a_fleet_shares_one_number_per_checkpoint_and_never_a_burnt_one(tmp_path):
    """Replicas (one ledger, `shared`) serving one checkpoint carry one number, also going back to
    it; a keep swap's number is never shared, and a lone server's numbers only grow."""
    from rollout.server.versions import VersionLedger, read_ledger

    path = tmp_path / "weight_versions.jsonl"
    r0, r1 = VersionLedger(path, shared=True), VersionLedger(path, shared=True)
    assert r0.allocate("a" * 64, "/base", "start") == 0 and r1.allocate("a" * 64, "/base", "start") == 0
    assert r0.allocate("b" * 64, "/cand", "swap", at_least=1) == 1
    assert r1.allocate("b" * 64, "/cand", "swap", at_least=1) == 1  # the rolling swap's second replica
    assert r1.allocate("a" * 64, "/base", "swap", at_least=2) == 0  # rolled back: the base's number again
    assert r0.allocate("c" * 64, "/c", "swap (keep)", at_least=2) == 2
    assert r1.allocate("c" * 64, "/c", "swap (keep)", at_least=1) == 3  # a keep swap's number is its own
    assert r1.allocate("c" * 64, "/c", "swap", at_least=4) == 4
    assert r0.allocate("c" * 64, "/c", "swap (second engine)", at_least=3) == 4  # W8A8's way: shared too
    assert VersionLedger(path).allocate("a" * 64, "/base", "start") == 5  # a lone server never shares
    assert [e["version"] for e in read_ledger(path)] == [0, 1, 2, 3, 4, 5]


def test_a_swap_refuses_other_weights_than_the_gated_and_another_serving_version(folders):
    old, new = folders
    swapper, engine, inner = _swapper(old, new)
    with pytest.raises(SwapError, match="not the gated") as e:
        asyncio.run(swapper.swap(new, expected_sha="0" * 64))
    assert e.value.status == 409
    with pytest.raises(SwapError, match="not the expected") as e:
        asyncio.run(swapper.swap(new, expected_current_sha=checkpoint_sha256(new)))
    assert e.value.status == 409 and engine.weights.path == old and not inner.calls
    result = asyncio.run(swapper.swap(new, expected_sha=checkpoint_sha256(new),
                                      expected_current_sha=checkpoint_sha256(old)))
    assert result.checkpoint_sha256 == checkpoint_sha256(new) and engine.weights.path == new


def test_bytes_changed_while_loading_restore_the_old_weights(folders):
    """The swap hashes the folder again after the load: a file rewritten under it is refused."""
    from pathlib import Path

    old, new = folders
    swapper, engine, inner = _swapper(old, new)
    real_rpc = inner.collective_rpc

    async def rewriting_rpc(method, args=(), kwargs=None):
        out = await real_rpc(method, args, kwargs)
        if (kwargs or {}).get("weights_path") == new:
            shard = Path(new) / "model.safetensors"
            shard.write_bytes(shard.read_bytes()[:-4] + b"\0\0\0\0")
        return out

    inner.collective_rpc = rewriting_rpc
    with pytest.raises(SwapError, match="changed while it loaded") as e:
        asyncio.run(swapper.swap(new))
    assert e.value.restored and engine.weights.path == old and inner.loaded == old


def test_the_canary_is_a_conversation_in_the_models_own_chat_format(folders, tiny_tokenizer):
    """The canary prompt is rendered by the served model's chat template (a Llama's headers, not
    ChatML); a model with no chat template gets the conversation as plain text."""
    from rollout.server.swap import CANARY_MESSAGES

    old, new = folders
    swapper, _, inner = _swapper(old, new)
    inner.get_tokenizer = lambda: tiny_tokenizer
    rendered = tiny_tokenizer.apply_chat_template(CANARY_MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith("<|im_start|>system") and swapper.canary_ids() == tiny_tokenizer.encode(
        rendered, add_special_tokens=False)

    def no_template(messages, **kw):
        raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set")

    swapper, _, inner = _swapper(old, new)
    inner.get_tokenizer = lambda: SimpleNamespace(apply_chat_template=no_template,
                                                  encode=lambda text, add_special_tokens=True: [ord(c) for c in text])
    assert swapper.canary_ids() == [ord(c) for c in "\n".join(m["content"] for m in CANARY_MESSAGES)]


def test_the_canary_admits_the_gap_the_serving_weights_show_and_no_broken_reload(folders):
    """A model whose engine sits further from its float32 reference than the format's bound (a tiny
    Qwen3 in W8A8 on an AVX2 machine: 0.22 against 0.15) swaps in, because the serving weights of
    that format show the same gap on this engine; a broken reload (off by more than 1) does not."""
    old, new = folders
    inner = ScriptedEngine({old: -1.0, new: -2.0}, loaded=old)
    engine = TracingEngine(inner, WeightState(0, old, checkpoint_sha256(old)))
    reference = {old: -1.3, new: -2.3}  # both 0.3 from what the engine computes
    swapper = HotSwapper(engine, None, drain_timeout_s=1, reference=lambda p, ids: [reference[str(p)]] * (len(ids) - 1),
                         caps=CAPS)
    assert CAPS.canary_tolerance("none") < 0.3  # the format's bound alone refuses this model
    result = asyncio.run(swapper.swap(new))
    assert engine.weights.path == new and result.canary_mean_abs_dlogprob == pytest.approx(0.3)
    assert swapper.tolerance(new) == pytest.approx(0.6)

    inner.logprobs[old] = -4.0  # reloading `old` now yields garbage: 2.7 from its reference
    with pytest.raises(SwapError) as e:
        asyncio.run(swapper.swap(old))
    assert e.value.restored and engine.weights.path == new and inner.loaded == new and engine.gate.is_open
