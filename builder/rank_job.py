"""One rank of an engine: its tensors -> its graph -> its saved file(s), in the build's process or a worker's.

    rank tensors (rank_tensors.py: lazy from rank{N}.safetensors, or resharded from a checkpoint of another tp)
    -> model_graph.build_graph -> rank{N}.raw.onnx -> ORT optimizes -> rank{N}.onnx + rank{N}.onnx.data
    (TensorRT: rank{N}.engine from the raw graph; tp > 1 on onnxruntime: the segment graphs, segments.py)

Peak memory of a rank: its weights once as arrays being placed plus once in the ONNX proto; each array is
dropped as soon as the graph holds it, and the proto as soon as it is saved.

Shared by the engine build (build.py) and its unquantized reference (reference.py); knows nothing of either.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from engine.core.artifacts import load_checkpoint_config
from engine.core.engine_format import BuildConfig, PluginConfig, engine_file
from engine.core.model_config import QuantConfig
from engine.plugins.graph import uses_engine_kernels
from engine.quantization import calibrated_weights as calib

from . import onnxruntime_backend as ortb
from . import tensorrt_backend as trtb
from . import tensorrt_collectives as trtc
from .model_graph import build_graph
from .rank_tensors import rank_tensors
from .segments import save_segments


@dataclasses.dataclass(frozen=True)
class RankJob:
    ckpt_dir: Path
    out_dir: Path
    rank: int
    build: BuildConfig
    plugins: PluginConfig
    quant: QuantConfig = dataclasses.field(default_factory=QuantConfig)
    trt: trtb.TensorRTOptions = dataclasses.field(default_factory=trtb.TensorRTOptions)
    calibrated: dict | None = None  # calibrated projections by canonical name (quantization/calibrated_weights.py)


def build_rank(job: RankJob) -> int:
    """Build rank{N}.onnx of `job` into job.out_dir (tp > 1 on onnxruntime: its segment graphs, builder/segments.py);
    returns the rank (runs in a worker process)."""
    ckpt = load_checkpoint_config(job.ckpt_dir)
    tensors = rank_tensors(job.ckpt_dir, ckpt, job.build.tp_size, job.rank, job.build.moe_ep_size)
    if job.calibrated is not None:
        # calibrated once on the whole model: this rank takes its slice of the scales with its weights
        tensors = calib.CalibratedTensors(tensors, calib.shard_calibrated(job.calibrated, ckpt.model, job.quant.mode,
                                                                          job.build.tp_size, job.rank))
    graph = build_graph(ckpt.model, tensors, job.build, job.plugins, job.build.tp_size, job.quant, job.rank)
    del tensors
    if job.build.tp_size > 1 and job.build.backend == "onnxruntime":
        save_segments(graph, job.out_dir, job.rank, num_layers=ckpt.model.num_layers, quant_mode=job.quant.mode,
                      opt_level=job.build.opt_level, fold_at_load=job.quant.source_grid)
        return job.rank
    # Move the initializers into the proto one at a time (protobuf copies on append), so the weights are never
    # held twice; saving then moves each one's bytes to the external file and clears it.
    initializers, graph.initializers = graph.initializers, []
    proto = graph.model()
    del graph
    initializers.reverse()
    while initializers:
        proto.graph.initializer.append(initializers.pop())
    if job.build.backend == "tensorrt":
        # TensorRT parses the graph as built: an ORT-optimized graph holds contrib ops TensorRT does not know.
        all_reduces = trtc.mark_all_reduces(proto)
        raw = job.out_dir / f"rank{job.rank}.raw.onnx"
        ortb.save_raw(proto, raw)
        del proto
        trtb.build_rank_engine(raw, job.out_dir / engine_file(job.rank, "tensorrt"), job.build, job.trt, all_reduces)
        return job.rank
    out = job.out_dir / engine_file(job.rank)
    raw = job.out_dir / f"rank{job.rank}.raw.onnx"
    kernels = uses_engine_kernels(proto)
    ortb.save_raw(proto, raw)
    del proto
    ortb.optimize(raw, out, opt_level=job.build.opt_level, fold_at_load=job.quant.source_grid, kernels=kernels)
    return job.rank
