"""LoRA adapters: what serving them costs against the base engine (issue #51's goals: a rank-16 adapter on every
attention and MLP projection decodes at batch 1 no more than 10% slower than the base engine; 32 streams spread
over 4 adapters reach >= 0.85x the throughput of 32 streams on the base).

    .venv/bin/python -m bench.lora [--model smollm2|qwen2.5-coder-0.5b|...] [--dtype gguf] [--rank 16]
        [--rounds 2] [--max-tokens 128] [--streams 32] [--threads 2] [--parts batch1 streams]

Engines (cached under .cache/bench/lora/MODEL-DTYPE): `base`, built as usual, and `lora`, the same build with
--lora-target-modules all. Adapters: PEFT-format directories of rank --rank on all seven projections, random
(written here with safetensors: speed does not depend on the values; tests/runtime/test_lora.py checks them
against peft).
  batch1   one 64-token prompt, --max-tokens greedy tokens (ignore_eos), decode tok/s (the steps after the first):
           base engine | lora engine, no adapter | lora engine, adapter.
  streams  --streams prompts admitted together (continuous batching), tokens / seconds of all steps: base engine |
           lora engine, no adapter | lora engine, the prompts spread over 4 adapters (max_loras 4).
The three cases' engine cores are stepped in turns, step by step (their order rotating), --rounds runs each: the
host is shared, and its load then falls on all alike. Besides tok/s, "paired" is the median over steps of the base
step's time / the case's.
Prints a table and writes bench/results/lora_MODEL-DTYPE.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from bench.real_models import DEFAULT_CACHE, gguf
from engine.runtime import LLM, SamplingParams
from tests.lora_models import write_random_adapter

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "bench" / "results"


def engines(model: str, dtype: str, cache: Path) -> tuple[Path, Path]:
    """(base, lora) engine directories, converted and built with the CLI on first use."""
    root = cache / "lora" / f"{model}-{dtype}"
    ckpt, base, adapted = root / "ckpt", root / "base", root / "lora"
    engine = [sys.executable, "-m", "engine.cli"]
    if not (ckpt / "config.json").is_file():
        subprocess.run([*engine, "convert", "--gguf", str(gguf(model)), "--output-dir", str(ckpt), "--force"],
                       check=True)
    for out, extra in ((base, []), (adapted, ["--lora-target-modules", "all"])):
        if not (out / "config.json").is_file():
            subprocess.run([*engine, "build", "--checkpoint-dir", str(ckpt), "--output-dir", str(out), "--dtype",
                            dtype, "--eval-tokens", "0", "--max-seq-len", "2048", "--force", *extra], check=True)
    return base, adapted


def paired_steps(cases: dict, prompts: list[list[int]], params: SamplingParams, repeats: int) -> dict:
    """Seconds and tokens of every engine step of each case {name: (llm, adapter names or None)}, the cases' step i
    run one after another in a rotating order (the host is shared: its load then falls on all alike). Every case
    runs the same prompts with the same limits, so its step i does the same work."""
    steps = {name: [] for name in cases}
    for _ in range(repeats):
        for name, (llm, adapters) in cases.items():
            for i, prompt in enumerate(prompts):
                seq, _ = llm.make_sequence(prompt, params, lora=adapters[i % len(adapters)] if adapters else None)
                llm.core.add_request(seq)
        names, i = list(cases), 0
        while any(llm.core.has_unfinished() for llm, _ in cases.values()):
            for name in names[i % len(names):] + names[:i % len(names)]:
                t = time.perf_counter()
                outs = cases[name][0].core.step()
                steps[name].append((time.perf_counter() - t, len(outs), i))
            i += 1
        for llm, _ in cases.values():
            llm.core.blocks.check_all_free()
    return steps


def summary(steps: dict, paired_with: str, skip_first: bool) -> dict:
    """tok/s of each case over its steps (without each run's first, its prefill, when skip_first), and the median
    over steps of paired_with's step time / the case's."""
    keep = {name: [s for s in v if not (skip_first and s[2] == 0)] for name, v in steps.items()}
    out = {"tok_s": {n: sum(s[1] for s in v) / sum(s[0] for s in v) for n, v in keep.items()}}
    out["paired_ratio"] = {n: statistics.median(b[0] / c[0] for b, c in zip(keep[paired_with], v))
                           for n, v in keep.items()}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="gguf")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--parts", nargs="+", default=["batch1", "streams"])
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = ap.parse_args()
    label = f"{args.model}-{args.dtype}"
    base_dir, lora_dir = engines(args.model, args.dtype, args.cache)
    adapters = {f"a{s}": write_random_adapter(args.cache / "lora" / f"{label}-r{args.rank}-{s}", lora_dir, args.rank, s)
                for s in range(4)}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 20000, 64).tolist() for _ in range(args.streams)]
    base = LLM(base_dir, threads=args.threads, max_kv_tokens=max(args.streams * 256, 2048))
    # two LLMs of the LoRA engine (the same files): one serves no adapter, the other the adapters, stepped in turns
    adapted, adapted2 = (LLM(lora_dir, threads=args.threads, max_kv_tokens=max(args.streams * 256, 2048),
                             lora_config={"max_loras": 4, "max_lora_rank": args.rank, "modules": adapters})
                         for _ in range(2))
    results = {"model": args.model, "dtype": args.dtype, "rank": args.rank, "threads": args.threads,
               "max_tokens": args.max_tokens, "adapter_mb": round(adapted.loras.slots.nbytes / 5 / 2 ** 20, 1)}
    table = Table(title=f"LoRA rank {args.rank} on {label}, {args.threads} threads, tok/s over {args.rounds} runs "
                        "stepped in turns")
    for col in ("part", "base", "lora engine, no adapter", "lora engine, adapters", "adapters / base", "goal"):
        table.add_column(col)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    if "batch1" in args.parts:
        steps = paired_steps({"base": (base, None), "no_adapter": (adapted, None), "adapter": (adapted2, ["a0"])},
                             prompts[:1], params, args.rounds)
        results["batch1_decode"] = r = summary(steps, "base", skip_first=True)
        _row(table, "batch 1 decode", r, "adapter", ">= 0.90")
    if "streams" in args.parts:
        steps = paired_steps({"base": (base, None), "no_adapter": (adapted, None),
                              "adapters": (adapted2, list(adapters))}, prompts, params, args.rounds)
        results["streams"] = r = summary(steps, "base", skip_first=False)
        _row(table, f"{args.streams} streams", r, "adapters", ">= 0.85")
    Console().print(table)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"lora_{label}.json").write_text(json.dumps(results, indent=2) + "\n")


def _row(table: Table, part: str, r: dict, adapted: str, goal: str) -> None:
    tok_s, paired = r["tok_s"], r["paired_ratio"]
    table.add_row(part, f"{tok_s['base']:.1f}", f"{tok_s['no_adapter']:.1f}", f"{tok_s[adapted]:.1f}",
                  f"{tok_s[adapted] / tok_s['base']:.3f} (paired {paired[adapted]:.3f})", goal)


if __name__ == "__main__":
    main()
