"""A weight kept as a GGUF file stores it: rows of quantized blocks, never a float32 copy.

A GGUF checkpoint (`engine convert --gguf`) holds each projection, embedding and lm_head the file quantizes in a
kind of gguf_blocks.KEPT as a GGUFTensor: uint8 [N, row bytes], its kind and its K. Rows are whole output features,
so the converter can permute, slice and stack them (q|k|v, gate|up) without touching a value; `--dtype gguf`
builds pack them into the kernels' tiles (plugins/gguf_tiles.py) and every other build reads them dequantized,
bit for bit what gguf's own dequantization gives.

In a rank's safetensors file such a tensor is a uint8 tensor whose kind and K are in the file's metadata under
`gguf:NAME` ("Q4_K 1536"); a stacked tensor whose parts have different kinds (Q4_K q and k beside a Q6_K v) is
stored as its parts under their logical names.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.core.errors import EngineError

from .gguf_blocks import KEPT, decode, dequantize, row_bytes

METADATA_PREFIX = "gguf:"


@dataclass(frozen=True)
class GGUFTensor:
    kind: str          # a gguf_blocks.KEPT kind
    raw: np.ndarray    # uint8 [N, row_bytes(kind, k)]
    k: int             # in features

    def __post_init__(self):
        if self.raw.ndim != 2 or self.raw.dtype != np.uint8 or self.raw.shape[1] != row_bytes(self.kind, self.k):
            raise EngineError(f"a {self.kind} tensor of {self.k} columns is uint8 rows of "
                              f"{row_bytes(self.kind, self.k)} bytes; got {self.raw.dtype} {tuple(self.raw.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features N, in_features K) of the weight it holds."""
        return self.raw.shape[0], self.k

    def numel(self) -> int:
        return self.raw.shape[0] * self.k

    def rows(self, index) -> "GGUFTensor":
        """Some of its rows (a slice, or an index array: a permutation), as a tensor that owns them."""
        return GGUFTensor(self.kind, np.ascontiguousarray(self.raw[index]), self.k)

    def float32(self) -> np.ndarray:
        """The weight [N, K] dequantized exactly as gguf (and llama.cpp) dequantize it."""
        return dequantize(decode(self.raw, self.kind, self.k))

    def metadata(self) -> str:
        return f"{self.kind} {self.k}"

    @staticmethod
    def stack(parts: list) -> "GGUFTensor | None":
        """The parts' rows one after another (q|k|v, gate|up), or None unless all are blocks of one kind."""
        if not all(isinstance(p, GGUFTensor) for p in parts) or len({(p.kind, p.k) for p in parts}) != 1:
            return None
        return GGUFTensor(parts[0].kind, np.concatenate([p.raw for p in parts]), parts[0].k)


def keeps(kind: str, shape: tuple[int, ...]) -> bool:
    """Whether a GGUF tensor of this kind and (torch-order) shape is kept as blocks: a kept kind, 2-D."""
    return kind in KEPT and len(shape) == 2


def from_metadata(raw: np.ndarray, value: str, name: str) -> GGUFTensor:
    """The GGUFTensor a checkpoint stored (its bytes and its `gguf:NAME` metadata value)."""
    try:
        kind, k = value.split()
        return GGUFTensor(kind, raw, int(k))
    except (ValueError, EngineError) as e:
        raise EngineError(f"the checkpoint's GGUF tensor {name} is described as {value!r}, which does not fit its "
                          f"{tuple(raw.shape)} bytes ({e}); convert the model again with `engine convert`") from None


def dequantized_note(source: dict) -> str | None:
    """A checkpoint's `source` record -> which tensors of its GGUF file are float32 because the engine keeps no
    blocks of their kind (GGUFSource.dequantized), or None."""
    dequantized = source.get("dequantized") or {}
    if not dequantized:
        return None
    # a mixture of experts' merged experts (3-D, `ffn_*_exps`) are dequantized whatever their kind
    experts = sorted(n for n in dequantized if "_exps." in n)
    names = sorted(n for n in dequantized if n not in experts)
    notes = []
    if names:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        notes.append(f"{len(names)} tensors of the GGUF file are {', '.join(sorted({dequantized[n] for n in names}))}"
                     f", which the engine does not keep as blocks (it keeps {', '.join(KEPT)}): they are dequantized "
                     f"to float32 ({shown})")
    if experts:
        kinds = ", ".join(sorted({dequantized[n] for n in experts}))
        notes.append(f"the {len(experts)} expert tensors of the GGUF file ({kinds}, 3-D) are dequantized to float32; "
                     "build them with --dtype int4_wo or int8_wo (docs/moe.md)")
    return "; ".join(notes)
