"""Tensor-parallel execution of tp > 1 engines: one process per rank, collectives with torch.distributed (gloo).

    session.py   rank 0: the engine session the scheduler calls (spawns or joins the other ranks)
    worker.py    ranks 1..N-1: receive each step, run the shard, all-reduce, send logits columns to rank 0
    shard.py     one rank's segment graphs and KV pools (ONNX Runtime), one step
    group.py     torch.distributed store handshake and gloo collectives on numpy arrays
    protocol.py  the step message rank 0 broadcasts (int64 arrays, no pickling)
    config.py    DistributedConfig: rank, world size, rendezvous, timeout

torch is imported only by group.py, and only once a tp > 1 engine is loaded: tp=1 runs stay torch-free.
"""
from .distributed import DistributedConfig

__all__ = ["DistributedConfig"]
