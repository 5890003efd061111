"""quantization.weight_only and modes: ORT's packer against the NumPy RTN reference; bad group sizes and modes."""
from dataclasses import replace

import numpy as np
import pytest

from engine.core.errors import EngineError
from engine.core.model_config import QuantConfig
from engine.quantization import modes
from engine.quantization.weight_only import (WeightOnlyScheme, dequantize, quantize, rtn_scales, signed_values,
                                             stored_bytes)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 32, 64])
def test_packer_matches_numpy_rtn(bits, group):
    rng = np.random.default_rng(bits * 100 + group)
    w = (rng.standard_normal((24, 128)) * rng.uniform(0.01, 3, (24, 1))).astype(np.float32)
    q = quantize(w, WeightOnlyScheme(bits, group))
    # stored at their precision: uint8 holding `bits` per value, one float32 scale per group
    assert q.packed.dtype == np.uint8 and q.packed.shape == (24, 128 // group, group * bits // 8)
    assert q.scales.dtype == np.float32 and q.scales.shape == (24, 128 // group)
    assert q.packed.nbytes + q.scales.nbytes == stored_bytes(24, 128, bits, group)
    # scales are reproducible from the float weight, and the integers are NumPy's round-to-nearest
    scales = rtn_scales(w, bits, group)
    np.testing.assert_array_equal(q.scales, scales)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    expected = np.clip(np.round(w.reshape(24, -1, group) / scales[..., None]), lo, hi).reshape(24, 128)
    np.testing.assert_array_equal(signed_values(q), expected)
    # RTN error bound: half a step, except the value of opposite sign to the group's extreme that the
    # asymmetric range [-2**(b-1), 2**(b-1) - 1] clips, which is off by at most one step
    step = np.repeat(np.abs(scales), group, axis=1)
    err = np.abs(dequantize(q) - w)
    clipped = signed_values(q) == hi
    assert (err[~clipped] <= step[~clipped] / 2 * (1 + 1e-5)).all()
    assert (err <= step * (1 + 1e-5)).all()


def test_int4_uses_both_nibbles_and_full_range():
    w = np.linspace(-1, 1, 32, dtype=np.float32)[None, :].repeat(2, axis=0)
    q = quantize(w, WeightOnlyScheme(4, 32))
    values = signed_values(q)
    assert values.min() == -8 and values.max() == 7
    assert q.packed.shape == (2, 1, 16)


@pytest.mark.parametrize("group,match", [(48, "not supported"), (512, "not supported"), (64, "does not divide")])
def test_bad_group_size(group, match):
    with pytest.raises(EngineError, match=match):
        quantize(np.zeros((4, 96), np.float32), WeightOnlyScheme(4, group), name="layers.0.mlp.down.weight")


def test_split_dtype():
    assert modes.split_dtype("int8_wo") == ("float32", "int8_wo")
    assert modes.split_dtype("int4_wo") == ("float32", "int4_wo")
    assert modes.split_dtype("bf16") == ("bfloat16", None)
    for calibrated in ("int4_awq", "fp8", "int8_sq"):
        assert modes.split_dtype(calibrated) == ("float32", calibrated)
    for planned in ("w4a8_awq", "nvfp4"):
        with pytest.raises(EngineError, match="not implemented yet"):
            modes.split_dtype(planned)
    with pytest.raises(EngineError, match="'int3_wo' is unknown"):
        modes.split_dtype("int3_wo")




def test_resolve_defaults_and_checks():
    from engine.core.model_config import ModelConfig
    m = ModelConfig("LlamaForCausalLM", vocab_size=512, hidden_size=576, num_layers=1, num_heads=9,
                    num_kv_heads=3, head_dim=64, intermediate_size=1536, norm_eps=1e-5,
                    max_position_embeddings=256)
    # int8_wo: the largest supported group up to 32 dividing every in feature (576, 1536: 32; 48: 16)
    assert modes.resolve(QuantConfig(mode="int8_wo"), m, 1).group_size == 32
    assert modes.resolve(QuantConfig(mode="int8_wo"), replace(m, hidden_size=48, num_heads=3, num_kv_heads=1,
                                                                head_dim=16), 1).group_size == 16
    r = modes.resolve(QuantConfig(mode="int4_wo"), m, 1)
    assert (r.group_size, r.accuracy_level) == (32, 4)
    assert modes.resolve(QuantConfig(), m, 1) == QuantConfig()
    with pytest.raises(EngineError, match="group size 128 does not divide the 576"):
        modes.resolve(QuantConfig(mode="int4_wo", group_size=128), m, 1)
    with pytest.raises(EngineError, match="accuracy-level 3"):
        modes.resolve(QuantConfig(mode="int4_wo", accuracy_level=3), m, 1)
    with pytest.raises(EngineError, match="not implemented yet"):
        modes.resolve(QuantConfig(mode="nvfp4"), m, 1)
    # int4_awq: ModelOpt's block size 128 at most, the largest that divides 576 and 1536
    assert modes.resolve(QuantConfig(mode="int4_awq"), m, 1).group_size == 64
    assert modes.resolve(QuantConfig(mode="fp8"), m, 1) == QuantConfig(mode="fp8")
