"""Mixture-of-experts decode against a dense model of the same active parameters (issue #54's goals).

    .venv/bin/python -m bench.moe [--dtypes int4_wo,int8_wo] [--layers 4] [--turns 5] [--root .cache/bench_moe]

The MoE model has Qwen3-30B-A3B's layer shape (hidden 2048, 32 heads of 128, 4 KV heads, q/k norms, 128 experts of
moe_intermediate 768, top 8, normalized), with --layers layers and a 32768-token vocabulary (the real 151936 would
make lm_head, which both models share, the larger part of a batch-1 step). The dense model is Qwen3 of the same
shape with one MLP of 8 x 768 = 6144 intermediate features: the same active parameters a token. Random weights
(seed 0, bfloat16 HF dirs written here, then `engine convert` and `engine build --dtype D --quantize-lm-head
--eval-tokens 0`: a float32 lm_head would be most of a batch-1 step's bytes): the random router spreads tokens about
evenly over the experts, as a trained one is meant to.

Both engines run at the session level (runtime/session.py, --threads ORT threads) after a 64-token prompt a sequence:
  b1   greedy decode steps of one sequence
  b32  decode steps of 32 sequences
--steps steps a turn, --turns turns after a warm-up turn; step i of each (engine, kind) runs right after the others'
step i, in an order that rotates, the steps of every turn rewriting the same positions. Prints tok/s (batch over the
median step) and the goals' ratios as medians of step-by-step ratios (MoE b1 / dense b1 >= 0.8; MoE b32 / MoE b1
>= 2), with the load average before and after (the machine is shared); writes bench/results/moe.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from engine.runtime.session import EngineSession
from engine.runtime.step_inputs import SeqChunk

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "moe.json"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 32, 4, 128, 32768
EXPERTS, TOP_K, EXPERT_INTER = 128, 8, 768
CONTEXT, TPB = 64, 32
KINDS = {"b1": 1, "b32": 32}


def hf_config(layers: int, moe: bool) -> dict:
    common = dict(hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB, rms_norm_eps=1e-6,
                  rope_theta=1e6, max_position_embeddings=4096, tie_word_embeddings=False, hidden_act="silu",
                  dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    if not moe:
        return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
                "intermediate_size": TOP_K * EXPERT_INTER}
    return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "intermediate_size": TOP_K * EXPERT_INTER, "moe_intermediate_size": EXPERT_INTER,
            "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True, "decoder_sparse_step": 1}


def write_hf(out: Path, layers: int, moe: bool) -> Path:
    """A random Qwen3(-MoE) HF dir, one safetensors file a layer (a layer's experts are 1.2 GB in bfloat16)."""
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    top = {"model.embed_tokens.weight": rand(VOCAB, HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN),
           "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    save_file(top, out / "model-top.safetensors")
    index = {name: "model-top.safetensors" for name in top}
    for i in range(layers):
        p = f"model.layers.{i}."
        layer = {p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                 p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                 p + "self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, HIDDEN),
                 p + "self_attn.k_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                 p + "self_attn.v_proj.weight": rand(KV_HEADS * HEAD_DIM, HIDDEN),
                 p + "self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
                 p + "self_attn.q_norm.weight": torch.ones(HEAD_DIM, dtype=torch.bfloat16),
                 p + "self_attn.k_norm.weight": torch.ones(HEAD_DIM, dtype=torch.bfloat16)}
        if moe:   # transformers 5's stacked layout (recipes/moe.py)
            layer |= {p + "mlp.gate.weight": rand(EXPERTS, HIDDEN),
                      p + "mlp.experts.gate_up_proj": rand(EXPERTS, 2 * EXPERT_INTER, HIDDEN),
                      p + "mlp.experts.down_proj": rand(EXPERTS, HIDDEN, EXPERT_INTER)}
        else:
            inter = TOP_K * EXPERT_INTER
            layer |= {p + "mlp.gate_proj.weight": rand(inter, HIDDEN), p + "mlp.up_proj.weight": rand(inter, HIDDEN),
                      p + "mlp.down_proj.weight": rand(HIDDEN, inter)}
        save_file(layer, out / f"model-layer{i}.safetensors")
        index |= {name: f"model-layer{i}.safetensors" for name in layer}
        del layer
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (out / "config.json").write_text(json.dumps(hf_config(layers, moe), indent=2))
    return out


def cli(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "engine.cli", *args, "--no-progress"], check=True, cwd=ROOT)


def engine(root: Path, model: str, layers: int, dtype: str) -> Path:
    """The engine of `model` ("moe" or "dense") at `dtype`, made (HF dir, checkpoint, engine) where absent."""
    base = root / f"{model}-{layers}l"
    out = base / "engines" / dtype
    if (out / "config.json").exists():
        return out
    ckpt = base / "ckpt"
    if not (ckpt / "config.json").exists():
        hf = write_hf(base / "hf", layers, model == "moe")
        cli("convert", "--model-dir", str(hf), "--output-dir", str(ckpt), "--force")
    cli("build", "--checkpoint-dir", str(ckpt), "--output-dir", str(out), "--dtype", dtype, "--quantize-lm-head",
        "--eval-tokens", "0", "--max-batch-size", "32", "--max-seq-len", "256", "--max-input-len", "128",
        "--max-num-tokens", "2048", "--force")
    return out


class Bench:
    """One engine's session with each kind's sequences prefilled once; decode step i of a turn writes position
    CONTEXT + i of each sequence, so every turn decodes from the same positions."""

    def __init__(self, path: Path, threads: int, steps: int):
        per_seq = -(-(CONTEXT + steps) // TPB)
        self.session = EngineSession(path, num_blocks=sum(KINDS.values()) * per_seq, threads=threads)
        rng = np.random.default_rng(1)
        self.tables, self.first, self.tokens, first_block = {}, {}, {}, 0
        for kind, batch in KINDS.items():
            tables = [list(range(first_block + b * per_seq, first_block + (b + 1) * per_seq)) for b in range(batch)]
            first_block += batch * per_seq
            prompts = [rng.integers(100, VOCAB - 100, CONTEXT).tolist() for _ in range(batch)]
            logits = self.session.run([SeqChunk(p, 0, t, True) for p, t in zip(prompts, tables)])
            self.tables[kind], self.first[kind] = tables, logits.argmax(-1).tolist()

    def step(self, kind: str, i: int) -> float:
        """Seconds of greedy decode step i of this kind's sequences (step 0 starts from the prompts' tokens)."""
        tokens = self.first[kind] if i == 0 else self.tokens[kind]
        t = time.perf_counter()
        logits = self.session.run([SeqChunk([tok], CONTEXT + i, table, True)
                                   for tok, table in zip(tokens, self.tables[kind])])
        seconds = time.perf_counter() - t
        self.tokens[kind] = logits.argmax(-1).tolist()
        return seconds


def measure(paths: dict[str, Path], threads: int, steps: int, turns: int) -> dict:
    """Every (model, kind)'s step i run one after another, their order rotating, so that the host's load changes
    (the machine is shared) fall on all four alike; medians of the step times, and of the ratios step by step."""
    benches = {model: Bench(path, threads, steps) for model, path in paths.items()}
    pairs = [(model, kind) for model in benches for kind in KINDS]
    times: dict[tuple[str, str], list[float]] = {pair: [] for pair in pairs}
    for turn in range(turns + 1):   # turn 0 warms up: the first steps allocate
        for i in range(steps):
            shift = (turn * steps + i) % len(pairs)
            for model, kind in pairs[shift:] + pairs[:shift]:
                seconds = benches[model].step(kind, i)
                if turn:
                    times[model, kind].append(seconds)
    out: dict = {m: {k: KINDS[k] / statistics.median(times[m, k]) for k in KINDS} for m in benches}
    out["paired"] = {
        "moe_b1_over_dense_b1": statistics.median(d / m for m, d in zip(times["moe", "b1"], times["dense", "b1"])),
        "moe_b32_over_moe_b1": statistics.median(32 * a / b for a, b in zip(times["moe", "b1"], times["moe", "b32"])),
        "dense_b32_over_dense_b1": statistics.median(32 * a / b for a, b in zip(times["dense", "b1"],
                                                                               times["dense", "b32"]))}
    out["step_ms"] = {f"{m} {k}": [round(1e3 * t, 2) for t in v] for (m, k), v in times.items()}
    return out


def report(results: dict, load: tuple) -> None:
    print(f"{'dtype':<9}{'model':<7}{'b1 tok/s':>10}{'b32 tok/s':>11}{'b32/b1':>8}{'MoE b1/dense b1':>17}")
    for dtype, r in results.items():
        paired = r["paired"]
        for model in ("moe", "dense"):
            m = r[model]
            ratio = f"{paired['moe_b1_over_dense_b1']:>17.2f}" if model == "moe" else ""
            print(f"{dtype:<9}{model:<7}{m['b1']:>10.1f}{m['b32']:>11.1f}"
                  f"{paired[f'{model}_b32_over_{model}_b1']:>8.2f}{ratio}")
    print("tok/s: batch / median step; ratios: medians of the step-by-step ratios. Goals: MoE b1 >= 0.8x dense b1; "
          f"MoE b32 >= 2x MoE b1. Load average before {load[0]:.1f}, after {load[1]:.1f} (1 min; other processes "
          f"share these {os.cpu_count()} cores)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="int4_wo,int8_wo")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--root", type=Path, default=ROOT / ".cache" / "bench_moe")
    a = ap.parse_args()
    results = {}
    load_before = os.getloadavg()[0]
    for dtype in a.dtypes.split(","):
        paths = {model: engine(a.root, model, a.layers, dtype) for model in ("moe", "dense")}
        results[dtype] = measure(paths, a.threads, a.steps, a.turns)
    load = (load_before, os.getloadavg()[0])
    report(results, load)
    RESULTS.write_text(json.dumps({
        "machine": platform.processor() or platform.machine(), "cores": os.cpu_count(), "threads": a.threads,
        "load_average_before_after": load, "layers": a.layers, "steps": a.steps, "turns": a.turns,
        "shape": dict(hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, vocab=VOCAB, experts=EXPERTS,
                      top_k=TOP_K, expert_intermediate=EXPERT_INTER, dense_intermediate=TOP_K * EXPERT_INTER),
        "tokens_per_s": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
