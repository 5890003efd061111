"""Tensor parallelism on this machine: tp=1 against tp=2 (and tp=3) engines of SmolLM2-135M's size, prefill and
decode throughput.

    .venv/bin/python -m bench.tensor_parallel [--root .cache/bench_tp] [--repeats 3] [--threads-tp1 2]

SmolLM2-135M has 9 heads and 3 KV heads, so it splits at tp=3 but not at tp=2: tp=1 against tp=2 runs on a
model of its shape with 8 heads of 72 and 4 KV heads (random weights, same size), and the real model runs tp=1
against tp=3 (three processes on this machine's two cores: oversubscribed). Engines are built from float32
checkpoints (convert of the smollm2 HF dir, bench/real_models.py) and driven at the session level
(runtime/session.py EngineSession against runtime/tp/session.py TPSession), so the numbers are the engine's,
without scheduler or sampling: tp=1 runs one process with --threads-tp1 ORT threads, tp=N runs N processes
(rank 0 here, the others spawned) with max(1, cores // N) threads each.
Workloads: prefill of one 256-token prompt; decode at batch 1 and batch 8 (32 steps each, context ~64 tokens).
Each is repeated --repeats times and the best run is reported (the machine is shared: the best run is the one the
least disturbed). The load average before and after is printed and saved with the results: on a loaded machine the
numbers say little about the design. Prints a table and writes bench/results/tp.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path

import numpy as np

from engine.builder.build import build_engine
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk
from engine.runtime.tp.session import TPSession

from bench import real_models

ROOT = Path(__file__).resolve().parent
BUILD = BuildConfig(max_batch_size=8, max_input_len=512, max_seq_len=512, max_num_tokens=512, tokens_per_block=32)
BLOCKS = 8 * 512 // 32


def engines(root: Path, model: str, tps: list[int]) -> dict[int, Path]:
    from engine.recipes.convert import ConvertConfig, convert
    from engine.recipes.sources import HFDirSource
    smollm2 = real_models.hf_dir("smollm2")
    hf = smollm2 if model == "smollm2" else eight_heads(smollm2, root / "hf_8heads")
    ckpt = root / model / "ckpt"
    if not ckpt.exists():
        convert(HFDirSource(hf), ConvertConfig(output_dir=ckpt))
    out = {}
    for tp in tps:
        out[tp] = root / model / f"engine_tp{tp}"
        if not out[tp].exists():
            build_engine(ckpt, out[tp], dataclasses.replace(BUILD, tp_size=tp), PluginConfig())
    return out


def eight_heads(smollm2: Path, out: Path) -> Path:
    """SmolLM2-135M's shape with 8 heads of 72 and 4 KV heads instead of 9 and 3 (which tp=2 cannot split):
    random weights (seed 0), the same parameter count and tokenizer; throughput does not depend on the values."""
    if out.exists():
        return out
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig.from_pretrained(smollm2)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, 72
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (smollm2 / name).exists():
            shutil.copy(smollm2 / name, out / name)
    return out


def prefill(session, length: int) -> float:
    ids = np.random.default_rng(0).integers(100, 40000, length).tolist()
    t = time.perf_counter()
    session.run([SeqChunk(ids, 0, list(range(-(-length // 32))), True)])
    return length / (time.perf_counter() - t)


def decode(session, batch: int, steps: int = 32, context: int = 64) -> float:
    rng = np.random.default_rng(1)
    per_seq = -(-(context + steps) // 32)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    prompts = [rng.integers(100, 40000, context).tolist() for _ in range(batch)]
    logits = session.run([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables)])
    tokens = logits.argmax(-1).tolist()
    t = time.perf_counter()
    for i in range(steps):
        logits = session.run([SeqChunk([tok], context + i, table, True) for tok, table in zip(tokens, tables)])
        tokens = logits.argmax(-1).tolist()
    return batch * steps / (time.perf_counter() - t)


def measure(session, repeats: int) -> dict[str, float]:
    decode(session, 1, steps=4)  # warm-up: first runs allocate
    return {"prefill_256": max(prefill(session, 256) for _ in range(repeats)),
            "decode_b1": max(decode(session, 1) for _ in range(repeats)),
            "decode_b8": max(decode(session, 8) for _ in range(repeats))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", type=Path, default=ROOT.parent / ".cache" / "bench_tp")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads-tp1", type=int, default=os.cpu_count() or 1)
    a = p.parse_args()
    load_before = os.getloadavg()
    results = {}
    for model, tps in (("smollm2-8heads", [1, 2]), ("smollm2", [1, 3])):
        paths = engines(a.root, model, tps)
        for tp in tps:
            if tp == 1:
                session = EngineSession(paths[1], num_blocks=BLOCKS, threads=a.threads_tp1)
            else:
                session = TPSession(paths[tp], num_blocks=BLOCKS)
            try:
                results[f"{model} tp={tp}"] = measure(session, a.repeats)
            finally:
                getattr(session, "close", lambda: None)()
            del session
    load_after = os.getloadavg()
    print(f"fp32, {os.cpu_count()} cores, tp=1 with {a.threads_tp1} ORT threads, tp=N with N processes of "
          f"max(1, {os.cpu_count()} // N) threads; load average before {load_before[0]:.1f} / after "
          f"{load_after[0]:.1f} (1 min): other processes share these cores")
    keys = list(next(iter(results.values())))
    print(f"{'tok/s':<22}" + "".join(f"{k:>14}" for k in keys))
    for name, row in results.items():
        print(f"{name:<22}" + "".join(f"{row[k]:>14.1f}" for k in keys))
    out = ROOT / "results" / "tp.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"machine": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                               "load_average_before": load_before, "load_average_after": load_after,
                               "threads_tp1": a.threads_tp1, "build": dataclasses.asdict(BUILD),
                               "tokens_per_s": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
