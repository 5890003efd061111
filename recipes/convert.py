"""`engine convert`: a tensor source + its family's recipe -> a checkpoint directory.

    for rank in 0..tp-1:                       (peak memory: one rank's output + the tensor being read)
        for each HF tensor (memory-mapped):
            recipe.modify_tensors  -> logical canonical tensors, shape-checked against the config
            shard(rank) -> cast(dtype) -> Packer -> packed tensors of this rank
        save rank{N}.safetensors
    tokenizer files, then config.json with the manifest: size and sha256 of every other file, and the source's
    digest (core/manifest.py)               (all inside a temporary sibling, renamed when complete)

Every problem of the source (a missing or extra tensor, a wrong shape, a truncated file) and of the output (a
full disk) is an EngineError; nothing that looks like a checkpoint is left behind.
"""
from __future__ import annotations

import dataclasses
import errno
import numbers
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from engine.core.artifacts import (CheckpointConfig, atomic_output_dir, copy_tokenizer_files, rank_file,
                                   save_sealed)
from engine.core.errors import EngineError
from engine.core.model_config import Mapping, parse_dtype
from engine.core.parallel import check_tp
from engine.core.sharding import PACKED, Packer, shard
from engine.core.tensors import logical_shapes, split_name
from engine.quantization.gguf_tensor import METADATA_PREFIX, GGUFTensor

from . import recipe_for
from .base import Recipe
from .sources import TensorSource

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ConvertConfig:
    """What `engine convert` makes; flag values are checked here, before any file is read."""
    output_dir: Path
    tp: int = 1
    pp: int = 1
    dtype: str = "auto"  # "auto" keeps the source's dtype; aliases (bf16, fp16, ...) are normalized
    force: bool = False

    def __post_init__(self):
        if self.tp < 1:
            raise EngineError(f"--tp {self.tp} must be at least 1", usage=True)
        if self.pp != 1:
            raise EngineError(f"--pp {self.pp}: pipeline parallelism is not supported yet; use --pp 1 and --tp",
                              usage=True)
        if self.dtype != "auto":
            object.__setattr__(self, "dtype", parse_dtype(self.dtype))  # frozen: normalize once, here


Progress = Callable[[str], None]  # called once per source tensor converted, with its name


def source_dtype(source: TensorSource, hf_config: dict) -> str:
    """The model's declared dtype (config's dtype / torch_dtype), else that of its first floating tensor."""
    declared = hf_config.get("dtype") or hf_config.get("torch_dtype")
    if declared in TORCH_DTYPES:
        return declared
    for name in source.names():
        t = source.get(name)
        if t.is_floating_point():
            found = str(t.dtype).removeprefix("torch.")
            if found not in TORCH_DTYPES:
                raise EngineError(f"the weights of {source.path} are {found} ({name}), which a checkpoint does not "
                                  f"hold; pass --dtype with one of {', '.join(TORCH_DTYPES)}")
            return found
    return "float32"


def convert(source: TensorSource, cfg: ConvertConfig, progress: Progress | None = None) -> CheckpointConfig:
    out, src = Path(cfg.output_dir).resolve(), Path(source.path).resolve()
    if out == src or out in src.parents:  # --force would delete the model while it is being read
        raise EngineError(f"--output-dir {cfg.output_dir} holds the model being converted ({source.path}); choose "
                          "another --output-dir", usage=True)
    hf_config = source.hf_config()
    check_hf_config(hf_config, source.path)
    recipe = recipe_for(hf_config)
    model = recipe.model_config()
    check_tp(model, cfg.tp)
    dtype = source_dtype(source, hf_config) if cfg.dtype == "auto" else cfg.dtype
    ckpt = CheckpointConfig(
        model=model,
        dtype=dtype,
        mapping=Mapping(world_size=cfg.tp, tp_size=cfg.tp, pp_size=1),
        generation=recipe.generation_defaults(source.generation_config()),
        # the name only: a machine's path would make the same conversion differ from one machine to the next
        source={"kind": source.kind, "name": Path(source.path).absolute().name},
    )
    # A GGUF's quantized weights stay the blocks they are (quantization/gguf_tensor.py): no float32 copy of the model
    # is made, and `build --dtype gguf` keeps them exactly. Split across ranks or cast to a --dtype they are floats.
    if source.kind == "gguf":
        source.keep_quantized = cfg.tp == 1 and cfg.dtype == "auto"
    with atomic_output_dir(cfg.output_dir, force=cfg.force) as tmp:
        for rank in range(cfg.tp):
            tensors = _convert_rank(source, recipe, ckpt, rank, progress)
            kept = _kept_kinds(tensors)
            if kept:   # the GGUF kinds kept as blocks, for `engine convert`'s summary and readers of config.json
                ckpt = dataclasses.replace(ckpt, source={**ckpt.source, "kept": kept})
            if getattr(source, "dequantized", None):   # quantized kinds the engine does not keep: say which
                ckpt = dataclasses.replace(ckpt, source={**ckpt.source, "dequantized": dict(source.dequantized)})
            _save_rank(tensors, tmp / rank_file(rank))
            del tensors  # release this rank before the next one is built
        tok_dir = source.tokenizer_dir()
        if tok_dir is not None:
            copy_tokenizer_files(tok_dir, tmp)
        ckpt = save_sealed(tmp, ckpt, source_digest=source.digest())
    return ckpt


# Types of the config.json keys every recipe reads (null always means "absent"). Checked before a recipe computes
# with them, so "hidden_size": "64" or "tie_word_embeddings": "no" is refused instead of crashing or being misread.
_POSITIVE_INTS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings")
# Qwen2MoeConfig writes sliding_window 0 when use_sliding_window is false; a window of 0 is no window
_COUNTS = ("sliding_window", "num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
           "shared_expert_intermediate_size", "decoder_sparse_step")
_NUMBERS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "norm_topk_prob", "qkv_bias")


def check_hf_config(hf: dict, path: Path) -> None:
    def bad(key, what):
        raise EngineError(f"config.json of {path} has {key}={hf[key]!r}, expected {what}; the file is corrupt or "
                          "was edited by hand")
    for key in _POSITIVE_INTS:
        value = hf.get(key)
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1):
            bad(key, "a positive integer")
    for key in _COUNTS:
        value = hf.get(key)
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0):
            bad(key, "a non-negative integer")
    for key in _NUMBERS:
        value = hf.get(key)
        if value is not None and (not isinstance(value, numbers.Real) or isinstance(value, bool) or value < 0):
            bad(key, "a non-negative number")
    for key in _BOOLS:
        if hf.get(key) is not None and not isinstance(hf[key], bool):
            bad(key, "true or false")


def _convert_rank(source, recipe: Recipe, ckpt: CheckpointConfig, rank: int, progress) -> dict[str, torch.Tensor]:
    model, tp = ckpt.model, ckpt.mapping.tp_size
    torch_dtype = TORCH_DTYPES[ckpt.dtype]
    packer = Packer()
    shapes = logical_shapes(model)
    out: dict[str, torch.Tensor] = {}
    seen: set[str] = set()
    for hf_name in source.names():
        for name, tensor in recipe.modify_tensors(hf_name, source.get(hf_name)):
            if name == "lm_head.weight" and model.tie_word_embeddings:
                continue  # a saved copy of the tied embedding
            check_shape(hf_name, name, tensor, shapes.get(name))
            logical = [(name, tensor)]
            if name == "vocab_embedding.weight" and model.tie_word_embeddings and tp > 1:
                logical.append(("lm_head.weight", tensor))  # vocab-parallel lm_head needs its own shards
            for lname, t in logical:
                if lname in seen:
                    raise EngineError(f"the source has {lname} twice (last from {hf_name}); the checkpoint is "
                                      "inconsistent")
                seen.add(lname)
                for packed_name, packed in packer.add(lname, _own(shard(lname, t, model, tp, rank), torch_dtype)):
                    out[packed_name] = packed
            del tensor, logical, t  # hold no source tensor while the next one is read
        if progress:
            progress(hf_name)
    missing = sorted(set(shapes) - seen)
    if missing:
        shown = ", ".join(_with_source_name(recipe, m) for m in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise EngineError(f"the source {source.path} lacks weights of its {model.architecture} model: {shown}{more}; "
                          "the checkpoint is incomplete — download or export the complete model")
    packer.finish()
    return out


def _own(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`part` as a compact tensor of `dtype` that owns its memory.

    A shard is a view into the whole source tensor; keeping the view would keep the whole tensor alive for the
    rest of the rank. Copy only when needed: `.to()` and `.contiguous()` already copy when they change something,
    and a whole tensor (tp 1, or a replicated one) that needs no cast stays what the source gave, for safetensors
    a view of its memory map: page cache the kernel can drop, not memory of this process.
    """
    if isinstance(part, GGUFTensor):
        return part  # blocks of its own rows already (GGUFSource.get)
    out = part.to(dtype).contiguous()
    if out.untyped_storage().nbytes() != out.nbytes:
        out = out.clone()
    return out


def check_shape(hf_name: str, name: str, tensor: torch.Tensor, expected: tuple[int, ...] | None) -> None:
    """Refuse a tensor whose shape disagrees with config.json (the weights belong to another model)."""
    if expected is not None and tuple(tensor.shape) != expected:
        raise EngineError(f"tensor {hf_name} has shape {list(tensor.shape)}, but config.json describes "
                          f"{list(expected)} for {name}; the weights do not belong to this config.json")


def _with_source_name(recipe: Recipe, logical: str) -> str:
    """'layers.1.mlp.up.weight (model.layers.1.mlp.up_proj.weight)': the name the user can find in their files."""
    prefix, suffix, kind = split_name(logical)
    candidates = [logical]
    if suffix in PACKED:  # sources with fused projections (Phi-3) hold the part inside the packed tensor
        candidates.append(f"{prefix}{PACKED[suffix][0]}.{kind}")
    for candidate in candidates:
        for hf, canon in recipe.TENSOR_NAMES.items():
            m = re.fullmatch(re.escape(canon).replace(r"\{i\}", r"(\d+)"), candidate)
            if m:
                source_name = hf.replace("{i}", m.group(1)) if m.groups() else hf
                return f"{logical} ({source_name})"
    return logical


def _kept_kinds(tensors: dict) -> dict[str, int]:
    """How many stored tensors of each GGUF kind are kept as blocks."""
    kinds: dict[str, int] = {}
    for t in tensors.values():
        if isinstance(t, GGUFTensor):
            kinds[t.kind] = kinds.get(t.kind, 0) + 1
    return dict(sorted(kinds.items()))


def _save_rank(tensors: dict[str, torch.Tensor | GGUFTensor], path: Path) -> None:
    metadata = {"format": "engine-checkpoint"}
    for name, t in list(tensors.items()):
        if isinstance(t, GGUFTensor):   # its bytes, and its kind and K in the file's metadata
            metadata[METADATA_PREFIX + name] = t.metadata()
            tensors[name] = torch.from_numpy(t.raw)
    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as e:
        # The Rust writer reports I/O failures only as text ("I/O error: No space left on device (os error 28)");
        # turn them back into the OSError they were, which atomic_output_dir words for the user.
        m = re.search(r"os error (\d+)", str(e))
        code = int(m.group(1)) if m else errno.EIO
        raise OSError(code, os.strerror(code), str(path)) from None
