"""Tensor-parallel ranks for `engine run` and `engine serve`: torchrun-style environment variables -> DistributedConfig.

    WORLD_SIZE unset                      spawn: a tp > 1 engine starts its other ranks itself (local subprocesses)
    RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set (torchrun --nproc-per-node N, or by hand on several machines)
                                          this process is rank RANK; rank 0 schedules and samples (and prints or
                                          serves), ranks > 0 run their shard until rank 0 shuts down

The environment is read here, at the CLI edge, and nowhere below.
"""
from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

from engine.core.errors import EngineError

log = logging.getLogger("engine.cli")


def distributed_from_env(timeout_s: float):
    """The DistributedConfig of this process from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT (spawn if unset)."""
    from engine.runtime.tp.distributed import DistributedConfig
    if timeout_s <= 0:
        raise EngineError(f"--tp-timeout {timeout_s:g} must be positive (seconds)", usage=True)
    env = os.environ
    if "WORLD_SIZE" not in env:
        return DistributedConfig(timeout_s=timeout_s)  # spawn: the engine's tp decides the world size
    values = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
        try:
            values[name] = int(env[name])
        except KeyError:
            raise EngineError(f"WORLD_SIZE is set but {name} is not; set RANK, WORLD_SIZE, MASTER_ADDR and "
                              "MASTER_PORT (torchrun does), or unset WORLD_SIZE to let the engine start its ranks")
        except ValueError:
            raise EngineError(f"{name}={env[name]!r} is not an integer")
    return DistributedConfig(rank=values["RANK"], world_size=values["WORLD_SIZE"],
                             master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=values["MASTER_PORT"],
                             use_agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
                             timeout_s=timeout_s, spawn=False)


def serve_rank_if_worker(engine_dir: Path, dist, threads: int | None) -> bool:
    """Run this process as a worker rank when `dist` says rank > 0 (until rank 0 shuts down); True if it did."""
    if dist.spawn or dist.rank == 0:
        return False
    from engine.runtime.tp.worker import serve_rank
    serve_rank(engine_dir, dist, threads)
    return True


class StopOnRankFailure:
    """For `engine serve`: when a tensor-parallel rank fails, log it and stop the server (SIGTERM to this process,
    the same graceful path as Ctrl-C); `message` then holds why, for the exit status."""

    def __init__(self):
        self.message: str | None = None

    def attach(self, llm) -> None:
        if hasattr(llm.session, "on_failure"):
            llm.session.on_failure = self

    def __call__(self, message: str) -> None:
        self.message = message
        log.error("stopping the server: %s", message)
        os.kill(os.getpid(), signal.SIGTERM)
