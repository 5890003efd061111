"""The low-level engine session: one ONNX Runtime session of a tp=1 engine and its KV pool, one run() per step.

    EngineSession(engine_dir, num_blocks)        loads rank0.onnx (already optimized at build: optimizations off),
                                                 refusing files that differ from the manifest (hashed meanwhile)
        pool: kcache.{i}, vcache.{i}  [num_blocks * tokens_per_block, kv_size] of the engine's KV dtype (float32,
              or int8 for --kv-cache-dtype int8: the graph quantizes and dequantizes), allocated once
              each bound with IOBinding as both the graph input and its aliased output kcache_out.{i}, so
              ORT's ScatterND writes the step's K/V into the pool in place (no copy of the pool per step)
        LoRA (an engine built with --lora-target-modules): the adapters' slots (runtime/lora/slots.py) bound once
              the same way (bind_lora); each step binds lora_index, every token's slot (SeqChunk.lora_slot)
    run(chunks) -> logits [rows of logits wanted, vocab_size]; ORT writes them into one buffer allocated here
                   [max_batch_size, vocab_padded] (grown when speculation asks for more rows): no per-step output
                   allocation, no wrapping of the 61 bound outputs that IOBinding.get_outputs() does; run returns a
                   copy of the rows it filled, or with copy=False a view of them that the next run overwrites (the
                   engine core samples from it before its next step: a [32, 49152] copy was ~0.3 ms of a 16 ms
                   step, bench/NOTES.md entry 44)

The session knows blocks only as ids; which sequence owns which block is the block manager's business.
It must not import builder/, recipes/ or torch.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from engine.core.engine_format import (LOGITS, LOGITS_INDICES, EngineConfig, engine_file, kcache_name,
                                       kcache_out_name, vcache_name, vcache_out_name)
from engine.core.errors import EngineError
from engine.core.lora import LORA_INDEX
from engine.core.parallel import kv_heads_per_rank, padded_vocab_size
from engine.plugins import native

from .engine_dir import load_runnable_engine, verifying_files
from .lora.slots import LoraSlots
from .step_inputs import SeqChunk, check_step, lora_index, make_step_inputs


class EngineSession:
    def __init__(self, engine_dir: Path, *, num_blocks: int, threads: int | None = None):
        engine_dir = Path(engine_dir)
        self.config: EngineConfig = load_runnable_engine(engine_dir, "onnxruntime")
        cfg, build = self.config, self.config.build
        if num_blocks < 1:
            raise EngineError(f"num_blocks {num_blocks} must be at least 1")
        self.num_blocks = num_blocks
        self.tokens_per_block = build.tokens_per_block
        model = cfg.model
        self._sliding = model.sliding_window if "sliding" in model.layer_types else None

        with verifying_files(engine_dir, self.config):  # hashes every file while ORT loads the graph
            self._session = load_ort_session(engine_dir / engine_file(0), engine_session_options(cfg, threads))
        self._input_names = {i.name for i in self._session.get_inputs()}

        kv_size = kv_heads_per_rank(model, 1) * model.head_dim
        slots = num_blocks * self.tokens_per_block
        self._binding = self._session.io_binding()
        self._logits = np.empty((build.max_batch_size, padded_vocab_size(model, 1)), dtype=np.float32)
        self._logit_rows = -1   # rows of the logits output bound to self._logits
        self.kv_pool, self._pool_values = allocate_kv_pool(model.num_layers, slots, kv_size,
                                                           kv_pool_dtype(build.kv_cache_dtype))
        for name_in, (name_out, value) in self._pool_values.items():
            self._binding.bind_ortvalue_input(name_in, value)
            self._binding.bind_ortvalue_output(name_out, value)
        self._lora = LORA_INDEX in self._input_names
        if self._lora:   # one zero slot until an LLM binds its adapters' slots (every token on the base model)
            self.bind_lora(LoraSlots(model, build.lora_target_modules, 1, 1, build.lora_dtype).inputs())

    def bind_lora(self, arrays: dict[str, np.ndarray]) -> None:
        """Bind the LoRA inputs of an engine built with them to `arrays` (runtime/lora/slots.py), which stay
        shared: a slot written in place is what the next run reads."""
        self._lora_values = {name: shared_value(a) for name, a in arrays.items()}
        for name, value in self._lora_values.items():
            self._binding.bind_ortvalue_input(name, value)

    def run(self, chunks: list[SeqChunk], *, copy: bool = True) -> np.ndarray:
        """Logits [sum of the chunks' num_logits, vocab_size] float32, in chunk order; copy=False: a view of
        the session's buffer, valid until the next run."""
        inputs = make_step_inputs(chunks, self.tokens_per_block, self._sliding)
        check_step(inputs, chunks, self.config, self.num_blocks)
        for name, array in inputs.items():
            if name in self._input_names:
                self._binding.bind_cpu_input(name, array)
        if self._lora:
            self._binding.bind_cpu_input(LORA_INDEX, lora_index(chunks))
        rows = len(inputs[LOGITS_INDICES])
        if rows > len(self._logits):   # speculation verifies several tokens a sequence: more rows than sequences
            self._logits = np.empty((rows, self._logits.shape[1]), dtype=np.float32)
            self._logit_rows = -1
        if rows != self._logit_rows:   # the binding stays between runs: rebind only when the row count changes
            self._binding.bind_output(LOGITS, "cpu", 0, np.float32, [rows, self._logits.shape[1]],
                                      self._logits.ctypes.data)
            self._logit_rows = rows
        self._session.run_with_iobinding(self._binding)
        logits = self._logits[:rows, :self.config.model.vocab_size]
        return logits.copy() if copy else logits


def shared_value(array: np.ndarray) -> ort.OrtValue:
    """An OrtValue over the array's memory; bfloat16 (ml_dtypes, which ORT's converter does not know) as its bits."""
    if array.dtype == np.float32:
        return ort.OrtValue.ortvalue_from_numpy(array)
    return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(array.view(np.uint16), _BFLOAT16)


_BFLOAT16 = 16   # onnx.TensorProto.BFLOAT16 (the session does not import onnx: cold start)


# the pool element of each --kv-cache-dtype an engine may have (quantization/kv_cache.py builds them)
KV_POOL_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8,
                  "fp8": np.uint8}   # fp8: e4m3 codes (plugins/e4m3.py)


def kv_pool_dtype(kv_cache_dtype: str) -> type:
    if kv_cache_dtype not in KV_POOL_DTYPES:
        raise EngineError(f"the engine's KV cache dtype {kv_cache_dtype!r} is not one this runtime runs "
                          f"({', '.join(KV_POOL_DTYPES)}); rebuild the engine with this toolchain")
    return KV_POOL_DTYPES[kv_cache_dtype]


def allocate_kv_pool(num_layers: int, slots: int, kv_size: int, dtype: type = np.float32
                     ) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict[str, tuple[str, ort.OrtValue]]]:
    """Zeroed K/V pools per layer (zeros, not np.empty: padded kv_slots read slot 0, and 0 * NaN leaks), and for
    each pool input name its aliased output name and an OrtValue sharing the array's memory, to bind as both."""
    pool, values = [], {}
    for i in range(num_layers):
        k = np.zeros((slots, kv_size), dtype=dtype)
        v = np.zeros((slots, kv_size), dtype=dtype)
        pool.append((k, v))
        for arr, name_in, name_out in ((k, kcache_name(i), kcache_out_name(i)),
                                       (v, vcache_name(i), vcache_out_name(i))):
            values[name_in] = (name_out, ort.OrtValue.ortvalue_from_numpy(arr))
    return pool, values


def engine_session_options(config: EngineConfig, threads: int | None) -> ort.SessionOptions:
    """How an engine's ORT sessions load. Its graph was optimized once at build (builder/onnxruntime_backend.py), so
    optimizations are off, except where the engine stores weights narrower than it runs them (the float16 scales
    of kept 4-bit blocks, QuantConfig.source_grid): the basic level folds their Casts into float32 weights. That is
    needed, not only faster: measured on ORT 1.32, MatMulNBits with scales computed at run time (an unfolded Cast)
    returns wrong results."""
    so = ort.SessionOptions()
    so.graph_optimization_level = (ort.GraphOptimizationLevel.ORT_ENABLE_BASIC if config.quantization.source_grid
                                   else ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if config.plugins.engine_kernels_plugin and config.build.backend == "onnxruntime":
        native.register(so)
    so.log_severity_level = 3
    pool = kernel_pool_threads(config, threads)
    if pool:  # the kernels' own pool takes the threads; ORT's pool keeps only the calling thread
        so.add_session_config_entry(native.THREADS_ENTRY, str(pool))
        threads = 1
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    return so


def kernel_pool_threads(config: EngineConfig, threads: int | None) -> int | None:
    """The threads of the kernels' own pool (plugins/kernels/spin_pool.h) for an engine whose parallel work all
    runs in them (EngineConfig.thread_pool "engine"), or None: ORT's intra-op pool, which the kernels then share
    through KernelContext_ParallelFor, a hand-over ~0.8 us a call dearer (bench/NOTES.md entry 41)."""
    if config.thread_pool != "engine" or not native.own_pool_supported(ort.__version__):
        return None
    threads = threads or native.default_threads()
    return threads if threads > 1 else None


def load_ort_session(path: Path, options: ort.SessionOptions) -> ort.InferenceSession:
    """An ONNX Runtime CPU session of the graph `path`; a truncated or corrupt graph or external-data file (ORT
    checks both at load) is an EngineError naming the file, not ORT's multi-line exception."""
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - ORT raises its own classes (Fail, InvalidProtobuf, ...) for bad files
        detail = " ".join(str(e).split())[:300]
        raise EngineError(f"cannot load {path}: {detail}; the engine file or its .data file is truncated or corrupt "
                          f"— rebuild it with `engine build --checkpoint-dir CKPT --output-dir {path.parent} "
                          "--force`") from None
