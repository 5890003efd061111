"""Speculative decoding on a real model: prompt lookup on code edits, a draft engine on open-ended prompts, and the
cost of verification as the batch grows (issue #49's goals), in one process, methods in turns.

    .venv/bin/python -m bench.speculative [--model qwen2.5-coder-1.5b] [--draft-model qwen2.5-coder-0.5b]
        [--variant gguf] [--rounds 2] [--max-tokens 384] [--threads 2] [--parts edits open batch]

  edits  input-grounded code edits (a rename, a docstring, a type-annotation pass) of three functions of 30-80 lines
         of this repository, batch 1, greedy, chat-formatted: plain decoding against --speculative ngram
  open   open-ended coding prompts, batch 1, greedy: plain against --speculative draft (the draft model's engine of
         the same variant) and ngram
  batch  one verification step (B sequences x (1 + k) tokens at context 512) against a plain decode step (B x 1),
         B = 1 .. 32: where verifying k drafts stops being nearly free (the speculator's max_batch_size)
  serve  32 concurrent streams (random prompts of 128 tokens, 128 out) through `engine serve`, with and without
         --speculative ngram, servers in turns: the adaptive switch must keep the throughput
Each request runs once per method per round, the methods in turns; every output must equal plain decoding's.
Decode tok/s is a request's (tokens - 1) / (last token - first token), so the prompt's prefill is left out;
the proposers' own time (prompt lookup, the draft's steps) is inside it and also shown. Prints tables and writes
bench/results/speculative.json.
"""
from __future__ import annotations

import argparse
import ast
import json
import statistics
import time
from pathlib import Path

import numpy as np

from bench import compare_models, real_models
from engine.runtime import LLM, SamplingParams
from engine.runtime.speculative import SpeculativeConfig, make_speculator
from engine.runtime.step_inputs import SeqChunk

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "speculative.json"
FUNCTIONS = [("runtime/step_inputs.py", "_packed_inputs"), ("runtime/kv_budget.py", "plan_kv_cache"),
             ("runtime/tp/worker.py", "serve_rank")]
EDITS = {
    "rename": "Rename every variable named `{var}` to `{new}` in this Python function. Reply with the complete "
              "updated function in one code block and nothing else.",
    "docstring": "Add a Google-style docstring (Args, Returns) to this Python function, keeping the code as it is. "
                 "Reply with the complete updated function in one code block and nothing else.",
    "annotate": "Add type annotations to the local variables of this Python function where their type is not "
                "obvious, keeping the code as it is. Reply with the complete updated function in one code block "
                "and nothing else.",
}
RENAMES = {"_packed_inputs": ("q_len", "query_lengths"), "plan_kv_cache": ("blocks", "num_blocks"),
           "serve_rank": ("shard", "rank_shard")}
OPEN = ["Write a Python function that parses an ISO 8601 duration such as P3DT4H5M into a datetime.timedelta.",
        "Write a C function that reverses a singly linked list in place, with a short test in main.",
        "Explain the difference between a process and a thread, with a small Python example of each.",
        "Write a Python class for an LRU cache with get and put in O(1), using collections.OrderedDict."]


def function_source(path: str, name: str) -> str:
    text = (ROOT / path).read_text()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node)
    raise KeyError(name)


def edit_prompts() -> list[tuple[str, str]]:
    out = []
    for path, name in FUNCTIONS:
        src = function_source(path, name)
        var, new = RENAMES[name]
        for task, text in EDITS.items():
            out.append((f"{name}/{task}", text.format(var=var, new=new) + "\n\n```python\n" + src + "\n```"))
    return out


def engine_dir(model: str, variant: str) -> Path:
    cache = compare_models.ROOT / ".cache" / "bench" / model
    return compare_models.ensure_engine(cache, real_models.gguf(model), variant, keep=True)


def run_turns(llm: LLM, methods: dict, prompts: list[tuple[str, str]], rounds: int, max_tokens: int) -> dict:
    """{method: {prompt: [decode tok/s per round]}}, token ids checked against plain decoding's; and the
    speculators' counters."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    ids = {name: llm.tokenizer.encode_chat([{"role": "user", "content": text}]) for name, text in prompts}
    rates = {m: {name: [] for name, _ in prompts} for m in methods}
    tokens, reference = {}, {}
    for r in range(rounds):
        for name, _ in prompts:
            order = list(methods) if r % 2 == 0 else list(methods)[::-1]
            for m in order:
                llm.core.speculator = methods[m]
                out = llm.generate([ids[name]], params)[0]
                rates[m][name].append(out.decode_tokens_per_second)
                tokens[m, name] = len(out.token_ids)
                if m == "plain":
                    reference[name] = out.token_ids
                elif name in reference and out.token_ids != reference[name]:
                    raise AssertionError(f"{m} changed the output of {name}")
    llm.core.speculator = None
    stats = {m: s.stats for m, s in methods.items() if s is not None}
    return {"rates": rates, "tokens": {f"{m}|{n}": t for (m, n), t in tokens.items()},
            "speculation": {m: {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                                "num_accepted_tokens": s.num_accepted_tokens,
                                "mean_acceptance_length": round(s.mean_acceptance_length, 3),
                                "propose_seconds": round(s.propose_seconds, 3)} for m, s in stats.items()}}


def verify_cost(llm: LLM, k: int, batches: list[int], repeats: int = 5) -> list[dict]:
    """Median seconds of a step of B decodes with 1 and with 1 + k tokens each at context 512."""
    tpb, ctx = llm.config.build.tokens_per_block, 512
    per = -(-(ctx + k + 1) // tpb)
    rows = []
    for b in batches:
        if b * per > llm.kv_plan.num_blocks or b * (1 + k) > llm.config.build.max_num_tokens:
            break
        tables = [list(range(i * per, (i + 1) * per)) for i in range(b)]
        times = {}
        for n in (1, 1 + k):
            chunks = [SeqChunk(list(range(100, 100 + n)), ctx, t, n) for t in tables]
            llm.session.run(chunks)
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                llm.session.run(chunks)
                samples.append(time.perf_counter() - t0)
            times[n] = statistics.median(samples)
        rows.append({"batch": b, "plain_ms": times[1] * 1e3, "verify_ms": times[1 + k] * 1e3,
                     "ratio": times[1 + k] / times[1]})
    return rows


def serve_turns(engine: Path, threads: int, rounds: int, streams: int = 32, length: int = 128) -> dict:
    """Output tok/s of `streams` streams through a plain server and a --speculative ngram one, in turns."""
    import asyncio
    from bench.serve_clients import run_clients, start_server
    from engine.runtime.engine_dir import load_engine_config
    max_seq_len = load_engine_config(engine).build.max_seq_len   # the pool must hold one request of it
    servers = {"plain": (), "ngram": ("--speculative", "ngram")}
    rates = {m: [] for m in servers}
    rng = np.random.default_rng(0)
    for r in range(rounds):
        prompts = rng.integers(1000, 20000, (streams, length)).tolist()   # fresh: no prefix-cache hits
        warm = rng.integers(1000, 20000, (2, length)).tolist()
        for m in (servers if r % 2 == 0 else list(servers)[::-1]):
            proc, url = start_server(engine, max(streams * 2 * length, max_seq_len), threads, extra=servers[m])
            try:
                asyncio.run(run_clients(url, "bench", warm, 8, 2))
                rates[m].append(asyncio.run(run_clients(url, "bench", prompts, length, streams))["output_tok_s"])
            finally:
                proc.terminate()
                proc.wait(60)
    ratios = [n / p for n, p in zip(rates["ngram"], rates["plain"])]
    return {"plain": statistics.median(rates["plain"]), "ngram": statistics.median(rates["ngram"]),
            "ratios": ratios, "ratio_median": statistics.median(ratios), "streams": streams, "length": length}


def summarize(part: dict, methods: list[str]) -> dict:
    """Per method: median decode tok/s over prompts (each the median of its rounds), and the median ratio to plain."""
    med = {m: {n: statistics.median(v) for n, v in part["rates"][m].items()} for m in methods}
    out = {}
    for m in methods:
        ratios = [med[m][n] / med["plain"][n] for n in med[m]]
        out[m] = {"tok_s": statistics.median(med[m].values()), "ratio_median": statistics.median(ratios),
                  "ratio_min": min(ratios), "ratio_max": max(ratios)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft-model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--variant", default="gguf")
    ap.add_argument("--draft-variant", default=None, help="the draft's engine variant (default: --variant)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--draft-confidence", type=float, nargs="+", default=[0.0],
                    help="draft_min_confidence values to run, each a method of its own")
    ap.add_argument("--parts", nargs="+", default=["edits", "open", "batch", "serve"])
    args = ap.parse_args()

    target = engine_dir(args.model, args.variant)
    llm = LLM(target, threads=args.threads, max_kv_tokens=32 * 1024)
    result = {"model": args.model, "variant": args.variant, "k": args.k, "threads": args.threads}

    def spec(method: str, **extra):
        cfg = SpeculativeConfig(method=method, num_speculative_tokens=args.k, **extra)
        return make_speculator(cfg, llm.config, llm.tokenizer, args.threads)

    if "edits" in args.parts:
        part = run_turns(llm, {"plain": None, "ngram": spec("ngram")}, edit_prompts(), args.rounds, args.max_tokens)
        part["summary"] = summarize(part, ["plain", "ngram"])
        result["edits"] = part
        print_part("code edits, batch 1, greedy", part)
    if "open" in args.parts:
        draft = engine_dir(args.draft_model, args.draft_variant or args.variant)
        methods = {"plain": None, "ngram": spec("ngram")}
        for c in args.draft_confidence:
            methods["draft" if c == 0 else f"draft>{c:g}"] = spec("draft", draft_engine_dir=draft,
                                                                  draft_min_confidence=c)
        part = run_turns(llm, methods, [(f"open{i}", p) for i, p in enumerate(OPEN)], args.rounds, args.max_tokens)
        part["summary"] = summarize(part, list(methods))
        part["draft"] = {"model": args.draft_model, "engine": str(draft.relative_to(ROOT))}
        result["open"] = part
        print_part(f"open-ended prompts, batch 1, greedy (draft: {args.draft_model})", part)
    if "batch" in args.parts:
        rows = verify_cost(llm, args.k, [1, 2, 4, 8, 16, 32])
        result["batch"] = rows
        print(f"\nverification step (B x {1 + args.k} tokens) against a decode step (B x 1), context 512:")
        for r in rows:
            print(f"  B={r['batch']:3d}  decode {r['plain_ms']:7.1f} ms  verify {r['verify_ms']:7.1f} ms  "
                  f"ratio {r['ratio']:.2f}")
    llm.close()
    if "serve" in args.parts:
        result["serve"] = serve_turns(target, args.threads, args.rounds)
        s = result["serve"]
        print(f"\n32 streams through engine serve: plain {s['plain']:.1f} tok/s, ngram {s['ngram']:.1f} tok/s, "
              f"x{s['ratio_median']:.3f} (per round {', '.join(f'{r:.3f}' for r in s['ratios'])})")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(f"\nwritten to {RESULTS.relative_to(ROOT)}")


def print_part(title: str, part: dict) -> None:
    print(f"\n{title}:")
    for m, s in part["summary"].items():
        sp = part["speculation"].get(m)
        extra = "" if sp is None else (f"  accepted {sp['num_accepted_tokens']}/{sp['num_draft_tokens']}, "
                                       f"{sp['mean_acceptance_length']:.2f} tokens a step, proposer "
                                       f"{sp['propose_seconds']:.2f} s")
        print(f"  {m:6s} {s['tok_s']:6.1f} tok/s  x{s['ratio_median']:.2f} (min {s['ratio_min']:.2f}, "
              f"max {s['ratio_max']:.2f}){extra}")


if __name__ == "__main__":
    main()
