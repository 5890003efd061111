"""Structured outputs on one engine: what constrained decoding costs against the same requests unconstrained, and
how often the constrained answers are valid (issue #50's goals: overhead <= 5% at batch 1, <= 10% at 32 streams).

    .venv/bin/python -m bench.structured --engine-dir DIR [--parts validity batch1 streams profile]
        [--rounds 2] [--batch1-cases 12] [--streams 32] [--stream-pairs 6] [--cap 256] [--max-tokens 768]
        [--threads 2] [--label NAME] [--temperature T] [--whitespace PATTERN]

The requests are the schema corpus of tests/runtime/structured_schemas.py (66 JSON schemas of real-world shape,
each with a short chat prompt), greedy (or --temperature T, seeded), in JSON-schema mode.
  validity  every schema in one batched call (max_tokens --max-tokens): the share of answers that stop and
            validate (json.loads, then jsonschema with formats); its lengths are the unconstrained runs' lengths.
  batch1    --batch1-cases schemas one at a time, constrained (C) and unconstrained (U) back to back, the order
            alternating, --rounds times.
  streams   --stream-pairs pairs of --streams requests in one generate call each (continuous batching), C and U
            back to back, the order alternating; pair r takes the r-th group of --streams schemas of the corpus.
  profile   U and C runs again (U C C U) with the time of a step split: the session, the mask fill (on its worker
            thread, beside the session), the wait for it after the session, sampling, and the rest of the step (the
            matchers' consume, detokenizing, scheduling). It wraps GrammarBackend._masks and start_masks and
            engine_core.sample, so it follows their names.
The timed runs stop at --cap tokens (shorter runs, more pairs; most answers are shorter anyway). The
unconstrained request is the constrained one without its grammar, with max_tokens = the constrained answer's
length (capped) and ignore_eos, so both generate the same number of tokens on the same batch composition (the
unconstrained text differs, its cost per token does not). Decode tok/s counts only steps without a prefill in them
(every request of a step reports its token: stream_interval 1): tokens of those steps / their seconds. The overhead
is U tok/s / C tok/s - 1 per pair, the median over pairs; a pair runs back to back, so drift within it is small.
Each run's CPU ms a token (this process, every thread: the session's, the mask worker's) is shown too: on a machine
shared with other work it moves less than wall time.
--whitespace PATTERN adds {"x-guidance": {"whitespace_pattern": PATTERN}} to every schema (llguidance's default
allows any run of whitespace between tokens, and a small model may write newlines to the token limit).
Prints tables and writes bench/results/structured_LABEL.json (LABEL: the engine's model and variant).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from engine.runtime import LLM, SamplingParams
from engine.runtime.structured import StructuredOutputs
from tests.runtime.structured_schemas import CASES, Case, problem

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"


class StepClock:
    """Times every engine step; a step whose outputs include a request's first token had a prefill in it."""

    def __init__(self, llm: LLM):
        self.llm, self.real = llm, llm.core.step
        self.steps: list[tuple[float, int, bool, float]] = []   # (seconds, tokens, had a prefill, CPU seconds)

    def __enter__(self):
        def step():
            t, c = time.perf_counter(), time.process_time()
            outs = self.real()
            self.steps.append((time.perf_counter() - t, len(outs), any(o.num_generated_tokens == 1 for o in outs),
                               time.process_time() - c))
            return outs
        self.llm.core.step = step
        return self

    def __exit__(self, *exc):
        self.llm.core.step = self.real

    def decode_rate(self) -> dict:
        """tok/s, tokens, seconds and CPU seconds (this process's threads) over the steps without a prefill."""
        decode = [s for s in self.steps if not s[2]]
        secs, toks, cpu = sum(s[0] for s in decode), sum(s[1] for s in decode), sum(s[3] for s in decode)
        return {"tok_s": toks / secs if secs else 0.0, "tokens": toks, "seconds": secs, "cpu_seconds": cpu,
                "cpu_ms_per_token": cpu / toks * 1e3 if toks else 0.0}


class Profile:
    """Splits the time of the steps without a prefill: session.run, the masks (on the worker thread), the wait for
    them after the session, sampling; `parts()` gives ms a step."""

    def __init__(self, llm: LLM):
        import engine.runtime.engine_core as ec
        self.llm, self.ec = llm, ec
        self.t = {"session": 0.0, "masks (worker)": 0.0, "mask wait": 0.0, "sample": 0.0}
        self.acc = dict.fromkeys([*self.t, "step"], 0.0)
        self.steps = 0

    def __enter__(self):
        llm, ec, t = self.llm, self.ec, self.t
        core, grammars = llm.core, llm.grammars
        self.saved = (core.step, core.session.run, grammars._masks, grammars.start_masks, ec.sample)
        step, run, masks, start, sample = self.saved

        def timed(key, fn):
            def wrapper(*a, **k):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    t[key] += time.perf_counter() - t0
            return wrapper

        class Waited:
            def __init__(self, fut):
                self.fut = fut

            def result(self):
                t0 = time.perf_counter()
                try:
                    return self.fut.result()
                finally:
                    t["mask wait"] += time.perf_counter() - t0

        def timed_step():
            before, t0 = dict(t), time.perf_counter()
            outs = step()
            if not any(o.num_generated_tokens == 1 for o in outs):   # no prefill in it
                self.acc["step"] += time.perf_counter() - t0
                for k in t:
                    self.acc[k] += t[k] - before[k]
                self.steps += 1
            return outs

        core.step = timed_step
        core.session.run = timed("session", run)
        grammars._masks = timed("masks (worker)", masks)
        grammars.start_masks = lambda reqs: Waited(start(reqs))
        ec.sample = timed("sample", sample)
        return self

    def __exit__(self, *exc):
        core, grammars = self.llm.core, self.llm.grammars
        core.step, core.session.run, grammars._masks, grammars.start_masks, self.ec.sample = self.saved

    def parts(self) -> dict:
        ms = {k: v / max(self.steps, 1) * 1e3 for k, v in self.acc.items()}
        ms["rest of the step"] = ms["step"] - ms["session"] - ms["mask wait"] - ms["sample"]
        return {**ms, "steps": self.steps}


def schema_of(case: Case, whitespace: str | None) -> dict:
    return case.schema if whitespace is None else {**case.schema, "x-guidance": {"whitespace_pattern": whitespace}}


TEMPERATURE = 0.0   # --temperature; each request's seed is its case's index in the corpus


def constrained(case: Case, max_tokens: int, whitespace: str | None) -> SamplingParams:
    return SamplingParams(temperature=TEMPERATURE, seed=CASES.index(case), max_tokens=max_tokens,
                          structured_outputs={"json": schema_of(case, whitespace)})


def unconstrained(case: Case, length: int) -> SamplingParams:
    return SamplingParams(temperature=TEMPERATURE, seed=CASES.index(case), max_tokens=length, ignore_eos=True)


def validity(llm: LLM, prompts: dict, max_tokens: int, whitespace: str | None) -> dict:
    t0 = time.perf_counter()
    outs = llm.generate([prompts[c.name] for c in CASES], [constrained(c, max_tokens, whitespace) for c in CASES])
    wall = time.perf_counter() - t0
    rows = {}
    for c, o in zip(CASES, outs):
        why = problem(c, o.text) if o.finish_reason == "stop" else f"finish_reason {o.finish_reason}"
        rows[c.name] = {"tokens": len(o.token_ids), "finish_reason": o.finish_reason, "problem": why,
                        "text": o.text if why else o.text[:200]}
    valid = sum(r["problem"] is None for r in rows.values())
    return {"cases": len(CASES), "valid": valid, "rate": valid / len(CASES), "wall_s": wall,
            "tokens": sum(r["tokens"] for r in rows.values()),
            "invalid": {k: r["problem"] for k, r in rows.items() if r["problem"]}, "rows": rows}


def compile_ms(llm: LLM, whitespace: str | None) -> dict:
    """Milliseconds to compile each schema into a matcher (the tokenizer's llguidance form already built)."""
    llm.grammars.tokenizer()
    out = {}
    for c in CASES:
        spec = StructuredOutputs(json=schema_of(c, whitespace))
        t0 = time.perf_counter()
        llm.grammars.matcher(spec)
        out[c.name] = (time.perf_counter() - t0) * 1e3
    return {"median_ms": statistics.median(out.values()), "max_ms": max(out.values()), "per_case": out}


def pair(llm: LLM, prompts: list, cases: list[Case], lengths: list[int], first: str, max_tokens: int, ws) -> dict:
    """One C run and one U run of the same requests (in the order `first` says); each's decode rate."""
    rates = {}
    for kind in (("C", "U") if first == "C" else ("U", "C")):
        params = ([constrained(c, max_tokens, ws) for c in cases] if kind == "C"
                  else [unconstrained(c, n) for c, n in zip(cases, lengths)])
        with StepClock(llm) as clock:
            outs = llm.generate(prompts, params)
        rates[kind] = {**clock.decode_rate(), "load": os.getloadavg()[0]}
        if kind == "C" and [len(o.token_ids) for o in outs] != lengths:   # batch-dependent floats: noted, kept
            rates["C"]["lengths_changed"] = sum(len(o.token_ids) != n for o, n in zip(outs, lengths))
    rates["overhead"] = rates["U"]["tok_s"] / rates["C"]["tok_s"] - 1
    rates["cpu_overhead"] = rates["C"]["cpu_ms_per_token"] / rates["U"]["cpu_ms_per_token"] - 1
    return rates


def batch1(llm: LLM, prompts: dict, lengths: dict, n: int, rounds: int, cap: int, ws) -> dict:
    """`n` schemas one at a time, C and U back to back (the order alternating), `rounds` times."""
    cases = [c for c in CASES if lengths[c.name] > 8][:n]
    pairs = []
    for r in range(rounds):
        for i, c in enumerate(cases):
            p = pair(llm, [prompts[c.name]], [c], [min(lengths[c.name], cap)], "C" if (i + r) % 2 == 0 else "U",
                     cap, ws)
            pairs.append({"case": c.name, "round": r, **p})
    return summarize(pairs)


def streams(llm: LLM, prompts: dict, lengths: dict, width: int, npairs: int, cap: int, ws) -> dict:
    """`npairs` pairs of `width` schemas in one call each, the groups taken in turn from the corpus."""
    pairs = []
    for r in range(npairs):
        start = (r * width) % len(CASES)
        cases = (CASES + CASES)[start:start + width]
        p = pair(llm, [prompts[c.name] for c in cases], cases, [min(lengths[c.name], cap) for c in cases],
                 "C" if r % 2 == 0 else "U", cap, ws)
        pairs.append({"cases": [c.name for c in cases], "round": r, **p})
    return summarize(pairs)


def summarize(pairs: list[dict]) -> dict:
    over = [p["overhead"] for p in pairs]
    return {"pairs": pairs, "overhead_median": statistics.median(over), "overhead_min": min(over),
            "overhead_max": max(over), "cpu_overhead_median": statistics.median(p["cpu_overhead"] for p in pairs),
            "C_tok_s": statistics.median(p["C"]["tok_s"] for p in pairs),
            "U_tok_s": statistics.median(p["U"]["tok_s"] for p in pairs)}


def profile(llm: LLM, prompts: dict, lengths: dict, width: int, cap: int, ws, reps: int = 2) -> dict:
    """Per decode step, ms of each part, constrained and unconstrained (U C C U ..., `reps` runs each), for
    `width` streams and for one stream at a time (4 schemas)."""
    out = {}
    for label, cases in ((f"{width} streams", CASES[:width]), ("batch 1", CASES[:4])):
        ps = [prompts[c.name] for c in cases]
        params = {"C": [constrained(c, cap, ws) for c in cases],
                  "U": [unconstrained(c, min(lengths[c.name], cap)) for c in cases]}
        profs = {"U": Profile(llm), "C": Profile(llm)}
        for rep in range(reps):
            for kind in (("U", "C") if rep % 2 == 0 else ("C", "U")):
                runs = [(ps, params[kind])] if label != "batch 1" else [([p], [q]) for p, q in zip(ps, params[kind])]
                with profs[kind]:
                    for p, q in runs:
                        llm.generate(p, q)
        out[label] = {k: v.parts() for k, v in profs.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-dir", type=Path, required=True)
    ap.add_argument("--label", default=None, help="names the results file (default: the engine's model-variant)")
    ap.add_argument("--parts", nargs="+", default=["validity", "batch1", "streams"],
                    choices=["validity", "batch1", "streams", "profile"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch1-cases", type=int, default=12)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--stream-pairs", type=int, default=6, help="C/U pairs of --streams requests")
    ap.add_argument("--cap", type=int, default=256,
                    help="max_tokens of the timed runs (the constrained answers: 38-600 tokens on SmolLM2, most < 250)")
    ap.add_argument("--max-tokens", type=int, default=768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else seeded sampling")
    ap.add_argument("--whitespace", default=None,
                    help="an x-guidance whitespace_pattern for every schema, e.g. '[\\x20\\x0A\\x0D\\x09]{1,20}'")
    args = ap.parse_args()
    global TEMPERATURE
    TEMPERATURE = args.temperature
    eng = args.engine_dir.resolve()
    label = args.label or (f"{eng.parent.parent.name}-{eng.name}" if eng.parent.name == "engines" else eng.name)
    if args.whitespace:
        label += "-ws"
    if args.temperature:
        label += f"-t{args.temperature:g}"
    from engine.runtime.engine_dir import load_engine_config
    max_seq_len = load_engine_config(eng).build.max_seq_len   # the pool must hold one request of it
    llm = LLM(eng, threads=args.threads, max_kv_tokens=max(max_seq_len, args.streams * (args.max_tokens + 128)))
    prompts = {c.name: llm.chat_prompt([{"role": "user", "content": c.prompt}]) for c in CASES}
    result = {"engine": str(eng), "label": label, "threads": args.threads, "max_tokens": args.max_tokens,
              "temperature": args.temperature,
              "whitespace": args.whitespace, "compile": compile_ms(llm, args.whitespace)}
    console = Console(width=150)
    llm.generate([prompts[CASES[0].name]], constrained(CASES[0], 16, args.whitespace))   # warm the session
    v = validity(llm, prompts, args.max_tokens, args.whitespace)
    result["validity"] = v
    lengths = {k: r["tokens"] for k, r in v["rows"].items()}
    print(f"validity: {v['valid']}/{v['cases']} answers stop and validate ({v['rate']:.1%}), {v['tokens']} tokens in "
          f"{v['wall_s']:.1f} s; schema compile median {result['compile']['median_ms']:.2f} ms, max "
          f"{result['compile']['max_ms']:.2f} ms")
    for name, why in v["invalid"].items():
        print(f"  {name}: {why}: {v['rows'][name]['text'][:120]!r}")
    how = "greedy" if not args.temperature else f"temperature {args.temperature:g}"
    table = Table(title=f"constrained (C) vs unconstrained (U) {how} decode on {label}, same token counts")
    for col in ("run", "pairs", "U tok/s", "C tok/s", "overhead (median)", "min .. max", "CPU/token overhead",
                "goal"):
        table.add_column(col, justify="right" if col != "run" else "left")
    if "batch1" in args.parts:
        b = batch1(llm, prompts, lengths, args.batch1_cases, args.rounds, args.cap, args.whitespace)
        result["batch1"] = b
        table.add_row("batch 1", str(len(b["pairs"])), f"{b['U_tok_s']:.1f}", f"{b['C_tok_s']:.1f}",
                      f"{b['overhead_median']:+.1%}", f"{b['overhead_min']:+.1%} .. {b['overhead_max']:+.1%}",
                      f"{b['cpu_overhead_median']:+.1%}", "<= 5%")
    if "streams" in args.parts:
        s = streams(llm, prompts, lengths, args.streams, args.stream_pairs, args.cap, args.whitespace)
        result["streams"] = s
        table.add_row(f"{args.streams} streams", str(len(s["pairs"])), f"{s['U_tok_s']:.1f}", f"{s['C_tok_s']:.1f}",
                      f"{s['overhead_median']:+.1%}", f"{s['overhead_min']:+.1%} .. {s['overhead_max']:+.1%}",
                      f"{s['cpu_overhead_median']:+.1%}", "<= 10%")
    if "batch1" in args.parts or "streams" in args.parts:
        console.print(table)
    if "profile" in args.parts:
        prof = profile(llm, prompts, lengths, args.streams, args.cap, args.whitespace)
        result["profile"] = prof
        for label_, rows in prof.items():
            t = Table(title=f"ms per step, {label_} (masks run on a worker thread beside the session)")
            t.add_column("part")
            t.add_column("U", justify="right")
            t.add_column("C", justify="right")
            for k in rows["C"]:
                fmt = "{:d}" if k == "steps" else "{:.2f}"
                t.add_row(k, fmt.format(rows["U"][k]), fmt.format(rows["C"][k]))
            console.print(t)
    llm.close()
    path = RESULTS_DIR / f"structured_{label}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
