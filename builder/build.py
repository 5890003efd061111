"""`engine build`: a checkpoint directory + BuildConfig -> an engine directory.

    check_build_config(model, BuildConfig)            every limit checked once, messages name the values
    for each rank (in worker processes with --workers > 1):
        rank tensors (lazy from rank{N}.safetensors, or resharded from a checkpoint of another tp)
        -> model_graph.build_graph -> rank{N}.raw.onnx -> ORT optimizes -> rank{N}.onnx + rank{N}.onnx.data
    config.json (EngineConfig), tokenizer files      all inside a temporary sibling, renamed when complete

Peak memory of a rank: its weights once as arrays being placed plus once in the ONNX proto; each array is
dropped as soon as the graph holds it, and the proto as soon as it is saved.
"""
from __future__ import annotations

import dataclasses
import importlib.util
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Callable, Iterator, MutableMapping

import numpy as np
import torch
from safetensors import safe_open

from engine.core.artifacts import (CheckpointConfig, atomic_output_dir, copy_tokenizer_files,
                                   load_checkpoint_config, rank_file, save_config)
from engine.core.config import DTYPES, Mapping, ModelConfig
from engine.core.engine_config import BuildConfig, EngineConfig, PluginConfig, engine_file
from engine.core.errors import EngineError
from engine.core.parallel import check_tp
from engine.core.sharding import Packer, shard, unpack_and_merge
from engine.runtime.engine_dir import backend_version, toolchain_version

from . import onnxruntime_backend as ortb
from .memory import memory_plan
from .model_graph import build_graph

BACKENDS = ("auto", "onnxruntime", "tensorrt")
KV_CACHE_DTYPES = ("float32",)


def check_build_config(model: ModelConfig, b: BuildConfig) -> None:
    """Refuse impossible or unsupported limits with a message naming the flag and its value."""
    for flag, value in (("--max-batch-size", b.max_batch_size), ("--max-input-len", b.max_input_len),
                        ("--max-seq-len", b.max_seq_len), ("--max-num-tokens", b.max_num_tokens),
                        ("--tokens-per-block", b.tokens_per_block), ("--tp", b.tp_size)):
        if value < 1:
            raise EngineError(f"{flag} {value} must be at least 1", usage=True)
    if b.max_input_len > b.max_seq_len:
        raise EngineError(f"--max-input-len {b.max_input_len} exceeds --max-seq-len {b.max_seq_len}; a prompt "
                          "must leave room in the sequence: lower --max-input-len or raise --max-seq-len", usage=True)
    if b.max_seq_len > model.max_position_embeddings:
        raise EngineError(f"--max-seq-len {b.max_seq_len} exceeds the model's max_position_embeddings "
                          f"{model.max_position_embeddings}; use at most {model.max_position_embeddings}", usage=True)
    if b.tokens_per_block & (b.tokens_per_block - 1):
        raise EngineError(f"--tokens-per-block {b.tokens_per_block} is not a power of two; use e.g. 16, 32 or 64",
                          usage=True)
    if b.max_num_tokens < b.max_batch_size:
        raise EngineError(f"--max-num-tokens {b.max_num_tokens} is below --max-batch-size {b.max_batch_size}: a "
                          "decode step of a full batch would not fit; raise --max-num-tokens", usage=True)
    if b.dtype not in DTYPES:
        raise EngineError(f"--dtype {b.dtype!r} is not supported; use one of {', '.join(DTYPES)}; quantized modes "
                          "(int8_wo, int4_awq, fp8, ...) come with the quantization support of a later version",
                          usage=True)
    if b.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise EngineError(f"--kv-cache-dtype {b.kv_cache_dtype!r} is not supported yet (KV-cache quantization is "
                          f"not implemented); use {', '.join(KV_CACHE_DTYPES)}", usage=True)
    if b.opt_level not in ortb.OPT_LEVELS:
        raise EngineError(f"ORT optimization level {b.opt_level!r} is unknown; use one of "
                          f"{', '.join(ortb.OPT_LEVELS)}", usage=True)
    check_tp(model, b.tp_size)


def resolve_backend(name: str) -> str:
    if name not in BACKENDS:
        raise EngineError(f"--backend {name!r} is unknown; use one of {', '.join(BACKENDS)}", usage=True)
    if name == "tensorrt":
        why = ("the `tensorrt` package is not installed" if importlib.util.find_spec("tensorrt") is None
               else "this version builds ONNX Runtime engines only")
        raise EngineError(f"--backend tensorrt: {why}. The TensorRT backend needs the `tensorrt` extra "
                          "(pip install 'engine[tensorrt]') and an NVIDIA GPU; use --backend onnxruntime", usage=True)
    return "onnxruntime"


def precision_of(ckpt: CheckpointConfig, build: BuildConfig) -> dict:
    """What runs at which precision: the plugins lower float32 only, so float16/bfloat16 requests compute in
    float32 (ORT's CPU provider has no bfloat16 MatMul kernel at all)."""
    note = ("" if build.dtype == "float32" else
            f"--dtype {build.dtype} requested; the ONNX Runtime CPU lowerings compute in float32, so weights are "
            "stored and computed in float32")
    return {"checkpoint": ckpt.dtype, "weights": "float32", "activations": "float32",
            "kv_cache": build.kv_cache_dtype, "logits": "float32", **({"note": note} if note else {})}


# ---- rank tensors -----------------------------------------------------------------------------------------

class _LazyRank(MutableMapping):
    """The packed tensors of one checkpoint rank, read from its safetensors file only when popped."""

    def __init__(self, path: Path):
        self._file = safe_open(str(path), framework="pt")
        self._names = set(self._file.keys())

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._names:
            raise KeyError(name)
        return self._file.get_tensor(name).float().numpy()

    def __delitem__(self, name: str) -> None:
        self._names.remove(name)

    def __setitem__(self, name, value):
        raise TypeError("read-only")

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._names))

    def __len__(self) -> int:
        return len(self._names)


def rank_tensors(ckpt_dir: Path, ckpt: CheckpointConfig, tp: int, rank: int) -> MutableMapping:
    """Packed tensors of `rank` of `tp`: the checkpoint's own rank, or resharded when its tp differs."""
    model, src_tp = ckpt.model, ckpt.mapping.tp_size
    if src_tp == tp:
        return _LazyRank(Path(ckpt_dir) / rank_file(rank))
    ranks = []
    for r in range(src_tp):
        with safe_open(str(Path(ckpt_dir) / rank_file(r)), framework="pt") as f:
            ranks.append({n: f.get_tensor(n) for n in f.keys()})
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


# ---- build ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class RankJob:
    ckpt_dir: Path
    out_dir: Path
    rank: int
    build: BuildConfig
    plugins: PluginConfig


def build_rank(job: RankJob) -> int:
    """Build rank{N}.onnx of `job` into job.out_dir; returns the rank (runs in a worker process)."""
    ckpt = load_checkpoint_config(job.ckpt_dir)
    tensors = rank_tensors(job.ckpt_dir, ckpt, job.build.tp_size, job.rank)
    graph = build_graph(ckpt.model, tensors, job.build, job.plugins, job.build.tp_size)
    del tensors
    # Move the initializers into the proto one at a time (protobuf copies on append), so the weights are never
    # held twice; saving then moves each one's bytes to the external file and clears it.
    initializers, graph.initializers = graph.initializers, []
    proto = graph.model()
    del graph
    initializers.reverse()
    while initializers:
        proto.graph.initializer.append(initializers.pop())
    out = job.out_dir / engine_file(job.rank)
    if job.build.tp_size > 1:
        ortb.save_raw(proto, out)  # unoptimized: see build_engine
        return job.rank
    raw = job.out_dir / f"rank{job.rank}.raw.onnx"
    ortb.save_raw(proto, raw)
    del proto
    ortb.optimize(raw, out, opt_level=job.build.opt_level)
    return job.rank


def build_engine(ckpt_dir: Path, out_dir: Path, build: BuildConfig, plugins: PluginConfig, *,
                 force: bool = False, workers: int = 1,
                 progress: Callable[[str], None] | None = None) -> EngineConfig:
    """Build every rank of the engine into `out_dir` (atomically) and return its config."""
    ckpt = load_checkpoint_config(ckpt_dir)
    build = dataclasses.replace(build, backend=resolve_backend(build.backend))
    check_build_config(ckpt.model, build)
    if build.tp_size > 1:
        # ORT's CPU build cannot load a graph with AllReduce, so tp > 1 ranks are saved unoptimized (build_rank);
        # the manifest says so, for the runtime that will optimize them where NCCL/gloo kernels exist.
        build = dataclasses.replace(build, opt_level="disable")
    if ckpt.quantization.mode is not None:
        raise EngineError(f"checkpoint {ckpt_dir} is quantized ({ckpt.quantization.mode}); quantized engines are "
                          "not supported yet: convert without quantization")
    config = EngineConfig(
        model=ckpt.model, build=build, plugins=plugins,
        mapping=Mapping(world_size=build.tp_size, tp_size=build.tp_size, pp_size=1),
        quantization=ckpt.quantization, generation=ckpt.generation, memory=memory_plan(ckpt.model, build),
        precision=precision_of(ckpt, build), toolchain_version=toolchain_version(),
        backend_version=backend_version(build.backend))
    with atomic_output_dir(out_dir, force=force) as tmp:
        jobs = [RankJob(Path(ckpt_dir), tmp, r, build, plugins) for r in range(build.tp_size)]
        if workers > 1 and len(jobs) > 1:
            with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=get_context("spawn")) as pool:
                for rank in pool.map(build_rank, jobs):
                    if progress:
                        progress(engine_file(rank))
        else:
            for job in jobs:
                build_rank(job)
                if progress:
                    progress(engine_file(job.rank))
        save_config(tmp, config)
        copy_tokenizer_files(ckpt_dir, tmp)
    return config
