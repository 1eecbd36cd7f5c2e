"""quantize_ prepare/convert on a tiny real Qwen2: prepare wraps exactly the served linear layers
and trains through them; convert holds the real quantized weights, equal bit for bit to the
fake-quant weights and to requantizing the latent checkpoint (torchao's QAT-vs-PTQ check, atol=0).
vLLM serving of a converted model is in tests/pipelines/test_quantize.py."""

import copy

import pytest
import torch
from safetensors.torch import load_file

from kernels import QuantizedLinear, QuantSpec
from trainers.qat import FakeQuantLinear, quantize_

VOCAB = 512
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _tiny(seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=256, vocab_size=VOCAB, tie_word_embeddings=True,
                      initializer_range=0.2, max_position_embeddings=256)
    return Qwen2ForCausalLM(cfg).float()


def _train(model, steps=3, seed=1):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (4, 33), generator=g)
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_prepare_wraps_the_served_linears_and_trains():
    model = _tiny()
    params = {n: p for n, p in model.named_parameters()}
    keys = set(model.state_dict())
    before = {n: p.detach().clone() for n, p in params.items()}
    quantize_(model, QuantSpec.w4a16(32), "prepare")

    wrapped = {n for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)}
    assert wrapped == {f"model.layers.{i}.{'self_attn' if l[0] in 'qkvo' else 'mlp'}.{l}"
                       for i in range(2) for l in LINEARS}
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight is model.model.embed_tokens.weight
    assert set(model.state_dict()) == keys
    assert all(p is params[n] for n, p in model.named_parameters()), "prepare must not copy parameters"

    losses = _train(model.train())
    assert all(torch.isfinite(torch.tensor(losses)))
    for name in wrapped:
        w = model.get_submodule(name).weight
        assert not torch.equal(w, before[f"{name}.weight"]), f"{name} did not train"

    with pytest.raises(ValueError, match="already prepared"):
        quantize_(model, QuantSpec.w4a16(32), "prepare")


def test_prepare_errors_name_the_problem():
    with pytest.raises(ValueError, match="step"):
        quantize_(_tiny(), QuantSpec.w4a16(32), "train")
    with pytest.raises(ValueError, match="fused"):
        quantize_(_tiny(), QuantSpec.w4a16(32), "prepare", full_precision=["model.layers.0.mlp.gate_proj"])
    with pytest.raises(ValueError, match="full_precision"):
        quantize_(_tiny(), QuantSpec.w4a16(32), "prepare", full_precision=["model.layers.0.mlp.nope"])
    model = quantize_(_tiny(), QuantSpec.w4a16(32), "prepare")
    with pytest.raises(ValueError, match="spec differs"):
        quantize_(model, QuantSpec.w4a16(64), "convert")


@pytest.mark.parametrize("spec", [QuantSpec.w4a16(32, symmetric=False), QuantSpec.w8a8()],
                         ids=lambda s: s.name)
def test_convert_is_the_trained_function(spec, tmp_path):
    from pipelines.quantize import quantize_checkpoint, save_quantized

    keep = ("model.layers.1.mlp.down_proj",)
    model = quantize_(_tiny(), spec, "prepare", full_precision=keep)
    _train(model.train())
    model.eval()
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fq_logits = model(ids).logits
    fq_weights = {n: m.fake_quantized_weight().detach() for n, m in model.named_modules()
                  if isinstance(m, FakeQuantLinear)}
    model.save_pretrained(tmp_path / "latent")  # the trainer's checkpoint: latent float weights

    converted = quantize_(copy.deepcopy(model), spec, "convert")
    layers = {n: m for n, m in converted.named_modules() if isinstance(m, QuantizedLinear)}
    assert set(layers) == set(fq_weights) and keep[0] not in layers
    for name, layer in layers.items():  # atol=0, rtol=0
        assert torch.equal(layer.dequantized_weight(torch.float32).view(torch.int32),
                           fq_weights[name].view(torch.int32)), name
    # Layer by layer, on the very inputs the trained model saw: the same function up to float32
    # rounding (the int8 GEMM sums exactly; the fake-quant one in float32).
    inputs = {}
    hooks = [m.register_forward_hook(lambda mod, args, out, n=n: inputs.__setitem__(n, (args[0], out)))
             for n, m in model.named_modules() if isinstance(m, FakeQuantLinear)]
    with torch.no_grad():
        model(ids)
        for h in hooks:
            h.remove()
        for name, (x, want) in inputs.items():
            torch.testing.assert_close(layers[name](x), want, rtol=1e-5, atol=1e-5, msg=name)
        # End to end those roundings can move a next layer's activation across an int8 rounding
        # boundary (the float GEMM's summation order is the CPU's): rare, one step each.
        got = converted(ids).logits
        far = ((got - fq_logits).abs() > 1e-4 + 1e-4 * fq_logits.abs()).float().mean()
        assert far < 0.05 and (got - fq_logits).abs().max() < 0.2, (far, (got - fq_logits).abs().max())

    # convert == requantizing the latent checkpoint, tensor for tensor.
    save_quantized(converted, tmp_path / "from_convert", spec)
    quantize_checkpoint(tmp_path / "latent", tmp_path / "from_latent", spec, full_precision=keep)
    a = load_file(tmp_path / "from_convert" / "model.safetensors")
    b = {}
    for f in (tmp_path / "from_latent").glob("*.safetensors"):
        b |= load_file(f)
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
