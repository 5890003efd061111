"""A checkpoint rank's tensors for the builder: read lazily from rank{N}.safetensors, or resharded from a checkpoint
of another tp. A missing, truncated or corrupt file, or one holding other weights than its config.json describes,
is an EngineError naming it."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterator, MutableMapping

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from engine.core.artifacts import CheckpointConfig, rank_file
from engine.core.errors import EngineError
from engine.core.model_config import ModelConfig
from engine.core.sharding import PACKED, Packer, shard_experts, unpack_and_merge
from engine.core.tensors import rank_elements, split_name
from engine.quantization.gguf_tensor import METADATA_PREFIX, GGUFTensor, from_metadata

_CORRUPT = "the checkpoint is truncated or corrupt — convert the model again with `engine convert`"


def _open_rank_file(path: Path):
    """safe_open of a checkpoint rank file; a missing, truncated or corrupt one is an EngineError naming it."""
    try:
        return safe_open(str(path), framework="pt")
    except FileNotFoundError:
        raise EngineError(f"{path} does not exist; {_CORRUPT}") from None
    except (SafetensorError, OSError) as e:
        raise EngineError(f"cannot read {path}: {e}; {_CORRUPT}") from None


def _read_tensor(file, path: Path, name: str) -> torch.Tensor:
    try:
        return file.get_tensor(name)
    except (SafetensorError, OSError) as e:
        raise EngineError(f"cannot read tensor {name} from {path}: {e}; {_CORRUPT}") from None


class _LazyRank(MutableMapping):
    """The packed tensors of one checkpoint rank, read from its safetensors file only when popped, as float32
    arrays; `gguf_parts` gives a GGUF checkpoint's kept blocks as they are (quantization/gguf_tensor.py). A packed
    tensor stored as its parts (blocks of different kinds) is listed under its packed name."""

    def __init__(self, path: Path):
        self._path = path
        self._file = _open_rank_file(path)
        meta = self._file.metadata() or {}
        self._gguf = {k[len(METADATA_PREFIX):]: v for k, v in meta.items() if k.startswith(METADATA_PREFIX)}
        self._stored: dict[str, list[str]] = {}   # name -> the stored tensors it is made of, in order
        for key in self._file.keys():
            prefix, suffix, kind = split_name(key)
            packed = PACKED.get(suffix)
            name = f"{prefix}{packed[0]}.{kind}" if packed else key
            self._stored.setdefault(name, []).append(key)
        for name, keys in self._stored.items():
            keys.sort(key=lambda key: PACKED[split_name(key)[1]][1] if split_name(key)[1] in PACKED else 0)

    def _read(self, key: str):
        # a GGUF tensor through a map opened for it alone: the file's map keeps every page read in the process's
        # RSS until it is closed (a 1.5B gguf build: +1.1 GB of peak)
        if key not in self._gguf:
            return _read_tensor(self._file, self._path, key)
        with _open_rank_file(self._path) as f:
            raw = _read_tensor(f, self._path, key).numpy()
        return from_metadata(raw, self._gguf[key], key)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._stored:
            raise KeyError(name)
        parts = [self._read(key) for key in self._stored[name]]
        floats = [p.float32() if isinstance(p, GGUFTensor) else p.float().numpy() for p in parts]
        return floats[0] if len(floats) == 1 else np.concatenate(floats)

    def gguf_kinds(self) -> dict[str, str]:
        """Every stored tensor kept as GGUF blocks -> its kind."""
        return {key: value.split()[0] for key, value in sorted(self._gguf.items())}

    def gguf_parts(self, name: str) -> list[GGUFTensor] | None:
        """The GGUF blocks `name` is stored as (its parts, one when they share a kind), taken out of the rank; None
        when any part is a float tensor."""
        keys = self._stored.get(name)
        if keys is None or not all(key in self._gguf for key in keys):
            return None
        parts = [self._read(key) for key in keys]
        del self[name]
        return parts

    def __delitem__(self, name: str) -> None:
        del self._stored[name]

    def __setitem__(self, name, value):
        raise TypeError("read-only")

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._stored))

    def num_elements(self) -> int:
        """The weights the rank holds (a GGUF tensor's N * K, not its bytes)."""
        total = 0
        for keys in self._stored.values():
            for key in keys:
                shape = self._file.get_slice(key).get_shape()
                total += shape[0] * int(self._gguf[key].split()[1]) if key in self._gguf else math.prod(shape)
        return total

    def __len__(self) -> int:
        return len(self._stored)


def _check_elements(found: int, model: ModelConfig, tp: int, path: Path) -> None:
    """A rank file must hold exactly the weights its config.json describes; a config edited or swapped for another
    model's would otherwise fail later as a shape error inside ONNX Runtime."""
    expected = rank_elements(model, tp)
    if found != expected:
        raise EngineError(f"{path} holds {found} weights but the checkpoint's config.json describes a model with "
                          f"{expected} per rank (tp {tp}); config.json and the weights do not belong together — "
                          "convert the model again with `engine convert`")


def rank_tensors(ckpt_dir: Path, ckpt: CheckpointConfig, tp: int, rank: int, ep: int = 1) -> MutableMapping:
    """Packed tensors of `rank` of `tp`: the checkpoint's own rank, or resharded when its tp differs or the build
    splits the experts `ep` ways (core/sharding.shard_experts)."""
    model, src_tp = ckpt.model, ckpt.mapping.tp_size
    if src_tp == tp and ep == 1:
        lazy = _LazyRank(Path(ckpt_dir) / rank_file(rank))
        _check_elements(lazy.num_elements(), model, tp, Path(ckpt_dir) / rank_file(rank))
        return lazy
    ranks = []
    for r in range(src_tp):
        path = Path(ckpt_dir) / rank_file(r)
        stored = _LazyRank(path)   # GGUF blocks dequantized, parts stored apart joined
        _check_elements(stored.num_elements(), model, src_tp, path)
        ranks.append({n: torch.from_numpy(stored[n]) for n in list(stored)})
    logical = unpack_and_merge(ranks, model)
    del ranks
    if model.tie_word_embeddings:
        # A vocab-parallel lm_head needs its own shards; a tp=1 engine reads the tied embedding instead.
        if tp > 1:
            logical.setdefault("lm_head.weight", logical["vocab_embedding.weight"])
        else:
            logical.pop("lm_head.weight", None)
    packer, out = Packer(), {}
    for name in list(logical):
        tensor = logical.pop(name)
        for packed, t in packer.add(name, shard_experts(name, tensor, model, tp, ep, rank).contiguous()):
            out[packed] = t.to(torch.float32).numpy()
    packer.finish()
    return out
