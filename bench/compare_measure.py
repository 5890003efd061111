"""One measurement of the side-by-side benchmark, run by bench/compare.py in a fresh process of its own.

    python -m bench.compare_measure KIND --spec '{"threads": 2, "prompt_len": 512, ...}'   (from the repository root)

KIND is engine | engine-api | hf | ortgenai | llamacpp | bandwidth | serve | coldstart-child. The last line of stdout is
one JSON object (the record). Each measurement gets its own process so that no library's thread pool, arena or
import (torch next to onnxruntime) changes another's numbers, and so that a peer that crashes (llama.cpp's AMX
path segfaults on some CPUs) costs one row, not the run.

Methodology (the anchors', bench/anchors, kept identical so the numbers compare with the anchor table): the same
token ids (spec["prompt_ids"]: bench/prompt_ids.json for SmolLM2), greedy, `threads` intra-op threads; prefill =
one forward pass over the whole prompt; decode = `new_tokens` single-token forward passes after it; one warm-up
run, then the median of `repeats` runs.
transformers is timed as the anchors did: prefill = generate(1 token), decode = generate(N + 1) - generate(1).
Each record also carries the process's CPU time over the timed runs divided by their wall time (about `threads`
when nothing else competes for the cores) and its peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

# A run returns (prefill seconds, decode seconds, generated token ids).
Run = Callable[[int], tuple[float, float, list[int]]]


def timed_runs(run: Run, spec: dict) -> dict:
    """Warm up once, then time `repeats` runs; medians, every run, CPU use over the timed runs. With spec["turns"],
    one timed run a turn instead (take_turns), until told to stop."""
    run(min(4, spec["new_tokens"]))

    def timed(repeats: int) -> dict:
        cpu0, wall0 = time.process_time(), time.perf_counter()
        results = [run(spec["new_tokens"]) for _ in range(repeats)]
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        return summarize([r[0] for r in results], [r[1] for r in results], results[-1][2], spec, cpu / wall)

    if spec.get("turns"):
        take_turns(lambda: timed(1))
    return timed(spec["repeats"])


def take_turns(measure: Callable[[], dict]) -> None:
    """The worker side of compare.py's alternating steps: print READY once loaded and warm, then one measurement
    (a TURN line of JSON, with the process's peak RSS so far) for each "go" line on stdin, while the other workers
    wait their turn idle; exit at EOF. Workers loaded side by side and taking turns measure seconds apart, without a
    process start in between."""
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() == "go":
            time.sleep(0.2)   # the peer's ONNX Runtime workers spin on the cores for a while after its turn
            rec = measure()
            from engine.runtime.benchmark.runner import peak_rss_bytes  # after the measurement, as in main()
            rec["peak_rss_MB"] = round(peak_rss_bytes() / 2**20, 1)
            print("TURN " + json.dumps(rec), flush=True)
    sys.exit(0)


def summarize(prefill: list[float], decode: list[float], tokens: list[int], spec: dict, cpu_threads: float) -> dict:
    p, d = statistics.median(prefill), statistics.median(decode)
    return {"prefill_s": round(p, 5), "prefill_tok_s": round(spec["prompt_len"] / p, 1),
            "decode_s": round(d, 5), "decode_tok_s": round(spec["new_tokens"] / d, 2),
            "prefill_runs": [round(x, 5) for x in prefill], "decode_runs": [round(x, 5) for x in decode],
            "first_tokens": [int(t) for t in tokens[:16]], "cpu_threads_used": round(cpu_threads, 2)}


def prompt(spec: dict) -> list[int]:
    with open(spec["prompt_ids"]) as f:
        return json.load(f)["ids"][:spec["prompt_len"]]


def measure_engine(spec: dict) -> dict:
    """The engine's session directly: one run() per step, as the scheduler calls it, greedy argmax."""
    from engine.runtime.engine_dir import load_engine_config
    from engine.runtime.session import EngineSession
    from engine.runtime.step_inputs import SeqChunk
    ids = prompt(spec)
    t0 = time.perf_counter()
    tpb = load_engine_config(spec["engine_dir"]).build.tokens_per_block
    num_blocks = -(-(len(ids) + spec["new_tokens"] + 8) // tpb)   # the pool this one sequence needs
    session = EngineSession(spec["engine_dir"], num_blocks=num_blocks, threads=spec["threads"])
    load_s = time.perf_counter() - t0
    blocks = list(range(num_blocks))

    def run(n_new: int):
        t0 = time.perf_counter()
        tok = int(np.argmax(session.run([SeqChunk(ids, 0, blocks, True)])[0]))
        t1 = time.perf_counter()
        out = [tok]
        for i in range(n_new):
            tok = int(np.argmax(session.run([SeqChunk([tok], len(ids) + i, blocks, True)])[0]))
            out.append(tok)
        return t1 - t0, time.perf_counter() - t1, out

    rec = timed_runs(run, spec)
    rec["load_s"] = round(load_s, 3)
    return rec


def measure_engine_api(spec: dict) -> dict:
    """The Python API (LLM.generate: scheduler, sampler, detokenizer), timed like transformers' generate:
    prefill = a 1-token request, decode = (N + 1)-token request minus that. Prefix caching off, or the
    repeated prompt would be served from the cache."""
    from engine.runtime import LLM, SamplingParams
    ids = prompt(spec)
    llm = LLM(spec["engine_dir"], threads=spec["threads"], enable_prefix_caching=False)

    def gen(n: int):
        t = time.perf_counter()
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
        return time.perf_counter() - t, list(out.token_ids)

    return generate_style(gen, spec)


def generate_style(gen: Callable[[int], tuple[float, list[int]]], spec: dict) -> dict:
    """The anchors' bench_hf.py timing: T(1 new token) is the prefill; decode = T(N + 1) - T(1)."""
    gen(2)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    t1, tn, tokens = [], [], []
    for _ in range(spec["repeats"]):   # alternated, so a change of load hits both alike
        t1.append(gen(1)[0])
        t, tokens = gen(spec["new_tokens"] + 1)
        tn.append(t)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    p = statistics.median(t1)
    if statistics.median(tn) <= p:
        raise RuntimeError(f"generating {spec['new_tokens'] + 1} tokens took no longer than 1 ({tn} vs {t1} s): "
                           "the load changed during the measurement; rerun it")
    rec = summarize(t1, [t - p for t in tn], tokens, spec, cpu / wall)
    rec["decode_runs"] = [round(t - p, 5) for t in tn]
    return rec


def measure_hf(spec: dict) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(spec["threads"])
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[spec["dtype"]]
    model = AutoModelForCausalLM.from_pretrained(spec["hf_dir"], dtype=dtype, attn_implementation="sdpa").eval()
    input_ids = torch.tensor([prompt(spec)])
    mask = torch.ones_like(input_ids)

    def gen(n: int):
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, pad_token_id=2)
        return time.perf_counter() - t, out[0, input_ids.shape[1]:].tolist()

    rec = generate_style(gen, spec)
    rec["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    return rec


def measure_ortgenai(spec: dict) -> dict:
    """onnxruntime-genai's Generator: prefill = append_tokens(prompt); decode = N + 1 generate_next_token()
    calls (the first only samples from the prefill's logits). KV buffer of prompt + N + 2 (share_buffer)."""
    import onnxruntime_genai as og
    cfg = og.Config(spec["model_dir"])
    cfg.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": spec["threads"], "inter_op_num_threads": 1}}}}))
    model = og.Model(cfg)
    ids = np.array([prompt(spec)], dtype=np.int32)
    max_len = ids.shape[1] + spec["new_tokens"] + 2

    def run(n_new: int):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=max_len, min_length=max_len, do_sample=False, batch_size=1)
        g = og.Generator(model, params)
        t0 = time.perf_counter()
        g.append_tokens(ids)
        t1 = time.perf_counter()
        for _ in range(n_new + 1):
            g.generate_next_token()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, [int(x) for x in g.get_sequence(0)[ids.shape[1]:]]

    rec = timed_runs(run, spec)
    rec["versions"] = {"onnxruntime-genai": getattr(og, "__version__", "")}
    return rec


def measure_llamacpp(spec: dict) -> dict:
    """llama-cpp-python: prefill = eval(prompt) after reset (KV cleared); decode = N eval([token]) steps."""
    import llama_cpp
    from llama_cpp import Llama
    llm = Llama(model_path=spec["gguf"], n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=spec["threads"],
                n_threads_batch=spec["threads"], flash_attn=False, verbose=False)
    nv = llm.n_vocab()
    ids = prompt(spec)

    def argmax_last() -> int:
        p = llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1)
        return int(np.ctypeslib.as_array(p, shape=(nv,)).argmax())

    def run(n_new: int):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = argmax_last()
        t1 = time.perf_counter()
        out = [tok]
        for _ in range(n_new):
            llm.eval([tok])
            tok = argmax_last()
            out.append(tok)
        return t1 - t0, time.perf_counter() - t1, out

    rec = timed_runs(run, spec)
    rec["versions"] = {"llama-cpp-python": llama_cpp.__version__,
                       "lib": os.environ.get("LLAMA_CPP_LIB_PATH", "wheel")}
    return rec


def measure_bandwidth(spec: dict) -> dict:
    """Memory bandwidth as the anchors measured it: a 2 GiB torch sum (bytes read) and copy (read + write),
    `threads` threads, median of 5 after one warm-up. The read figure is the one the decode floor uses."""
    import torch
    torch.set_num_threads(spec["threads"])
    n = spec.get("bandwidth_mib", 2048) * 2**20 // 4
    a = torch.ones(n, dtype=torch.float32)

    def med(fn) -> float:
        fn()
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts)

    if spec.get("turns"):
        take_turns(lambda: {"read_GBps": round(n * 4 / med(a.sum) / 1e9, 2)})
    b = torch.empty_like(a)
    read = n * 4 / med(lambda: a.sum()) / 1e9
    copy = 2 * n * 4 / med(lambda: b.copy_(a)) / 1e9
    return {"read_GBps": round(read, 2), "copy_GBps": round(copy, 2), "bytes": n * 4,
            "versions": {"torch": torch.__version__}}


def measure_serve(spec: dict) -> dict:
    """bench/serve_vs_genai.py's serve_pair: `streams` concurrent streams through `engine serve` (a child process)
    against onnxruntime-genai in batches of `genai_batch` (in this one), and the server's memory."""
    from bench.serve_vs_genai import serve_pair
    return serve_pair(Path(spec["engine_dir"]), Path(spec["model_dir"]), streams=spec["streams"],
                      genai_batch=spec["genai_batch"], input_len=spec["input_len"], output_len=spec["output_len"],
                      threads=spec["threads"], rounds=spec["rounds"], stream_interval=spec.get("stream_interval", 1))


def coldstart_child(spec: dict) -> None:
    """Load the engine through the public API and print FIRST the moment the first token is generated. The
    parent times from its spawn of this process to that line, so interpreter start and imports are counted."""
    from engine.runtime import LLM, SamplingParams
    llm = LLM(spec["engine_dir"], threads=spec["threads"])
    for _ in llm.stream(spec["text"], SamplingParams(temperature=0, max_tokens=1)):
        print("FIRST", flush=True)
        break
    sys.stdout.flush()
    os._exit(0)  # the measurement is over; skip interpreter teardown


MEASURES = {"engine": measure_engine, "engine-api": measure_engine_api, "hf": measure_hf,
            "ortgenai": measure_ortgenai, "llamacpp": measure_llamacpp, "bandwidth": measure_bandwidth, "serve": measure_serve}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=[*MEASURES, "coldstart-child"])
    ap.add_argument("--spec", required=True, help="JSON object: threads, prompt_len, new_tokens, repeats, paths")
    a = ap.parse_args()
    spec = json.loads(a.spec)
    if a.kind == "coldstart-child":
        coldstart_child(spec)
        return
    rec = MEASURES[a.kind](spec)
    from engine.runtime.benchmark.runner import peak_rss_bytes  # after the measurement: it imports onnxruntime
    rec["peak_rss_MB"] = round(peak_rss_bytes() / 2**20, 1)
    print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
