"""Which replica a request goes to: the one that owns the longest run of its leading chunk hashes (prefix_key.py),
while that replica is not overloaded; otherwise the least-loaded one.

    owner   the replica that first took a chunk hash keeps it (a spilled request does not move it), so a shared
            system prompt stays cached on one replica instead of on all of them
    match   the owned hashes count only when they cover at least min_match of the request's hashes: a short
            opening that every request shares (a greeting, a tool list) attracts nothing
    bound   the owner takes the request while its load + 1 <= balance_factor x the mean load (this one
            included) + slack: consistent hashing with bounded loads (Mirrokni et al., 2018), the slack keeping
            a nearly idle cluster from spilling at its first concurrent requests
    spill   otherwise the least-loaded replica, ties broken by rendezvous hashing of the first chunk hash, so
            that every ingress sends a new prefix to the same replica

Loads are requests in flight per replica, as the caller knows them. The ownership table is bounded (least recently
used hashes are forgotten first) and is this process's: each replica keeps one, and tells the others the hashes it
takes (`take`, then `learn` on theirs); two that took a hash at once both keep the one that rendezvous hashing of
that hash picks, so the tables agree, and prefixes contested in a burst are split between the replicas rather than
all given to one. Knows nothing of Ray (router.py and front.py use it).
"""
from __future__ import annotations

import hashlib
import random
from collections import OrderedDict
from dataclasses import dataclass

from engine.core.errors import EngineError


@dataclass(frozen=True)
class AffinityConfig:
    balance_factor: float = 1.25
    slack: int = 2
    min_match: float = 0.1
    max_entries: int = 1 << 16

    def __post_init__(self):
        if self.balance_factor < 1:
            raise EngineError(f"balance_factor {self.balance_factor} must be >= 1 (1: perfectly even loads)",
                              usage=True)
        if self.slack < 0 or self.max_entries < 1 or not 0 <= self.min_match <= 1:
            raise EngineError(f"{self} needs slack >= 0, max_entries >= 1 and min_match in [0, 1]", usage=True)


class PrefixAffinity:
    def __init__(self, config: AffinityConfig = AffinityConfig()):
        self.config = config
        self.owners: OrderedDict[int, str] = OrderedDict()     # chunk hash -> replica id, least recent first

    def choose(self, hashes: tuple[int, ...], loads: dict[str, int]) -> str:
        """The replica for a request with these leading hashes, among `loads` (replica id -> requests in flight);
        the choice is recorded, so the next request with the same prefix finds its owner."""
        assert loads, "no replica to choose from"
        owner = self.owner(hashes, loads)
        chosen = owner if owner is not None and self.within_bound(owner, loads) else self.least_loaded(hashes, loads)
        self.take(hashes, chosen, loads)
        return chosen

    def take(self, hashes: tuple[int, ...], replica: str, live) -> tuple[int, ...]:
        """Record that `replica` served these hashes: it owns those that no live replica owned. Returns those."""
        taken = []
        for h in hashes:
            if self.owners.get(h) not in live:
                self.owners[h] = replica
                taken.append(h)
            self.owners.move_to_end(h)
        self._trim()
        return tuple(taken)

    def learn(self, hashes: tuple[int, ...], replica: str, live) -> None:
        """Another replica took these hashes; where this table names a different live owner, rendezvous hashing
        of the hash picks one of the two, here as there."""
        for h in hashes:
            current = self.owners.get(h)
            self.owners[h] = replica if current not in live else max((current, replica), key=_weight(h))
        self._trim()

    def within_bound(self, replica: str, loads: dict[str, int]) -> bool:
        mean = (sum(loads.values()) + 1) / len(loads)
        return loads[replica] + 1 <= self.config.balance_factor * mean + self.config.slack

    def owner(self, hashes: tuple[int, ...], live) -> str | None:
        """The live replica owning the deepest of `hashes`, if that run is long enough to matter."""
        for depth in range(len(hashes), 0, -1):
            replica = self.owners.get(hashes[depth - 1])
            if replica is not None and replica in live:
                return replica if depth >= self.config.min_match * len(hashes) else None
        return None

    def forget(self, replica: str) -> None:
        """A replica that died or was removed owns nothing any more (its successor starts with a cold cache)."""
        for h in [h for h, r in self.owners.items() if r == replica]:
            del self.owners[h]

    @staticmethod
    def least_loaded(hashes: tuple[int, ...], loads: dict[str, int]) -> str:
        least = min(loads.values())
        tied = sorted(r for r, load in loads.items() if load == least)
        if not hashes:
            return random.choice(tied)
        return max(tied, key=_weight(hashes[0]))

    def _trim(self) -> None:
        while len(self.owners) > self.config.max_entries:
            self.owners.popitem(last=False)


def _weight(h: int):
    """Rendezvous hashing's weight of each replica for chunk hash h."""
    key = h.to_bytes(8, "little")
    return lambda replica: hashlib.blake2b(key + replica.encode(), digest_size=8).digest()
