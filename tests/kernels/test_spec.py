"""QuantSpec accepts exactly the served formats and names the offending field otherwise."""

import pytest

from kernels import QuantSpec


def test_presets():
    assert QuantSpec.w4a16(64).format == "pack-quantized"
    assert QuantSpec.w4a16(64, symmetric=False).name == "W4A16_ASYM"
    assert QuantSpec.w4a16(None).granularity == "channel"
    w8 = QuantSpec.w8a8()
    assert (w8.format, w8.name, w8.qmin, w8.qmax) == ("int-quantized", "W8A8", -128, 127)
    assert QuantSpec.from_dict(w8.to_dict()) == w8


@pytest.mark.parametrize("kwargs,field", [
    ({"weight_bits": 3}, "weight_bits"),
    ({"symmetric": 1}, "symmetric"),
    ({"granularity": "tensor"}, "granularity"),
    ({"group_size": 7}, "group_size"),
    ({"group_size": 0}, "group_size"),
    ({"granularity": "channel", "group_size": 32}, "group_size"),
    ({"activations": "fp8"}, "activations"),
    ({"activations": "int8_dynamic_token"}, "activations"),        # W4A8 is not served
    ({"rounding": "stochastic"}, "rounding"),
    ({"scale_dtype": "float8"}, "scale_dtype"),
    ({"weight_bits": 8, "granularity": "channel", "group_size": None}, "activations"),  # W8A16
    ({"weight_bits": 8, "granularity": "channel", "group_size": None,
      "activations": "int8_dynamic_token", "symmetric": False}, "symmetric"),
    ({"weight_bits": 8, "activations": "int8_dynamic_token"}, "granularity"),
])
def test_rejects_unserved(kwargs, field):
    with pytest.raises(ValueError, match=field):
        QuantSpec(**kwargs)
    with pytest.raises(ValueError, match="unknown"):
        QuantSpec.from_dict({"bits": 4})


def test_group_divisibility():
    with pytest.raises(ValueError, match="multiple of group_size"):
        QuantSpec.w4a16(32).group_len(48)
    assert QuantSpec.w4a16(None).group_len(48) == 48
