"""One rank of a tp > 1 TensorRT engine behind RankShard's interface (runtime/tp/shard.py). Its all-reduces are
DistCollective layers inside rank{N}.engine (builder/tensorrt_backend.py), so a step is one engine call per rank.
NOTHING HERE HAS RUN: the machines this project is developed on have no GPU and cannot install TensorRT.

    TrtRankShard(engine_dir, config, rank, num_blocks)   rank{N}.engine on GPU rank % visible GPUs (TrtSession)
    join(store, world_size)      once every rank has loaded: rank 0 makes an NCCL unique id, the store carries it to
                                 the others, every rank creates the communicator and sets it on its execution context
    run(inputs, reduce)          this rank's logits columns; `reduce` is not called (the engine all-reduces itself)

The communicator comes from nccl4py (NVIDIA's NCCL bindings; TensorRT's multi-device sample uses them), handed to
IExecutionContext.set_communicator as a PyCapsule named "ncclComm_t", as that sample does (TensorRT 11
samples/python/attention_mdtrt). Both NCCL calls are collective: every rank makes them in the same order.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable

import numpy as np

from engine.core.engine_format import EngineConfig
from engine.core.errors import EngineError

NCCL_ID = "engine/nccl_unique_id"
_CAPSULE_NAME = b"ncclComm_t"  # module-level: a capsule keeps a pointer to its name, not a copy


def import_nccl():
    try:
        import nccl.core as nccl
    except ImportError as e:
        raise EngineError(f"tensor-parallel TensorRT engines need nccl4py for their NCCL communicator; `import "
                          f"nccl.core` failed ({e}): install the `tensorrt` extra (pip install 'engine[tensorrt]')"
                          ) from None
    return nccl


def communicator_capsule(pointer: int):
    """A PyCapsule holding an ncclComm_t, the form IExecutionContext.set_communicator takes."""
    if not pointer:
        raise EngineError("the NCCL communicator is not initialised (null ncclComm_t)")
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(pointer, _CAPSULE_NAME, None)


class TrtRankShard:
    def __init__(self, engine_dir: Path, config: EngineConfig, rank: int, *, num_blocks: int):
        from ..trt_session import TrtSession

        self.rank = rank
        self._nccl = import_nccl()  # before the engine loads: a missing package fails this rank's start-up
        self.session = TrtSession(engine_dir, num_blocks=num_blocks, rank=rank, config=config)
        self._communicator = None

    @property
    def kv_pool(self):
        return self.session.kv_pool

    def join(self, store, world_size: int) -> None:
        nccl = self._nccl
        if self.rank == 0:
            unique_id = nccl.get_unique_id()
            store.set(NCCL_ID, bytes(unique_id))
        else:
            unique_id = nccl.UniqueId.from_bytes(store.get(NCCL_ID))  # waits (store timeout) for rank 0
        self._communicator = nccl.Communicator.init(nranks=world_size, rank=self.rank, unique_id=unique_id)
        self.session.set_communicator(communicator_capsule(self._communicator.ptr))

    def run(self, inputs: dict[str, np.ndarray], reduce: Callable[[np.ndarray, str], None]) -> np.ndarray:
        if self._communicator is None:
            raise EngineError(f"tensor-parallel rank {self.rank} ran a step before joining the NCCL communicator")
        return self.session.run_inputs(inputs)
