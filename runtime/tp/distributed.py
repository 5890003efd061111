"""Where the ranks of a tp > 1 engine meet: this process's rank, the world size, the rendezvous address, the timeout.

    DistributedConfig()                                        spawn: rank 0 hosts the store on a free local port
                                                               and starts the engine's tp - 1 other ranks
    DistributedConfig(rank=r, world_size=N, master_addr=..., master_port=...)   torchrun-style: every rank started
                                                               by the user (cli/ reads MASTER_ADDR, MASTER_PORT, RANK,
                                                               WORLD_SIZE; nothing below cli/ reads the environment)
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.core.errors import EngineError

DEFAULT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class DistributedConfig:
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0                 # 0 with spawn: rank 0 picks a free port and tells the workers
    use_agent_store: bool = False        # torchrun's agent hosts the store on master_port: rank 0 connects to it too
    timeout_s: float = DEFAULT_TIMEOUT_S  # start-up handshake and every collective; a dead or silent rank -> error
    spawn: bool = True                   # rank 0 starts ranks 1..N-1 itself (False: they are started elsewhere)

    def check(self, tp: int, where: str) -> None:
        if self.world_size != tp:
            raise EngineError(f"{where} is a tp={tp} engine but WORLD_SIZE is {self.world_size}; start {tp} ranks "
                              f"(torchrun --nproc-per-node {tp} ...) or leave WORLD_SIZE unset to spawn them")
        if not 0 <= self.rank < self.world_size:
            raise EngineError(f"RANK {self.rank} is outside [0, {self.world_size})")
        if self.timeout_s <= 0:
            raise EngineError(f"--tp-timeout {self.timeout_s:g} must be positive (seconds)", usage=True)
