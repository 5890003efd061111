"""bench/compare.py --resume: which steps a resumed run keeps and which it measures (again)."""
from __future__ import annotations

import argparse

from bench.compare_runner import Runner

PREVIOUS = [{"name": "bandwidth", "status": "ok"}, {"name": "engine-fp32", "status": "ok"},
            {"name": "engine-int8", "status": "failed"}, {"name": "llamacpp-x", "status": "not installed"}]


def runner(only=None, skip=None) -> Runner:
    r = Runner(argparse.Namespace(threads=2, only=only, skip=skip))
    r.keep(PREVIOUS)
    return r


def test_resume_keeps_what_did_not_fail_and_runs_the_rest():
    r = runner()
    assert [rec["name"] for rec in r.records] == ["bandwidth", "engine-fp32", "llamacpp-x"]
    assert [n for n in ("bandwidth", "engine-fp32", "engine-int8", "serve-int4") if r.wanted(n)] == \
        ["engine-int8", "serve-int4"]


def test_resume_measures_the_steps_only_names_again():
    r = runner(only="bandwidth,engine-*")
    assert [rec["name"] for rec in r.records] == ["llamacpp-x"]
    assert [n for n in ("bandwidth", "engine-fp32", "engine-int8", "serve-int4") if r.wanted(n)] == \
        ["bandwidth", "engine-fp32", "engine-int8"]
    skipped = runner(only="bandwidth,engine-*", skip="engine-fp32")   # skipped: kept as it was, not measured
    assert [rec["name"] for rec in skipped.records] == ["engine-fp32", "llamacpp-x"]
    assert not skipped.wanted("engine-fp32") and skipped.wanted("bandwidth")
