"""affinity: a prefix sticks to the replica that first took it, until that replica's load passes the bound."""
from __future__ import annotations

import pytest

from engine.core.errors import EngineError
from engine.runtime.replicas.affinity import AffinityConfig, PrefixAffinity

P1 = (11, 12, 13, 14)
P2 = (21, 22, 23, 24)


def test_requests_sharing_a_prefix_go_where_it_went_first():
    a = PrefixAffinity()
    first = a.choose(P1, {"r1": 0, "r2": 0})
    for loads in ({"r1": 1, "r2": 0}, {"r1": 0, "r2": 1}, {"r1": 2, "r2": 1}):
        assert a.choose(P1[:3] + (99,), loads) == first    # the same leading chunks, another ending


def test_a_new_prefix_goes_to_the_least_loaded_replica():
    a = PrefixAffinity()
    assert a.choose(P1, {"r1": 3, "r2": 1}) == "r2"
    assert a.choose(P2, {"r1": 0, "r2": 5}) == "r1"
    assert a.choose((), {"r1": 4, "r2": 2}) == "r2"


def test_ties_between_idle_replicas_break_the_same_way_in_every_router():
    """Rendezvous hashing on the first chunk: two ingresses send a new prefix to the same replica."""
    choices = {PrefixAffinity().choose(P1, {"r1": 0, "r2": 0, "r3": 0}) for _ in range(5)}
    assert len(choices) == 1
    spread = {PrefixAffinity().choose((h,), {"r1": 0, "r2": 0, "r3": 0}) for h in range(40)}
    assert spread == {"r1", "r2", "r3"}


def test_an_overloaded_owner_spills_to_the_least_loaded_and_keeps_the_prefix():
    a = PrefixAffinity(AffinityConfig(balance_factor=1.25, slack=2))
    owner = a.choose(P1, {"r1": 0, "r2": 0})
    other = "r2" if owner == "r1" else "r1"
    # mean with this request (10 + 0 + 1) / 2 = 5.5; bound 1.25 * 5.5 + 2 = 8.9 < 11
    assert a.choose(P1, {owner: 10, other: 0}) == other
    assert a.choose(P1, {owner: 1, other: 0}) == owner        # the spill did not move the prefix


def test_a_short_shared_opening_attracts_nothing():
    a = PrefixAffinity(AffinityConfig(min_match=0.5))
    owner = a.choose((1, 2, 3, 4), {"r1": 0, "r2": 0})
    other = "r2" if owner == "r1" else "r1"
    assert a.choose((1, 7, 8, 9), {owner: 1, other: 0}) == other     # 1 of 4 chunks matched: below min_match


def test_a_dead_replica_owns_nothing_and_gone_replicas_are_ignored():
    a = PrefixAffinity()
    owner = a.choose(P1, {"r1": 0, "r2": 0})
    other = "r2" if owner == "r1" else "r1"
    assert a.choose(P1, {other: 3, "r3": 0}) == "r3"       # the owner is not among the live replicas
    a.forget(owner)
    assert owner not in a.owners.values()


def test_the_table_is_bounded():
    a = PrefixAffinity(AffinityConfig(max_entries=8))
    for p in range(10):
        a.choose((p * 10, p * 10 + 1), {"r1": 0, "r2": 0})
    assert len(a.owners) == 8 and (0 not in a.owners) and (91 in a.owners)


def test_bad_settings_are_usage_errors():
    with pytest.raises(EngineError, match="balance_factor"):
        AffinityConfig(balance_factor=0.5)
    with pytest.raises(EngineError, match="min_match"):
        AffinityConfig(min_match=2)


def test_two_replicas_that_take_a_prefix_at_once_agree_and_split_contested_prefixes():
    """Each replica's table (peers.py): both took a prefix before hearing of the other; told, both keep the same
    owner, and over many such prefixes each replica keeps some."""
    live = {"r1", "r2"}
    tables = {r: PrefixAffinity() for r in live}
    prefixes = [(h, h + 1000) for h in range(40)]
    for r, table in tables.items():
        for p in prefixes:
            assert table.take(p, r, live) == p
    for p in prefixes:
        tables["r1"].learn(p, "r2", live)
        tables["r2"].learn(p, "r1", live)
    owners = [{table.owner(p, live) for table in tables.values()} for p in prefixes]
    assert all(len(o) == 1 for o in owners)
    assert {o.pop() for o in owners} == live
    assert tables["r2"].take(prefixes[0] + (999,), "r2", live) == (999,)     # only the new hash is r2's to tell


def test_a_dead_owners_prefix_is_taken_by_the_next_replica_that_serves_it():
    a = PrefixAffinity()
    a.take(P1, "r1", {"r1", "r2"})
    assert a.owner(P1, {"r2"}) is None
    assert a.take(P1, "r2", {"r2"}) == P1 and a.owner(P1, {"r2"}) == "r2"
