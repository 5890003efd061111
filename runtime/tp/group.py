"""The ranks' communication: a torch.distributed TCPStore for the start-up handshake and a gloo process group for
the per-step collectives, on numpy arrays through torch.from_numpy (no copies).

    store = open_store(dist)                  rank 0 hosts it (port 0: a free port), the others connect
    rendezvous(store, dist, ...)              every rank says it loaded its shard ("ready/r") or why it could not
    group = Group(store, dist)                torch.distributed.ProcessGroupGloo, built directly (not the default
                                              group), so a process may hold several engines, each with its own group
    group.header(h) / broadcast(a) / all_reduce(a) / gather(a)

Every collective waits at most `timeout_s` (gloo raises "Timed out waiting ..."), and fails at once when a peer's
connection closes ("Connection closed by peer": a rank died). Either becomes an EngineError. gloo: the segments
run on ONNX Runtime's CPU provider, so the arrays are in host memory; NCCL would need device buffers.
torch is imported here only, when a tp > 1 engine is loaded.
"""
from __future__ import annotations

import datetime
import time
from typing import Callable

import numpy as np

from engine.core.engine_format import MAX, SUM
from engine.core.errors import EngineError

from .distributed import DistributedConfig

READY, ERROR, NUM_BLOCKS = "engine/ready/{}", "engine/error/{}", "engine/num_blocks"


def open_store(dist: DistributedConfig):
    import torch.distributed as td
    timeout = datetime.timedelta(seconds=dist.timeout_s)
    try:
        if dist.rank == 0 and not dist.use_agent_store:
            return td.TCPStore(dist.master_addr, dist.master_port, dist.world_size, is_master=True,
                               timeout=timeout, wait_for_workers=False)
        return td.TCPStore(dist.master_addr, dist.master_port, dist.world_size, is_master=False, timeout=timeout)
    except (RuntimeError, ValueError) as e:  # DistStoreError / DistNetworkError derive from RuntimeError
        raise EngineError(f"tensor-parallel rank {dist.rank} cannot reach the rendezvous at "
                          f"{dist.master_addr}:{dist.master_port} within {dist.timeout_s:g} s: {e}") from None


def wait_for_ranks(store, dist: DistributedConfig, alive: Callable[[int], str | None] | None = None) -> None:
    """Rank 0: wait until every other rank reported "ready", or raise naming the first that failed (its message,
    or `alive(r)`: why its process is gone) or that said nothing within the timeout."""
    deadline = time.monotonic() + dist.timeout_s
    pending = set(range(1, dist.world_size))
    while pending:
        for r in sorted(pending):
            if store.check([ERROR.format(r)]):
                raise EngineError(f"tensor-parallel rank {r} failed to start: {store.get(ERROR.format(r)).decode()}")
            if store.check([READY.format(r)]):
                pending.discard(r)
                continue
            gone = alive(r) if alive is not None else None
            if gone:
                raise EngineError(f"tensor-parallel rank {r} failed to start: {gone}")
        if pending and time.monotonic() > deadline:
            raise EngineError(f"tensor-parallel rank(s) {', '.join(map(str, sorted(pending)))} did not start within "
                              f"{dist.timeout_s:g} s; check that every rank runs (torchrun: the same command on each "
                              "node) and raise the timeout for large engines")
        time.sleep(0.05)


class Group:
    def __init__(self, store, dist: DistributedConfig):
        import torch
        import torch.distributed as td
        self._torch, self._td = torch, td
        self.rank, self.size, self.timeout_s = dist.rank, dist.world_size, dist.timeout_s
        self._pg = td.ProcessGroupGloo(store, dist.rank, dist.world_size, datetime.timedelta(seconds=dist.timeout_s))

    def _wait(self, work, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            detail = _first_line(e)
            if "Timed out" in detail:
                reason = f"no answer from the other ranks within {self.timeout_s:g} s ({detail})"
            elif any(s in detail for s in ("closed by peer", "reset by peer", "Broken pipe", "refused")):
                reason = f"another rank's connection closed: it exited or crashed ({detail})"
            else:
                reason = detail
            raise CollectiveError(f"{what} failed on rank {self.rank}: {reason}") from None

    def header(self, head: np.ndarray | None, size: int) -> np.ndarray:
        """Rank 0's header on every rank. An all-reduce rather than a broadcast, so that rank 0 learns at once
        when a rank is gone (a broadcast's root only writes to its peers' sockets)."""
        buf = np.zeros(size, dtype=np.int64) if head is None else np.array(head, dtype=np.int64)
        self._wait(self._pg.allreduce([self._torch.from_numpy(buf)]), "the step header exchange")
        return buf

    def broadcast(self, array: np.ndarray) -> None:
        opts = self._td.BroadcastOptions()
        opts.rootRank = 0
        self._wait(self._pg.broadcast([self._torch.from_numpy(array)], opts), "the step broadcast")

    def all_reduce(self, array: np.ndarray, op: str = SUM) -> None:
        """Sum (or with op "max", the max of) `array` over the ranks, in place (a contiguous numpy array or view)."""
        opts = self._td.AllreduceOptions()
        opts.reduceOp = self._td.ReduceOp.MAX if op == MAX else self._td.ReduceOp.SUM
        self._wait(self._pg.allreduce([self._torch.from_numpy(array)], opts), "an all-reduce")

    def gather(self, array: np.ndarray) -> np.ndarray | None:
        """Rank 0: the ranks' arrays stacked [size, *shape]; other ranks: None."""
        opts = self._td.GatherOptions()
        opts.rootRank = 0
        t = self._torch.from_numpy(np.ascontiguousarray(array))
        if self.rank == 0:
            out = np.empty((self.size, *array.shape), dtype=array.dtype)
            self._wait(self._pg.gather([[self._torch.from_numpy(x) for x in out]], [t], opts), "the logits gather")
            return out
        self._wait(self._pg.gather([], [t], opts), "the logits gather")
        return None


class CollectiveError(EngineError):
    """A collective failed: a rank died (its connection closed) or did not answer within the timeout."""


def _first_line(e: BaseException) -> str:
    """gloo's message without its source location and its boilerplate advice."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = text.split("] ", 1)[-1] if text.startswith("[") else text
    return text.split(". This is typically", 1)[0]
