"""`engine convert`: a tensor source + its family's recipe -> a checkpoint directory.

    for rank in 0..tp-1:                       (peak memory: one rank's output + the tensor being read)
        for each HF tensor (memory-mapped):
            recipe.modify_tensors  -> logical canonical tensors
            shard(rank) -> cast(dtype) -> Packer -> packed tensors of this rank
        save rank{N}.safetensors
    config.json, tokenizer files            (all inside a temporary sibling, renamed when complete)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from engine.core.artifacts import (CheckpointConfig, atomic_output_dir, copy_tokenizer_files, rank_file,
                                   save_config)
from engine.core.config import Mapping, parse_dtype
from engine.core.errors import EngineError
from engine.core.sharding import Packer, check_tp, shard

from . import recipe_for
from .sources import TensorSource

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ConvertConfig:
    output_dir: Path
    tp: int = 1
    pp: int = 1
    dtype: str = "auto"
    force: bool = False


Progress = Callable[[str], None]  # called once per source tensor converted, with its name


def source_dtype(source: TensorSource, hf_config: dict) -> str:
    """The model's declared dtype (config's dtype / torch_dtype), else that of its first floating tensor."""
    declared = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if declared in TORCH_DTYPES:
        return declared
    for name in source.names():
        t = source.get(name)
        if t.is_floating_point():
            return str(t.dtype).removeprefix("torch.")
    return "float32"


def convert(source: TensorSource, cfg: ConvertConfig, progress: Progress | None = None) -> CheckpointConfig:
    if cfg.pp != 1:
        raise EngineError(f"--pp {cfg.pp}: pipeline parallelism is not supported yet; use --tp", usage=True)
    hf_config = source.hf_config()
    recipe = recipe_for(hf_config)
    model = recipe.model_config()
    check_tp(model, cfg.tp)
    dtype = source_dtype(source, hf_config) if cfg.dtype == "auto" else parse_dtype(cfg.dtype)
    ckpt = CheckpointConfig(
        model=model,
        dtype=dtype,
        mapping=Mapping(world_size=cfg.tp, tp_size=cfg.tp, pp_size=1),
        generation=recipe.generation_defaults(source.generation_config()),
        source={"kind": source.kind, "path": str(Path(source.path).absolute())},
    )
    with atomic_output_dir(cfg.output_dir, force=cfg.force) as tmp:
        for rank in range(cfg.tp):
            tensors = _convert_rank(source, recipe, ckpt, rank, progress)
            save_file(tensors, str(tmp / rank_file(rank)), metadata={"format": "engine-checkpoint"})
            del tensors
        save_config(tmp, ckpt)
        tok_dir = source.tokenizer_dir()
        if tok_dir is not None:
            copy_tokenizer_files(tok_dir, tmp)
    return ckpt


def _convert_rank(source, recipe, ckpt: CheckpointConfig, rank: int, progress) -> dict[str, torch.Tensor]:
    model, tp = ckpt.model, ckpt.mapping.tp_size
    torch_dtype = TORCH_DTYPES[ckpt.dtype]
    packer = Packer()
    out: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for hf_name in source.names():
        for name, tensor in recipe.modify_tensors(hf_name, source.get(hf_name)):
            if name == "lm_head.weight" and model.tie_word_embeddings:
                continue  # a saved copy of the tied embedding
            logical = [(name, tensor)]
            if name == "vocab_embedding.weight" and model.tie_word_embeddings and tp > 1:
                logical.append(("lm_head.weight", tensor))  # vocab-parallel lm_head needs its own shards
            for lname, t in logical:
                if lname in seen:
                    raise EngineError(f"the source has {lname} twice (last from {hf_name}); the checkpoint is inconsistent")
                seen.add(lname)
                part = shard(lname, t, model, tp, rank).to(torch_dtype).contiguous().clone()
                for packed_name, packed in packer.add(lname, part):
                    out[packed_name] = packed
        if progress:
            progress(hf_name)
    packer.finish()
    missing = sorted(recipe.expected_tensors(model) - seen)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise EngineError(f"the source lacks weights of a {model.architecture} model: {shown}; the checkpoint is "
                          "incomplete")
    return out
