"""The TensorRT executor: one deserialized rank{N}.engine, its execution context and a KV pool in device memory,
behind the interface of runtime/session.py (`run(chunks) -> logits`, `config`, `num_blocks`, `tokens_per_block`).
A tp > 1 engine runs one TrtSession per rank and process (runtime/tp/trt_shard.py), each on GPU rank % visible GPUs,
its all-reduces inside the engine over the NCCL communicator given by `set_communicator`.

NOTHING IN THIS MODULE HAS RUN ON A GPU. TensorRT cannot be installed on the machines this project is developed
on (no GPU; its PyPI wheels fetch the libraries from NVIDIA's index). The code follows TensorRT's documented Python
API (10.x and 11.x: `Runtime.deserialize_cuda_engine`, `IExecutionContext.set_input_shape`, `set_tensor_address`,
`execute_async_v3(stream_handle)`; docs.nvidia.com/deeplearning/tensorrt/latest/_static/python-api/infer/Core/
ExecutionContext.html). What runs here is the device stamp check (`check_device`), tested as a plain function.

    TrtSession(engine_dir, num_blocks)
        checks: backend tensorrt, installed TensorRT == config.json's backend_version (load_engine_config),
                this GPU's compute capability == config.json's backend_device (an engine is specific to both)
        pool: two buffers per K/V pool (ping-pong), torch.cuda float32 [num_blocks * tokens_per_block, kv_size]
    run(chunks):
        step inputs (numpy, runtime/step_inputs.py) ─copy─▶ device tensors ─set_input_shape/set_tensor_address─┐
        kcache.{i} ◀─ pool[cur]      kcache_out.{i} ◀─ pool[1 - cur]      logits ◀─ device buffer of its shape ─┤
        execute_async_v3(stream) ─▶ synchronize ─▶ cur = 1 - cur ─▶ logits to host [:, :vocab_size]  ◀────────┘

Why two pool buffers: the graph writes new K/V with ScatterND into an output tensor distinct from its input. ONNX
Runtime updates the pool in place when both are bound to one buffer (measured, DESIGN.md), but TensorRT documents
input/output aliasing only for its KV-cache-update layer (IKVCacheUpdateLayer: "the output ... shares the same
device memory address with the cache input", docs.nvidia.com/deeplearning/tensorrt/latest/_static/operators/
KVCacheUpdate.html), whose cache is a dense [B, heads, S_max, hd] per-sequence layout, not our paged slot pool.
So the step reads pool[cur] and writes the whole updated pool into pool[1 - cur]: correct under documented
semantics, at the price of twice the pool memory and one device-side pool copy per step (~0.2 ms per GB at H200
bandwidth: an estimate, not a measurement). builder/tensorrt_backend.py discusses the alternatives. Where the
engine itself reports each pool output aliased to its input (ICudaEngine.get_aliased_input_tensor, TensorRT 11.4
bindings), one buffer is used instead.

The API names used here and in builder/tensorrt_backend.py were checked against the strings of the Python bindings
of TensorRT 11.4.0.106 (tensorrt_cu12_bindings wheel, which installs but cannot load without TensorRT's libraries).

This module must not import builder/ or recipes/; torch (for CUDA memory) and tensorrt are imported lazily.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.core.engine_format import (LOGITS, EngineConfig, engine_file, kcache_name, kcache_out_name,
                                       vcache_name, vcache_out_name)
from engine.core.errors import EngineError
from engine.core.parallel import kv_heads_per_rank
from engine.core.serde import from_json

from .engine_dir import REBUILD, load_runnable_engine, verifying_files
from .step_inputs import SeqChunk, check_step, make_step_inputs, max_attention_rows

INSTALL = "install the `tensorrt` extra (pip install 'engine[tensorrt]') on a machine with an NVIDIA GPU"


@dataclass(frozen=True)
class DeviceStamp:
    """What a serialized TensorRT engine is tied to: the TensorRT version that built it and the GPU's compute
    capability (an engine's kernels are chosen for one architecture). Recorded in config.json: backend_version and
    backend_device."""
    tensorrt_version: str
    compute_capability: str          # "9.0" for sm_90
    device_name: str = ""
    max_slots: int = 0               # KV pool rows the optimization profile allows (num_blocks * tokens_per_block)

    def record(self) -> dict:
        """config.json's backend_device (the TensorRT version is its backend_version)."""
        return {"compute_capability": self.compute_capability, "device_name": self.device_name,
                "max_slots": self.max_slots}


def stamp_of(config: EngineConfig, engine_dir: Path) -> DeviceStamp:
    """The DeviceStamp config.json records, or an EngineError saying to rebuild when it records none."""
    if not config.backend_device:
        raise EngineError(f"{engine_dir}/config.json does not record the GPU the engine was built for "
                          f"(backend_device); {REBUILD.format(dir=engine_dir)} --backend tensorrt")
    return from_json(DeviceStamp, {"tensorrt_version": config.backend_version, **config.backend_device},
                     where=f"{engine_dir}/config.json backend_device")


def check_device(stamp: DeviceStamp, tensorrt_version: str, compute_capability: str, device_name: str,
                 engine_dir: Path) -> None:
    """Refuse an engine built by another TensorRT or for another GPU architecture, saying how to rebuild."""
    rebuild = f"{REBUILD.format(dir=engine_dir)} --backend tensorrt on this machine"
    if stamp.tensorrt_version != tensorrt_version:
        raise EngineError(f"{engine_dir} was built with TensorRT {stamp.tensorrt_version} but TensorRT "
                          f"{tensorrt_version} is installed; TensorRT engines are not portable across versions: "
                          f"{rebuild}")
    if stamp.compute_capability != compute_capability:
        raise EngineError(f"{engine_dir} was built for compute capability {stamp.compute_capability} "
                          f"({stamp.device_name or 'unknown GPU'}) but this GPU ({device_name}) has "
                          f"{compute_capability}; TensorRT engines are specific to a GPU architecture: {rebuild}")


def import_tensorrt():
    """The `tensorrt` module, or an EngineError naming the extra and the GPU requirement."""
    try:
        import tensorrt
    except ImportError as e:  # absent, or the bindings without their libraries (libnvinfer, libnvonnxparser)
        raise EngineError(f"TensorRT engines need the `tensorrt` Python package and an NVIDIA GPU; "
                          f"`import tensorrt` failed ({e}): {INSTALL}") from None
    return tensorrt


def cuda_device(rank: int = 0) -> tuple[int, str, str]:
    """(index, compute capability "major.minor", name) of the GPU of `rank`: rank modulo the visible GPUs;
    EngineError when none is visible."""
    import torch
    if not torch.cuda.is_available():
        raise EngineError("TensorRT engines run on an NVIDIA GPU and no CUDA device is visible to torch "
                          "(torch.cuda.is_available() is False): run on a GPU machine with a CUDA build of torch")
    index = rank % torch.cuda.device_count()
    major, minor = torch.cuda.get_device_capability(index)
    return index, f"{major}.{minor}", torch.cuda.get_device_name(index)


class TrtSession:
    def __init__(self, engine_dir: Path, *, num_blocks: int, rank: int = 0, config: EngineConfig | None = None):
        """A tp=1 engine (its files verified while TensorRT deserializes), or with `config` (already checked) one
        rank of a tp > 1 engine, on GPU `rank` modulo the visible GPUs (runtime/tp/trt_shard.py)."""
        import torch

        engine_dir = Path(engine_dir)
        self.config: EngineConfig = config or load_runnable_engine(engine_dir, "tensorrt")
        cfg, build = self.config, self.config.build
        trt = import_tensorrt()
        index, capability, name = cuda_device(rank)
        self._device = torch.device("cuda", index)
        torch.cuda.set_device(self._device)  # TensorRT and NCCL work on the current device
        stamp = stamp_of(cfg, engine_dir)
        check_device(stamp, trt.__version__, capability, name, engine_dir)
        slots = num_blocks * build.tokens_per_block
        if num_blocks < 1 or slots > stamp.max_slots:
            raise EngineError(f"num_blocks {num_blocks} must be in [1, {stamp.max_slots // build.tokens_per_block}]: "
                              "the engine's optimization profile allows at most max_batch_size * max_seq_len KV "
                              "slots; lower the KV budget or rebuild with larger limits")
        self.num_blocks = num_blocks
        self.tokens_per_block = build.tokens_per_block
        model = cfg.model
        self._sliding = model.sliding_window if "sliding" in model.layer_types else None

        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        plan_file = engine_dir / engine_file(rank, "tensorrt")
        # hashes every file while TensorRT deserializes the plan (a tp > 1 session does it for all its ranks)
        with verifying_files(engine_dir, self.config) if config is None else contextlib.nullcontext():
            self._engine = self._runtime.deserialize_cuda_engine(plan_file.read_bytes())
        if self._engine is None:
            raise EngineError(f"TensorRT could not deserialize {plan_file} (see its log above); "
                              f"{REBUILD.format(dir=engine_dir)} --backend tensorrt")
        self._context = self._engine.create_execution_context()
        self._inputs = {self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)
                        if self._engine.get_tensor_mode(self._engine.get_tensor_name(i)) == trt.TensorIOMode.INPUT}
        self._stream = torch.cuda.Stream()
        kv_size = kv_heads_per_rank(model, cfg.mapping.tp_size) * model.head_dim
        # pools[p][i] = (k, v) of layer i in buffer p; zeros, not empty: padded context entries read slot 0 under a
        # False mask, and 0 * NaN would poison the softmax (plugins/attention.py).
        # TensorRT 11.4 reports outputs that alias an input (ICudaEngine.get_aliased_input_tensor, "for certain
        # operations like KVCacheUpdate"); where every pool output does, one buffer suffices, else ping-pong.
        aliased = getattr(self._engine, "get_aliased_input_tensor", lambda name: None)
        in_place = all(aliased(kcache_out_name(i)) == kcache_name(i) and aliased(vcache_out_name(i)) == vcache_name(i)
                       for i in range(model.num_layers))
        self._pools = [[(torch.zeros((slots, kv_size), dtype=torch.float32, device=self._device),
                         torch.zeros((slots, kv_size), dtype=torch.float32, device=self._device))
                        for _ in range(model.num_layers)] for _ in range(1 if in_place else 2)]
        self._cur = 0

    @property
    def kv_pool(self) -> list:
        """[(k, v)] per layer: the device buffers the next step reads."""
        return self._pools[self._cur]

    def run(self, chunks: list[SeqChunk], *, copy: bool = True) -> np.ndarray:
        """Logits [sum of the chunks' num_logits, vocab_size] float32, in chunk order (a new array whatever
        `copy` says: EngineSession.run's keyword)."""
        inputs = make_step_inputs(chunks, self.tokens_per_block, self._sliding, max_attention_rows(self.config))
        check_step(inputs, chunks, self.config, self.num_blocks)
        return self.run_inputs(inputs)[:, :self.config.model.vocab_size]

    def set_communicator(self, capsule) -> None:
        """The NCCL communicator (a PyCapsule of ncclComm_t) the engine's DistCollective layers use; a collective
        call: every rank makes it."""
        if not self._context.set_communicator(capsule):
            raise EngineError("TensorRT refused the NCCL communicator of this tensor-parallel engine (see its log "
                              "above)")

    def run_inputs(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        """The engine's logits output [S, vocab columns of this rank] for the step `inputs` (make_step_inputs)."""
        import torch

        ctx = self._context
        keep = []  # device copies must outlive the asynchronous execution
        with torch.cuda.stream(self._stream):
            for name, array in inputs.items():
                if name not in self._inputs:
                    continue
                t = _on_device(torch, array, self._device)
                keep.append(t)
                ctx.set_input_shape(name, tuple(array.shape))
                ctx.set_tensor_address(name, t.data_ptr())
            src, dst = self._pools[self._cur], self._pools[(self._cur + 1) % len(self._pools)]
            for i, ((k, v), (k_out, v_out)) in enumerate(zip(src, dst)):
                for name, t in ((kcache_name(i), k), (vcache_name(i), v)):
                    ctx.set_input_shape(name, tuple(t.shape))
                    ctx.set_tensor_address(name, t.data_ptr())
                ctx.set_tensor_address(kcache_out_name(i), k_out.data_ptr())
                ctx.set_tensor_address(vcache_out_name(i), v_out.data_ptr())
            shape = tuple(ctx.get_tensor_shape(LOGITS))  # known once every input shape is set
            logits = _on_device(torch, np.empty(shape, dtype=np.float32), self._device)
            ctx.set_tensor_address(LOGITS, logits.data_ptr())
            if not ctx.execute_async_v3(self._stream.cuda_stream):
                raise EngineError("TensorRT failed to enqueue the step (see its log above)")
        self._stream.synchronize()
        self._cur = (self._cur + 1) % len(self._pools)
        return logits.cpu().numpy()


def _on_device(torch, array: np.ndarray, device):
    """`array` copied to `device`. A step may have no token wanting logits (S = 0); an empty tensor's data_ptr() is
    0, so every buffer is carved from an allocation of at least one element and TensorRT never sees a null address."""
    flat = torch.empty(max(array.size, 1), dtype=getattr(torch, array.dtype.name), device=device)
    view = flat[:array.size].view(array.shape)
    if array.size:
        view.copy_(torch.from_numpy(np.ascontiguousarray(array)), non_blocking=True)
    return view
