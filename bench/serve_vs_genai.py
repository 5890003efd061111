"""The serving goal of issue #7, side by side: 32 concurrent streams through `engine serve` against
onnxruntime-genai generating a batch of 8, on the same prompts, same lengths, same thread count.

    .venv/bin/python -m bench.serve_vs_genai --model qwen2.5-coder-0.5b [--variant gguf]
    .venv/bin/python -m bench.serve_vs_genai --pair .cache/bench/engines/int4-lmq=.cache/bench/ortgenai-0.18.0/int4 \
        [--pair ENGINE_DIR=GENAI_DIR ...] [--streams 32] [--genai-batch 8] [--input-len 128] [--output-len 128]
        [--threads 2] [--rounds 3] [--stream-interval 1]

--model (smollm2, qwen2.5-coder-0.5b or qwen2.5-coder-1.5b; bench/real_models.py) pairs the model's engine of
--variant (default int4 for smollm2, gguf for the others) with its onnxruntime-genai int4, both made on first use in
bench/compare.py's cache (bench/compare_models.py); --pair names the directories instead.
Engine: `engine serve` started by bench/serve_clients.py's start_server, `streams` prompts sent at once as
/v1/completions streams (greedy, ignore_eos), total output tokens over the wall time of the whole round.
onnxruntime-genai: prompts in batches of `genai_batch` (one Generator each: append_tokens of the [batch, input_len]
ids, then generate_next_token until every row has `output_len` new tokens), total output tokens over the wall
time of all batches, so both sides produce the same tokens from the same prompts. Prompts are random token ids of
equal length (no padding on either side); each round uses fresh ones (the server keeps its prefix cache).
One untimed round each first, then --rounds rounds; the ratio is the median of the per-round ratios, and the
server's memory after the last round is checked against the serving-memory goal (bench/serve_memory.py). Writes
bench/results/serve_vs_genai.json (serve_vs_genai_<model>.json with a --model other than smollm2).
--stream-interval N starts the server with `engine serve --stream-interval N` (an SSE chunk every N tokens instead
of every token). bench/compare.py runs the same measurement as its serve
steps (at 1, the default, and at 8), and builds the engines and the onnxruntime-genai models under .cache/bench.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from bench import compare_models as models
from bench import real_models
from bench.compare_machine import installed
from bench.serve_clients import run_clients, start_server
from bench.serve_memory import server_memory


def genai_round(model_dir: Path, prompts: list[list[int]], batch: int, output_len: int, threads: int) -> dict:
    """onnxruntime-genai over `prompts` in batches of `batch`: output tokens per second of the whole round."""
    import onnxruntime_genai as og
    cfg = og.Config(str(model_dir))
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(cfg)
    produced = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        ids = np.array(prompts[i:i + batch], dtype=np.int32)
        params = og.GeneratorParams(model)
        length = ids.shape[1] + output_len
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(ids))
        g = og.Generator(model, params)
        g.append_tokens(ids)
        while not g.is_done():
            g.generate_next_token()
        produced += sum(len(g.get_sequence(r)) - ids.shape[1] for r in range(len(ids)))
    wall = time.perf_counter() - start
    return {"wall_s": wall, "output_tokens": produced, "output_tok_s": produced / wall}


def engine_round(url: str, prompts: list[list[int]], output_len: int) -> dict:
    return asyncio.run(run_clients(url, "bench", prompts, output_len, concurrency=len(prompts)))


def serve_pair(engine_dir: Path, genai_dir: Path, *, streams: int, genai_batch: int, input_len: int,
               output_len: int, threads: int, rounds: int, stream_interval: int = 1, seed: int = 0) -> dict:
    """One untimed round on each side (the server's first round maps its KV pool's pages, onnxruntime-genai's
    first batch its buffers), then `rounds` rounds of engine then peer on the same fresh prompts. The ratio is
    the median of the per-round ratios; the server's memory is read after the last round (bench/serve_memory)."""
    from engine.runtime.engine_dir import load_engine_config
    cfg = load_engine_config(engine_dir)
    rng = np.random.default_rng(seed)
    vocab = min(cfg.model.vocab_size, 30000)
    max_kv = max(streams * (input_len + output_len + 32), cfg.build.max_seq_len)
    prompt_sets = [[rng.integers(100, vocab, input_len).tolist() for _ in range(streams)] for _ in range(rounds + 1)]
    ours, peer = [], []
    proc, url = start_server(engine_dir, max_kv, threads, stream_interval)
    try:
        for i, prompts in enumerate(prompt_sets):    # interleaved, so drifting load hits both
            e = engine_round(url, prompts, output_len)
            g = genai_round(genai_dir, prompts, genai_batch, output_len, threads)
            print(f"{'warm-up' if i == 0 else f'round {i}'}: {engine_dir.name} {e['output_tok_s']:.1f} tok/s, "
                  f"genai {genai_dir.name} {g['output_tok_s']:.1f} tok/s", file=sys.stderr)
            if i:
                ours.append(e)
                peer.append(g)
        memory = server_memory(proc.pid, url, engine_dir)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    ratios = [a["output_tok_s"] / b["output_tok_s"] for a, b in zip(ours, peer)]
    return {"engine": str(engine_dir), "genai": str(genai_dir), "max_kv_tokens": max_kv,
            "stream_interval": stream_interval,
            "engine_tok_s": statistics.median(r["output_tok_s"] for r in ours),
            "genai_tok_s": statistics.median(r["output_tok_s"] for r in peer),
            "ratios": ratios, "ratio": statistics.median(ratios), "engine_runs": ours, "genai_runs": peer,
            "server_memory": memory}


def model_pair(model: str, variant: str | None) -> tuple[Path, Path]:
    """The model's engine of `variant` and its onnxruntime-genai int4, in bench/compare.py's cache (made there on
    first use: the GGUF models' engines from the file itself, SmolLM2's from its HF dir)."""
    og = installed("onnxruntime_genai")
    if not og:
        raise SystemExit("onnxruntime-genai is not installed (pip install -e '.[bench]')")
    cache = real_models.DEFAULT_CACHE
    if model == "smollm2":
        gguf, hf_dir, no_hf = models.source_models(cache)
        if not hf_dir:
            raise SystemExit(no_hf)
        engine = models.ensure_engine(cache, hf_dir, variant or "int4")
        genai = models.ensure_ortgenai(cache, hf_dir, "int4", og)
    else:
        engine = models.ensure_engine(cache / model, real_models.gguf(model), variant or "gguf")
        genai = models.ensure_ortgenai(cache / model, lambda: real_models.hf_dir(model, cache), "int4", og)
    return Path(models.relative(engine)), Path(models.relative(genai))   # as the results name them


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", choices=list(real_models.DOWNLOAD_NAMES),
                    help="pair the model's engine with its onnxruntime-genai int4, made on first use")
    ap.add_argument("--variant", help="the engine build with --model (default int4 for smollm2, gguf for the others)")
    ap.add_argument("--pair", action="append", default=[], help="ENGINE_DIR=GENAI_MODEL_DIR")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--genai-batch", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up (default 3)")
    ap.add_argument("--stream-interval", type=int, default=1, help="engine serve's --stream-interval (default 1)")
    args = ap.parse_args()
    if not args.pair and not args.model:
        ap.error("give --model or --pair ENGINE_DIR=GENAI_MODEL_DIR")
    pairs = [tuple(Path(p) for p in pair.split("=", 1)) for pair in args.pair]
    if args.model:
        pairs.append(model_pair(args.model, args.variant))
    rows = []
    for engine_dir, genai_dir in pairs:
        rows.append(serve_pair(engine_dir, genai_dir, streams=args.streams, genai_batch=args.genai_batch,
                               input_len=args.input_len, output_len=args.output_len, threads=args.threads,
                               rounds=args.rounds, stream_interval=args.stream_interval))
    print(f"\n{args.streams} streams through engine serve (--stream-interval {args.stream_interval}) vs "
          f"onnxruntime-genai batch {args.genai_batch}; {args.input_len} in / {args.output_len} out, {args.threads} "
          f"threads, median of {args.rounds} rounds:")
    print("| engine | onnxruntime-genai | engine tok/s | genai tok/s | ratio (goal >= 3x) | server peak RSS / "
          "budget MB |\n|---|---|---|---|---|---|")
    for r in rows:
        m = r["server_memory"]
        print(f"| {r['engine']} | {r['genai']} | {r['engine_tok_s']:.1f} | {r['genai_tok_s']:.1f} | "
              f"{r['ratio']:.2f}x | {m['peak_rss_MB']} / {m['budget_MB']} |")
    name = "serve_vs_genai" if args.model in (None, "smollm2") else f"serve_vs_genai_{args.model}"
    out = Path(__file__).parent / "results" / f"{name}.json"
    out.write_text(json.dumps({"config": vars(args), "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
