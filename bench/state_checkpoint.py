"""What the inference-state checkpoints cost (runtime/server/resume.py) and what resuming after a restart costs, on a
real engine.

    .venv/bin/python -m bench.state_checkpoint [--engine-dir .cache/engines/smollm2] [--requests 16]
        [--prompt-tokens 128] [--before 32] [--max-tokens 64]

`--requests` greedy requests run together; once each has generated `--before` tokens the engine is snapshotted
(LLM.snapshot's work, between two steps: a server's snapshot also waits for the step in progress, whose time is
shown) and the state file is written atomically (state_checkpoint.write_state: JSON, fsync, rename). A second
engine (the restarted server) reads the file and resumes every request: the table shows how long until every
request produced its next token (the re-prefill of prompt + generated tokens) and until all finished, against
the uninterrupted run, and checks that the resumed text equals it. Writes bench/results/state_checkpoint.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

from engine.runtime import LLM, SamplingParams
from engine.runtime.server.state_file import ChoiceState, ResponseState, read_state, state_path, write_state

ROOT = Path(__file__).resolve().parent


def prompts(llm: LLM, n: int, length: int) -> list[list[int]]:
    text = " ".join(f"Paragraph {i}: the history of the city, its rivers, bridges and markets." for i in range(200))
    ids = llm.tokenizer.encode(text)
    return [llm.tokenizer.encode(f"Request {r}.") + ids[r * 7:r * 7 + length] for r in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine-dir", type=Path, default=ROOT.parent / ".cache/engines/smollm2")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--before", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(args.engine_dir, threads=args.threads, max_kv_tokens=args.requests * 512)
    ps = prompts(llm, args.requests, args.prompt_tokens)

    t0 = time.perf_counter()
    reference = [o.text for o in llm.generate(ps, params)]
    t_uninterrupted = time.perf_counter() - t0

    seqs = [llm.make_sequence(p, params, request_id=f"cmpl-{i}-0")[0] for i, p in enumerate(ps)]
    for s in seqs:
        llm.core.add_request(s)
    step_times = []
    while min(s.num_output_tokens for s in seqs) < args.before:
        t = time.perf_counter()
        llm.core.step()
        step_times.append(time.perf_counter() - t)
    t = time.perf_counter()
    states = llm.core.snapshot()
    t_snapshot = time.perf_counter() - t
    responses = [ResponseState(f"cmpl-{i}", "completion", 0, False, len(s.prompt_token_ids),
                               [ChoiceState(0, s.request_id, None, sequence=s)]) for i, s in enumerate(states)]
    state_dir = Path(tempfile.mkdtemp(prefix="state-bench-"))
    t = time.perf_counter()
    write_state(state_dir, "bench", responses)
    t_write = time.perf_counter() - t
    size = state_path(state_dir).stat().st_size
    for s in seqs:
        llm.core.abort(s.request_id)

    restarted = LLM(args.engine_dir, threads=args.threads, max_kv_tokens=args.requests * 512)
    t = time.perf_counter()
    saved = read_state(state_dir, "bench")
    t_read = time.perf_counter() - t
    first_new: dict[int, float] = {}
    finals: dict[int, str] = {}

    async def resume(i: int, r: ResponseState, start: float):
        async for out in restarted.resume_async(r.choices[0].sequence):
            first_new.setdefault(i, time.perf_counter() - start)
            if out.finished:
                finals[i] = out.text

    async def run():
        start = time.perf_counter()
        await asyncio.gather(*[resume(i, r, start) for i, r in enumerate(saved)])
        return time.perf_counter() - start
    t_resume_total = asyncio.run(run())
    restarted.close()
    same = all(finals[i] == reference[i] for i in range(len(ps)))

    result = {"engine_dir": str(args.engine_dir), "requests": args.requests, "prompt_tokens": args.prompt_tokens,
              "generated_before_checkpoint": args.before, "max_tokens": args.max_tokens,
              "step_s_mean": sum(step_times) / len(step_times), "snapshot_s": t_snapshot, "write_s": t_write,
              "read_s": t_read, "state_file_bytes": size, "uninterrupted_s": t_uninterrupted,
              "resume_until_every_next_token_s": max(first_new.values()), "resume_until_all_finished_s":
              t_resume_total, "resumed_text_equals_uninterrupted": same}
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "state_checkpoint.json").write_text(json.dumps(result, indent=2) + "\n")
    print_table(args, result)


def print_table(args: argparse.Namespace, result: dict) -> None:
    t_snapshot, t_write, t_read = result["snapshot_s"], result["write_s"], result["read_s"]
    size, t_resume_total, t_uninterrupted = (result["state_file_bytes"], result["resume_until_all_finished_s"],
                                             result["uninterrupted_s"])
    rows = [("requests in flight x (prompt + generated) tokens",
             f"{args.requests} x ({args.prompt_tokens} + {args.before})"),
            ("engine step (mean, during the run)", f"{result['step_s_mean'] * 1e3:.1f} ms"),
            ("snapshot between steps", f"{t_snapshot * 1e3:.2f} ms"),
            ("write state file (JSON + fsync + rename)", f"{t_write * 1e3:.2f} ms"),
            ("state file size", f"{size / 1024:.1f} KiB"),
            ("read + validate state file", f"{t_read * 1e3:.2f} ms"),
            ("resume: every request's next token (re-prefill)", f"{result['resume_until_every_next_token_s']:.2f} s"),
            (f"resume: all finished ({args.max_tokens - args.before} tokens left each)", f"{t_resume_total:.2f} s"),
            (f"uninterrupted run, all {args.max_tokens} tokens", f"{t_uninterrupted:.2f} s"),
            ("resumed text == uninterrupted text (greedy)", str(result["resumed_text_equals_uninterrupted"]))]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"| {name:<{width}} | {value:>16} |")


if __name__ == "__main__":
    main()
