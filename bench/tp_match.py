"""A tp > 1 engine against the tp 1 engine of the same checkpoint and mode, on a real model: teacher-forced logits
and greedy tokens. The tests check this on tiny models of every family (tests/tp/); this is the real-model check.

    .venv/bin/python -m bench.tp_match --reference ENGINE_TP1 --engine ENGINE_TPN [--engine ...] [--steps 32]

Prompt: the first --prompt-len tokens of bench/anchors/prompt.txt under the engine's tokenizer. Per engine: the
prefill's last-token logits and --steps greedy tokens, each fed the tp 1 engine's token (teacher-forced, so one
early difference does not change every later step): max and RMS logit difference against tp 1, the logit RMS for
scale, top-1 agreement per step, and the step of the first differing greedy token when each decodes on its own.
Appends one record per engine to bench/results/tp_match.json.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "tp_match.json"
PROMPT = ROOT / "bench" / "anchors" / "prompt.txt"


def _open(engine_dir: Path, num_blocks: int):
    from engine.runtime.engine_dir import load_engine_config
    if load_engine_config(engine_dir).mapping.tp_size > 1:
        from engine.runtime.tp.session import TPSession
        return TPSession(engine_dir, num_blocks=num_blocks)
    from engine.runtime.session import EngineSession
    return EngineSession(engine_dir, num_blocks=num_blocks)


def _steps(session, ids: list[int], feed: list[int] | None, steps: int, blocks: list[int]) -> tuple[list[int], list]:
    """Prefill, then `steps` single-token runs fed `feed` (teacher forcing) or the session's own greedy tokens."""
    from engine.runtime.step_inputs import SeqChunk
    logits = [session.run([SeqChunk(ids, 0, blocks, True)])[0]]
    tokens = [int(logits[-1].argmax())]
    for i in range(steps - 1):
        nxt = feed[i] if feed is not None else tokens[-1]
        logits.append(session.run([SeqChunk([nxt], len(ids) + i, blocks, True)])[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


def measure(reference: Path, engine: Path, prompt_len: int, steps: int) -> dict:
    from engine.runtime.engine_dir import load_engine_config
    from engine.runtime.tokenizer import Tokenizer
    ids = Tokenizer(reference).encode(PROMPT.read_text(encoding="utf-8"))[:prompt_len]
    tpb = load_engine_config(reference).build.tokens_per_block
    blocks = list(range(-(-(prompt_len + steps) // tpb) + 1))
    runs = {}
    for name, d in (("reference", reference), ("engine", engine)):
        session = _open(d, len(blocks) + 1)
        try:
            if name == "reference":
                own, logits = _steps(session, ids, None, steps, blocks)
                runs[name] = (own, own, logits)
            else:
                forced, logits = _steps(session, ids, runs["reference"][0], steps, blocks)
                own, _ = _steps(session, ids, None, steps, blocks)
                runs[name] = (own, forced, logits)
        finally:
            getattr(session, "close", lambda: None)()
    ref_tokens, _, ref_logits = runs["reference"]
    own, forced, logits = runs["engine"]
    a, b = np.stack(ref_logits), np.stack(logits)
    diff = b - a
    first = next((i for i, (x, y) in enumerate(zip(own, ref_tokens)) if x != y), None)
    return {"reference": reference.name, "engine": engine.name, "prompt_tokens": len(ids), "steps": steps,
            "max_abs_diff": float(np.abs(diff).max()), "rms_diff": float(np.sqrt((diff ** 2).mean())),
            "logit_rms": float(np.sqrt((a ** 2).mean())),
            "top1_agreement": float(np.mean(a.argmax(-1) == b.argmax(-1))),
            "first_greedy_difference": first}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reference", type=Path, required=True, help="the tp 1 engine")
    p.add_argument("--engine", type=Path, action="append", required=True, help="a tp > 1 engine (repeatable)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=32)
    args = p.parse_args()
    records = json.loads(RESULTS.read_text()) if RESULTS.exists() else []
    for engine in args.engine:
        rec = measure(args.reference, engine, args.prompt_len, args.steps)
        print(json.dumps(rec))
        records.append(rec)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
    main()
