"""Ray Serve's request router for the engine's replicas: least loaded, or a replica named by the caller while it
is not overloaded (affinity.py's bound).

It runs in Ray's HTTP proxy, which sends each request to a replica (front.py), and in each replica, which forwards
a request whose prompt prefix another replica owns to that one with `handle_http(request, prefer=owner)`. The proxy
has not read the body when it routes, so it cannot see the prompt: it sends to the least-loaded replica and the
replica forwards once when it is not the owner (`avoid`: itself), or when its queue is full (`avoid` alone). Loads are the replicas' ongoing requests from Ray's queue-length
cache (kept by Ray as requests are sent and finish, and refreshed from the replicas' own counts), probed when the
cache has no entry, plus the replicas this router chose and Ray has not yet sent to: a burst of requests is routed
before the first of them is sent, and would otherwise all see the same loads. It names one replica, then all of
them: Ray sends the request to the named one unless it is at max_ongoing_requests, else to the least loaded of the
rest.

Why not Ray's PrefixCacheAffinityRouter: it matches characters in a prefix-tree actor, with two blocking actor
calls per request, and by default never lets load override the match; and in the proxy it has no prompt to match.
"""
from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from .affinity import AffinityConfig, PrefixAffinity

UNSENT_TTL_S = 1.0     # a choice Ray has not acted on by then was dropped (a cancelled or rerouted request)


class PrefixAwareRouter(RequestRouter):
    def initialize_state(self, **affinity):
        """request_router_kwargs: AffinityConfig's fields (its bound; the ownership table is the replicas')."""
        self.affinity = PrefixAffinity(AffinityConfig(**affinity))
        self.unsent: defaultdict[str, deque[float]] = defaultdict(deque)   # replica -> times it was chosen

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if not candidate_replicas:
            return []
        kwargs = pending_request.kwargs if pending_request is not None else {}
        prefer, avoid = kwargs.get("prefer"), kwargs.get("avoid")
        loads = await self._loads(candidate_replicas)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        open_loads = {rid: load for rid, load in loads.items() if load < by_id[rid].max_ongoing_requests}
        if avoid in open_loads and len(open_loads) > 1:     # the replica forwarding it
            del open_loads[avoid]
        if not open_loads:              # every replica is full: Ray backs off and asks again
            return [candidate_replicas]
        if prefer in open_loads and self.affinity.within_bound(prefer, open_loads):
            chosen = prefer
        else:
            chosen = self.affinity.least_loaded((), open_loads)
        self.unsent[chosen].append(time.monotonic())
        return [[by_id[chosen]], candidate_replicas]

    def on_send_request(self, replica_id: ReplicaID):
        super().on_send_request(replica_id)    # Ray's cache counts it from now on
        unsent = self.unsent.get(replica_id.unique_id)
        if unsent:
            unsent.popleft()

    async def _loads(self, replicas: List[RunningReplica]) -> dict[str, int]:
        cache = self.replica_queue_len_cache
        loads = {r.replica_id.unique_id: cache.get(r.replica_id) for r in replicas}
        missing = [r for r in replicas if loads[r.replica_id.unique_id] is None]
        if missing:
            # The probe Ray's own routers make (it also fills the cache); a replica that does not answer in time
            # is counted as full for this decision.
            for r, queue_len in await self._probe_queue_lens(missing, 0):
                loads[r.replica_id.unique_id] = r.max_ongoing_requests if queue_len is None else queue_len
        too_old = time.monotonic() - UNSENT_TTL_S
        for replica, unsent in self.unsent.items():
            while unsent and unsent[0] < too_old:
                unsent.popleft()
            if replica in loads:
                loads[replica] += len(unsent)
        return loads

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.unsent.pop(replica_id.unique_id, None)

    def update_replicas(self, replicas: List[RunningReplica]):
        gone = set(self.curr_replicas) - {r.replica_id for r in replicas}
        super().update_replicas(replicas)
        for replica_id in gone:
            self.unsent.pop(replica_id.unique_id, None)
