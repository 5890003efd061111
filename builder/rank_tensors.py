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
from engine.core.config import ModelConfig
from engine.core.errors import EngineError
from engine.core.sharding import Packer, shard, unpack_and_merge
from engine.core.tensors import rank_elements

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
    """The packed tensors of one checkpoint rank, read from its safetensors file only when popped."""

    def __init__(self, path: Path):
        self._path = path
        self._file = _open_rank_file(path)
        self._names = set(self._file.keys())

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return _read_tensor(self._file, self._path, name).float().numpy()

    def __delitem__(self, name: str) -> None:
        self._names.remove(name)

    def __setitem__(self, name, value):
        raise TypeError("read-only")

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def num_elements(self) -> int:
        return sum(math.prod(self._file.get_slice(n).get_shape()) for n in self._names)

    def __len__(self) -> int:
        return len(self._names)


def _check_elements(found: int, model: ModelConfig, tp: int, path: Path) -> None:
    """A rank file must hold exactly the weights its config.json describes; a config edited or swapped for another
    model's would otherwise fail later as a shape error inside ONNX Runtime."""
    expected = rank_elements(model, tp)
    if found != expected:
        raise EngineError(f"{path} holds {found} weights but the checkpoint's config.json describes a model with "
                          f"{expected} per rank (tp {tp}); config.json and the weights do not belong together — "
                          "convert the model again with `engine convert`")


def rank_tensors(ckpt_dir: Path, ckpt: CheckpointConfig, tp: int, rank: int) -> MutableMapping:
    """Packed tensors of `rank` of `tp`: the checkpoint's own rank, or resharded when its tp differs."""
    model, src_tp = ckpt.model, ckpt.mapping.tp_size
    if src_tp == tp:
        lazy = _LazyRank(Path(ckpt_dir) / rank_file(rank))
        _check_elements(lazy.num_elements(), model, tp, Path(ckpt_dir) / rank_file(rank))
        return lazy
    ranks = []
    for r in range(src_tp):
        path = Path(ckpt_dir) / rank_file(r)
        with _open_rank_file(path) as f:
            ranks.append({n: _read_tensor(f, path, n) for n in f.keys()})
        _check_elements(sum(t.numel() for t in ranks[-1].values()), model, src_tp, path)
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
        for packed, t in packer.add(name, shard(name, tensor, model, tp, rank).contiguous()):
            out[packed] = t.to(torch.float32).numpy()
    packer.finish()
    return out
