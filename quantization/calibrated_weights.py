"""Calibrated projections (int8_sq, fp8, int4_awq): what ModelOpt's calibration leaves for one linear, as the
tensors the builder lowers, named next to their weight (TensorRT-LLM's names):

    {stem}.weight                      the quantized values [out, in]: int8 (int8_sq; the graph stores it as uint8
                                       with zero point 128, see plugins/calibrated_linear.py), float8 e4m3 (fp8),
                                       int8 holding -8..7 (int4_awq; packed for MatMulNBits when lowered)
    {stem}.weights_scaling_factor      float32: [out] per channel (int8_sq), scalar (fp8), [out, in/g] (int4_awq)
    {stem}.activation_scaling_factor   float32 scalar, static input scale (fp8)
    {stem}.prequant_scaling_factor     float32 [in]: the SmoothQuant / AWQ input scale, x * s before the matmul
                                       (the weight already holds its inverse)

    w ~= values * weights_scaling_factor (per row / group),   y = (x * prequant) @ w^T

`CalibratedTensors` overlays these on the checkpoint's tensors for one build; nothing here knows ONNX.

Tensor parallelism: calibration runs once on the whole (tp 1) model, and `shard_calibrated` gives each rank the slice
of it that goes with the rank's weights (TensorRT-LLM's split): the rows of column-parallel values and their
per-output-channel scales (q/k/v by heads, a replicated KV head copied; gate/up; lm_head by vocabulary, padded), the
columns of row-parallel values (attention.dense, mlp.down) with their per-input-channel scales (prequant, AWQ's
group scales); per-tensor scales and scales along a dimension tp does not split are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, MutableMapping

import ml_dtypes
import numpy as np
import torch

from engine.core.model_config import ModelConfig
from engine.core.sharding import PARTS, shard
from engine.core.tensors import split_name

CALIBRATED = ("int8_sq", "fp8", "int4_awq")
# modes whose quantized lm_head table a tied embedding can read (ONNX Gather takes no float8 tensor)
SHARED_TABLE = ("int8_sq", "int4_awq")
FP8_MAX = 448.0          # largest float8 e4m3fn
SCALE_SUFFIXES = ("weights_scaling_factor", "activation_scaling_factor", "prequant_scaling_factor")


@dataclass(frozen=True)
class CalibratedWeight:
    mode: str
    values: np.ndarray                      # [out, in], see the module docstring
    weight_scale: np.ndarray                # float32
    input_scale: np.ndarray | None = None   # float32 scalar (fp8)
    prequant: np.ndarray | None = None      # float32 [in]
    group_size: int | None = None           # int4_awq

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def rows(self, start: int, stop: int) -> "CalibratedWeight":
        """The output rows start..stop (gate or up of a fused gate_up); per-tensor scales are shared."""
        scale = self.weight_scale if self.weight_scale.ndim == 0 else self.weight_scale[start:stop]
        return CalibratedWeight(self.mode, self.values[start:stop], scale, self.input_scale, self.prequant,
                                self.group_size)

    def dequantize(self) -> np.ndarray:
        """NumPy reference: the float32 [out, in] weight the kernels compute with (prequant not applied)."""
        v = self.values.astype(np.float32)
        if self.mode == "int4_awq":
            n, k = v.shape
            return (v.reshape(n, -1, self.group_size) * self.weight_scale[:, :, None]).reshape(n, k)
        s = self.weight_scale
        return v * (s[:, None] if s.ndim == 1 else s)

    def tensors(self, stem: str) -> dict[str, np.ndarray]:
        out = {f"{stem}.weight": self.values, f"{stem}.weights_scaling_factor": self.weight_scale}
        if self.input_scale is not None:
            out[f"{stem}.activation_scaling_factor"] = self.input_scale
        if self.prequant is not None:
            out[f"{stem}.prequant_scaling_factor"] = self.prequant
        return out


def quantize_weight(mode: str, weight: np.ndarray, weight_amax: np.ndarray, *, input_amax: float | None = None,
                    prequant: np.ndarray | None = None, group_size: int | None = None) -> CalibratedWeight:
    """Quantize a float [out, in] weight with the amax ModelOpt calibrated for it, as ModelOpt's fake quantizer
    does (scale = amax / max representable; round to nearest, saturate)."""
    w = np.asarray(weight, dtype=np.float32)
    amax = np.maximum(np.asarray(weight_amax, dtype=np.float32), np.float32(1e-12))
    pre = None if prequant is None else np.asarray(prequant, dtype=np.float32).reshape(-1)
    if mode == "int8_sq":
        scale = (amax.reshape(-1) / 127.0).astype(np.float32)                       # [out]
        values = np.clip(np.round(w / scale[:, None]), -127, 127).astype(np.int8)
        return CalibratedWeight(mode, values, scale, prequant=pre)
    if mode == "fp8":
        scale = np.float32(amax.max() / FP8_MAX)
        values = np.clip(w / scale, -FP8_MAX, FP8_MAX).astype(ml_dtypes.float8_e4m3fn)
        in_scale = np.array(max(float(input_amax), 1e-12) / FP8_MAX, dtype=np.float32)
        return CalibratedWeight(mode, values, np.array(scale, np.float32), input_scale=in_scale, prequant=pre)
    if mode == "int4_awq":
        n, k = w.shape
        scale = (amax.reshape(n, k // group_size) / 7.0).astype(np.float32)         # [out, in/g]
        values = np.clip(np.round(w.reshape(n, -1, group_size) / scale[:, :, None]), -8, 7)
        return CalibratedWeight(mode, values.reshape(n, k).astype(np.int8), scale, prequant=pre,
                                group_size=group_size)
    raise AssertionError(mode)


def pack_int4(values: np.ndarray, group_size: int) -> np.ndarray:
    """Signed int4 values [N, K] -> MatMulNBits' packed uint8 [N, K/g, g/2]: zero point 8, low nibble first
    (quantization/weight_only.py's layout)."""
    n, k = values.shape
    u = (values.astype(np.int16) + 8).astype(np.uint8).reshape(n, k // group_size, group_size // 2, 2)
    return (u[..., 0] | (u[..., 1] << 4)).astype(np.uint8)


def stored_bytes(mode: str, out_features: int, in_features: int, group_size: int | None) -> int:
    """Bytes of one calibrated projection as stored: values, scales and the SmoothQuant / AWQ input scale."""
    if mode == "int8_sq":
        return out_features * in_features + 5 * out_features + 4 * in_features  # + uint8 zero points
    if mode == "fp8":
        return out_features * in_features + 8
    if mode == "int4_awq":
        return out_features * in_features // 2 + 4 * out_features * (in_features // group_size) + 4 * in_features
    raise AssertionError(mode)


_ROW_PARALLEL = ("attention.dense", "mlp.down")
# the stem of a tied embedding's own quantized table at tp > 1 (not the checkpoint's name, which the builder pops)
EMBEDDING_TABLE = "vocab_embedding.calibrated"


def _rank_rows(stem: str, model: ModelConfig, tp: int, rank: int) -> np.ndarray:
    """Indices of the tp-1 rows of packed `stem` ("layers.3.attention.qkv", "lm_head") that rank `rank` holds, in its
    order; -1 marks a padding row (a vocabulary padded to a multiple of tp). core/sharding.shard picks them, so the
    slices are the float weights' own."""
    prefix, suffix, _ = split_name(f"{stem}.weight")
    sizes = {"attention.q": model.q_size, "attention.k": model.kv_size, "attention.v": model.kv_size,
             "mlp.gate": model.intermediate_size, "mlp.up": model.intermediate_size, "lm_head": model.vocab_size}
    picked, start = [], 0
    for part in PARTS.get(suffix, (suffix,)):
        # 1-based so that the zero rows shard() pads a vocabulary with come out as -1
        index = torch.arange(start + 1, start + sizes[part] + 1)
        picked.append(shard(f"{prefix}{part}.weight", index, model, tp, rank).numpy() - 1)
        start += sizes[part]
    return np.concatenate(picked)


def _take_rows(a: np.ndarray, rows: np.ndarray) -> np.ndarray:
    out = a[np.maximum(rows, 0)]
    out[rows < 0] = 0   # padding rows: zero values and scales, as the float lm_head's padding
    return out


def shard_calibrated(calibrated: dict[str, np.ndarray], model: ModelConfig, mode: str, tp: int,
                     rank: int) -> dict[str, np.ndarray]:
    """The calibrated tensors of rank `rank` of `tp` from those of the whole model (see the module docstring). A tied
    embedding that reads the quantized lm_head's table (SHARED_TABLE) gets the whole table as EMBEDDING_TABLE.*: a
    rank gathers any token's row, while its lm_head is its vocabulary shard."""
    if tp == 1:
        return dict(calibrated)
    out = {}
    if model.tie_word_embeddings and mode in SHARED_TABLE and "lm_head.weight" in calibrated:
        out.update({f"{EMBEDDING_TABLE}.{name[len('lm_head.'):]}": a for name, a in calibrated.items()
                    if name.startswith("lm_head.")})
    for name, a in calibrated.items():
        stem, _, suffix = name.rpartition(".")
        if a.ndim == 0 or suffix == "activation_scaling_factor":
            out[name] = a                                   # per-tensor: replicated
        elif split_name(f"{stem}.weight")[1] in _ROW_PARALLEL:
            # row-parallel: the values' columns, AWQ's group scales [out, in/g] and the input scale [in] with them;
            # per-output-channel scales [out] (int8_sq) are replicated
            if suffix == "weights_scaling_factor" and a.ndim == 1:
                out[name] = a
            else:
                out[name] = np.ascontiguousarray(np.split(a, tp, axis=a.ndim - 1)[rank])
        elif suffix == "prequant_scaling_factor":
            out[name] = a                                   # column-parallel: the input (hidden) is whole on every rank
        else:
            out[name] = np.ascontiguousarray(_take_rows(a, _rank_rows(stem, model, tp, rank)))
    return out


class CalibratedTensors(MutableMapping):
    """The checkpoint's tensors of a rank with calibrated projections laid over them: a calibrated name shadows
    the checkpoint's float tensor of that name, and popping it drops both."""

    def __init__(self, base: MutableMapping, calibrated: dict[str, np.ndarray]):
        self._base, self._over = base, dict(calibrated)

    def __getitem__(self, name: str):
        return self._over[name] if name in self._over else self._base[name]

    def __delitem__(self, name: str) -> None:
        found = False
        if name in self._over:
            del self._over[name]
            found = True
        if name in self._base:
            del self._base[name]
            found = True
        if not found:
            raise KeyError(name)

    def __setitem__(self, name, value):
        raise TypeError("read-only")

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(set(self._base) | set(self._over)))

    def __len__(self) -> int:
        return len(set(self._base) | set(self._over))

    def __contains__(self, name) -> bool:
        return name in self._over or name in self._base

    def has_calibrated(self, weight_name: str) -> bool:
        """Whether calibration produced `weight_name` (int4_awq layers that keep the checkpoint's blocks have none)."""
        return weight_name in self._over

    def pop_calibrated(self, weight_name: str, mode: str, group_size: int | None) -> CalibratedWeight:
        """The CalibratedWeight of `weight_name` ("....weight"), its tensors removed from the mapping."""
        stem = weight_name[: -len(".weight")]
        get = lambda suffix: self._over.pop(f"{stem}.{suffix}", None)  # noqa: E731
        values = self._over.pop(weight_name)
        if weight_name in self._base:
            del self._base[weight_name]
        return CalibratedWeight(mode, values, get("weights_scaling_factor"), get("activation_scaling_factor"),
                                get("prequant_scaling_factor"), group_size)


def precision(mode: str, group_size: int | None, accuracy_level: int | None, quantize_lm_head: bool) -> dict:
    """The weights / activations lines of an engine's precision record (config.json, `engine inspect`)."""
    head = ("lm_head quantized the same way (a tied embedding reads its table)" if mode in SHARED_TABLE else
            "lm_head quantized the same way; embeddings float32") if quantize_lm_head \
        else "lm_head and embeddings float32"
    if mode == "int8_sq":
        return {"weights": f"int8, one scale per output channel (int8_sq: SmoothQuant, ModelOpt-calibrated) in the "
                           f"layers' projections; {head}",
                "activations": "float32; int8 into the projections: scaled by the SmoothQuant input scale, then "
                               "quantized at run time with one scale per token (MatMulInteger, int32 accumulation)"}
    if mode == "fp8":
        return {"weights": f"float8 e4m3, one scale per tensor (fp8, ModelOpt-calibrated) in the layers' "
                           f"projections; {head}",
                "activations": "float32; float8 e4m3 into the projections with a static per-tensor scale "
                               "(QuantizeLinear/DequantizeLinear)",
                "note": "fp8 runs emulated on ONNX Runtime's CPU provider: the Q/DQ nodes round to e4m3 and the "
                        "matmul computes in float32 (TensorRT fuses the same pattern into fp8 GEMMs)"}
    if mode == "int4_awq":
        return {"weights": f"int4, one float32 scale per group of {group_size} (int4_awq: AWQ, ModelOpt-calibrated) "
                           f"in the layers' projections; {head}",
                "activations": "float32 (AWQ input scale applied)" if accuracy_level in (0, 1) else
                               "float32 (AWQ input scale applied); int8 per block inside MatMulNBits "
                               "(accuracy_level 4)"}
    raise AssertionError(mode)
