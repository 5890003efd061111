"""One rank's part of a tp > 1 engine: its segment graphs (core/engine_format.py), their KV pools, one step at a time.

    open_shard(...)                           this rank's shard: RankShard, or TrtRankShard (runtime/tp/trt_shard.py)
    RankShard(engine_dir, rank, num_blocks)   one ORT session + IOBinding per segment, created once
    join(store, world_size)                   nothing to do: the segments all-reduce through the caller's `reduce`
    run(inputs, reduce) -> logits columns of this rank [S, vocab_padded / tp]

    step inputs ─OrtValue once─▶ every segment that reads them
    seg 0 ─allreduce.0─▶ buffer A ─reduce(A)─▶ seg 1 ─allreduce.1─▶ buffer B ─reduce(B)─▶ seg 2 ─▶ ... ─▶ logits
          └─ residual stream (ORT-allocated OrtValue) ─────────────▶ the segment that reads it, no copy

The two all-reduce buffers [max_num_tokens, hidden_size] are numpy arrays allocated once: a segment writes its
partial sum (or, int8_sq, its per-token amax [T, 1]: core/engine_format.segment_reduces) into a prefix view of one,
`reduce` sums it (or takes the max) over the ranks in place (torch.from_numpy shares the memory),
and the next segment reads it from there; they alternate because segment k + 1 reads buffer k while writing k + 1
(the builder checks that only the next segment reads a partial sum). The KV pools are bound in place as in
runtime/session.py. This module knows nothing of torch or of how the collective is done.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnxruntime as ort

from engine.core.engine_format import LOGITS, SUM, EngineConfig, allreduce_name, segment_file, segment_reduces
from engine.core.errors import EngineError
from engine.core.parallel import kv_heads_per_rank

from ..engine_dir import REBUILD
from ..session import allocate_kv_pool, engine_session_options, kv_pool_dtype, load_ort_session


class _Segment:
    def __init__(self, path: Path, options: ort.SessionOptions):
        self.session = load_ort_session(path, options)
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.binding = self.session.io_binding()
        # Outputs keep their place in get_outputs() in the order they were first bound.
        for name in self.outputs:
            self.binding.bind_output(name)
        self.index = {name: i for i, name in enumerate(self.outputs)}


class RankShard:
    def __init__(self, engine_dir: Path, config: EngineConfig, rank: int, *, num_blocks: int,
                 threads: int | None = None):
        engine_dir = Path(engine_dir)
        model, build = config.model, config.build
        tp = config.mapping.tp_size
        self.config, self.rank = config, rank
        so = engine_session_options(config, threads)
        # 2L + 1 sessions run one after the other: a pool spinning after its run would steal the next one's cores.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.reduces = segment_reduces(model.num_layers, config.quantization.mode)
        self.segments = [_Segment(engine_dir / segment_file(rank, k), so) for k in range(len(self.reduces) + 1)]

        kv_size = kv_heads_per_rank(model, tp) * model.head_dim
        slots = num_blocks * build.tokens_per_block
        self.kv_pool, pools = allocate_kv_pool(model.num_layers, slots, kv_size, kv_pool_dtype(build.kv_cache_dtype))
        self._pool_values = pools   # keeps the OrtValues alive as long as the bindings
        self.hidden_size = model.hidden_size
        self._buffers = [np.zeros((build.max_num_tokens, model.hidden_size), dtype=np.float32) for _ in range(2)]

        last = len(self.segments) - 1
        self._carried_in: list[list[str]] = []
        self._step_in: list[list[str]] = []
        made: set[str] = set()
        pool_outputs = {out for out, _ in pools.values()}
        self._allocated_out: list[list[str]] = []
        for k, seg in enumerate(self.segments):
            carried, step = [], []
            for name in seg.inputs:
                if name in pools:
                    out, value = pools[name]
                    if out not in seg.index:
                        raise EngineError(f"{segment_file(rank, k)} reads {name} without writing {out}; {REBUILD}"
                                          .format(dir=engine_dir))
                    seg.binding.bind_ortvalue_input(name, value)
                    seg.binding.bind_ortvalue_output(out, value)
                elif name == allreduce_name(k - 1):
                    pass
                elif name in made:
                    carried.append(name)
                else:
                    step.append(name)
            expected = allreduce_name(k) if k < last else LOGITS
            if expected not in seg.index:
                raise EngineError(f"{segment_file(rank, k)} lacks its output {expected}; "
                                  + REBUILD.format(dir=engine_dir))
            made.update(seg.outputs)
            self._carried_in.append(carried)
            self._step_in.append(step)
            # Outputs ORT allocates: rebound before every run, else ORT reuses the last run's (shape-fixed) value.
            self._allocated_out.append([n for n in seg.outputs if n != allreduce_name(k) and n not in pool_outputs])

    def join(self, store, world_size: int) -> None:
        """Called on every rank once all have loaded; segment shards need no communicator of their own."""

    def run(self, inputs: dict[str, np.ndarray], reduce: Callable[[np.ndarray, str], None]) -> np.ndarray:
        """This rank's logits columns [S, vocab_padded / tp] for the step `inputs`; `reduce(array, op)` sums
        ("sum") or maxes ("max") an array over the ranks in place (every rank calls it at the same points, in the
        same order)."""
        values = {name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(a)) for name, a in inputs.items()}
        tokens = len(inputs["input_ids"])
        shapes = [[tokens, self.hidden_size if op == SUM else 1] for op in self.reduces]
        carried: dict[str, ort.OrtValue] = {}
        last = len(self.segments) - 1
        for k, seg in enumerate(self.segments):
            b = seg.binding
            for name in self._step_in[k]:
                b.bind_ortvalue_input(name, values[name])
            for name in self._carried_in[k]:
                b.bind_ortvalue_input(name, carried[name])
            if k > 0:
                b.bind_input(allreduce_name(k - 1), "cpu", 0, np.float32, shapes[k - 1],
                             self._buffers[(k - 1) % 2].ctypes.data)
            if k < last:
                b.bind_output(allreduce_name(k), "cpu", 0, np.float32, shapes[k], self._buffers[k % 2].ctypes.data)
            for name in self._allocated_out[k]:
                b.bind_output(name)
            seg.session.run_with_iobinding(b)
            outs = b.get_outputs()
            for name in self._allocated_out[k]:
                carried[name] = outs[seg.index[name]]
            if k < last:
                width = shapes[k][1]
                reduce(self._buffers[k % 2].reshape(-1)[:tokens * width], self.reduces[k])
            else:
                return outs[seg.index[LOGITS]].numpy()
        raise AssertionError("unreachable")


def open_shard(engine_dir: Path, config: EngineConfig, rank: int, *, num_blocks: int, threads: int | None = None):
    """This rank's part of the engine: ONNX Runtime segment graphs, or one TensorRT engine whose all-reduces run
    inside it (torch CUDA, tensorrt and nccl4py are imported only then)."""
    if config.build.backend == "tensorrt":
        from .trt_shard import TrtRankShard
        return TrtRankShard(engine_dir, config, rank, num_blocks=num_blocks)
    return RankShard(engine_dir, config, rank, num_blocks=num_blocks, threads=threads)
