"""What cutting long chunks into attention rows buys (runtime/step_inputs.py): one mixed step, rows vs one row per
sequence (every decode padded to the chunk's length), on a real engine.

    .venv/bin/python -m bench.attention_rows [--engine-dir .cache/engines/smollm2] [--context 900] [--chunk 128]

The step: `--decodes` sequences decoding at `--context` tokens of context, beside one prefill chunk of `--chunk`
tokens that starts at position `--chunk-start`. Time is the CPU time of this process with one ORT thread (on a
shared machine other processes do not count), best of `--repeats`. Prints a table, writes
bench/results/attention_rows.json.
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import numpy as np

from engine.runtime import session as session_module
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk, make_step_inputs

ROOT = Path(__file__).resolve().parent


def step_time(session: EngineSession, chunks: list[SeqChunk], max_rows: int | None, repeats: int) -> float:
    session_module.make_step_inputs = functools.partial(make_step_inputs, max_rows=max_rows)
    try:
        best = float("inf")
        for _ in range(repeats):
            t = time.process_time()
            session.run(chunks)
            best = min(best, time.process_time() - t)
        return best
    finally:
        session_module.make_step_inputs = make_step_inputs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine-dir", default=str(ROOT.parent / ".cache/engines/smollm2"))
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--context", type=int, default=900)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--chunk-start", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    session = EngineSession(Path(args.engine_dir), num_blocks=(args.decodes + 1) * 48, threads=1)
    tpb, blocks = session.tokens_per_block, 48
    rng = np.random.default_rng(0)
    chunks = [SeqChunk([int(rng.integers(1000))], args.context, list(range(i * blocks, (i + 1) * blocks)), True)
              for i in range(args.decodes)]
    chunks.append(SeqChunk(rng.integers(1000, size=args.chunk).tolist(), args.chunk_start,
                           list(range(args.decodes * blocks, (args.decodes + 1) * blocks)), True))
    assert (args.context + 1) <= blocks * tpb and args.chunk_start + args.chunk <= blocks * tpb
    rows = make_step_inputs(chunks, tpb, None)["q_index"].shape
    rows_s = step_time(session, chunks, None, args.repeats)
    padded_s = step_time(session, chunks, len(chunks), args.repeats)
    chunk_only_s = step_time(session, chunks[-1:], None, args.repeats)
    decodes_only_s = step_time(session, chunks[:-1], None, args.repeats)
    result = {"engine": args.engine_dir, "decodes": args.decodes, "context": args.context, "chunk": args.chunk,
              "rows_shape": list(rows), "rows_s": rows_s, "padded_s": padded_s, "chunk_alone_s": chunk_only_s,
              "decodes_alone_s": decodes_only_s, "speedup": padded_s / rows_s}
    print(f"{args.decodes} decodes at context {args.context} + a {args.chunk}-token chunk (1 thread, CPU s, best of "
          f"{args.repeats})")
    print(f"{'one row per sequence (padded)':34s} {padded_s:7.3f} s")
    print(f"{'rows ' + str(tuple(rows)):34s} {rows_s:7.3f} s   ({result['speedup']:.2f}x)")
    print(f"{'the chunk alone':34s} {chunk_only_s:7.3f} s")
    print(f"{'the decodes alone':34s} {decodes_only_s:7.3f} s")
    (ROOT / "results").mkdir(exist_ok=True)
    (ROOT / "results" / "attention_rows.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
