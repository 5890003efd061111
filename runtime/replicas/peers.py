"""The other replicas as one replica sees them: which are live, which owns which prompt prefixes, and the handle
that reaches them (front.py forwards through it, and gathers /metrics with it).

    owner_of(hashes)   the live replica owning the deepest of a request's leading hashes, or None when it is this
                       one or nobody: this replica then takes the unowned hashes and tells the others (learn)
    learn(claims, r)   another replica took these hashes (affinity.py settles two that took one at once); claims
                       leave in one broadcast every CLAIM_BATCH_S, as Ray means broadcasts for a control plane
    broadcast(m)       m's result from every replica, an exception in place of each that failed

The live set is refreshed in the background from Ray's own list of replicas (a broadcast), so a replica that died
owns nothing here within LIVE_REFRESH_S; knows nothing of HTTP.
"""
from __future__ import annotations

import asyncio
import logging

from ray.serve import exceptions as serve_errors

from .affinity import AffinityConfig, PrefixAffinity

log = logging.getLogger("engine.replicas")
LIVE_REFRESH_S = 2.0
BROADCAST_TIMEOUT_S = 5.0
CLAIM_BATCH_S = 0.05


class Peers:
    def __init__(self, me: str, handle, affinity: AffinityConfig):
        self.me, self.handle = me, handle          # handle: the DeploymentHandle of this replica's own deployment
        self.table = PrefixAffinity(affinity)
        self.live: set[str] = {me}
        self._claims: list[tuple[int, ...]] = []     # taken here, not yet told
        self._tasks: set[asyncio.Task] = set()      # gossip in flight (a task nobody holds may be collected)
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_live())

    def owner_of(self, hashes: tuple[int, ...]) -> str | None:
        owner = self.table.owner(hashes, self.live)
        if owner is not None and owner != self.me:
            return owner
        taken = self.table.take(hashes, self.me, self.live)
        if taken and len(self.live) > 1:
            if not self._claims:
                self._spawn(self._tell_claims())
            self._claims.append(taken)
        return None

    def learn(self, claims: list[tuple[int, ...]], replica: str) -> None:
        if replica != self.me:
            for hashes in claims:
                self.table.learn(hashes, replica, self.live | {replica})

    async def broadcast(self, method: str, *args) -> list:
        """[] on a timeout or while Ray knows of no replica yet."""
        try:
            return await self.handle.broadcast(method, *args).results_async(timeout_s=BROADCAST_TIMEOUT_S,
                                                                            return_exceptions=True)
        except (TimeoutError, serve_errors.RayServeException):
            return []

    def close(self) -> None:
        self._refresher.cancel()

    async def _refresh_live(self) -> None:
        while True:
            ids = {r for r in await self.broadcast("replica_id") if isinstance(r, str)}
            if ids:
                for gone in self.live - ids - {self.me}:
                    self.table.forget(gone)
                self.live = ids | {self.me}
            await asyncio.sleep(LIVE_REFRESH_S)

    async def _tell_claims(self) -> None:
        await asyncio.sleep(CLAIM_BATCH_S)
        claims, self._claims = self._claims, []
        try:
            await self.broadcast("learn", claims, self.me)
        except Exception as e:  # noqa: BLE001 - a lost claim costs cache hits, not correctness
            log.debug("telling the replicas of %d prefixes failed: %r", len(claims), e)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
