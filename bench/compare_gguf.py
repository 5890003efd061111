"""The side-by-side benchmark on a real-size model (`python -m bench.compare --model qwen2.5-coder-0.5b` or
`qwen2.5-coder-1.5b`): the engine on the GGUF file itself against llama.cpp on the same file and onnxruntime-genai
on the file's dequantized weights, all taking turns in one run.

    system           what runs                                                  from
    engine-gguf      engine convert --gguf FILE; engine build --dtype gguf      the file's blocks, kept exactly
    engine-int4      the same checkpoint; engine build --dtype int4_wo          the engine's own 4-bit grid
    llamacpp-<file>  llama-cpp-python on FILE                                   the file
    ortgenai-int4    python -m onnxruntime_genai.models.builder -e cpu -p int4  the HF dir transformers makes of FILE
    bandwidth        the 2 GiB torch sum probe                                  (each round's floor)

Steps, in order (names for --only / --skip, comma-separated globs; a system --skip names is left out of the turns,
and a model the turns need is made even when --only leaves out its make- step):
    bandwidth        the probe once, read and copy, in a process of its own (the row SmolLM2's report has too)
    make-<system>    the system's model made, or found in the cache (bench/compare_models.py); a failure is a row
                     and drops that system from the turns
    alternating      --rounds rounds; in each, every system measures once, in the order above: each a worker
                     process of its own (bench/compare_measure.py), all loaded and warm side by side, one warm-up
                     run each before the first round (compare_runner.Runner.turns)

Each turn is b=1: prefill of the prompt, then --new-tokens (128) greedy single-token steps, --threads (2) threads.
The prompt: the first --prompt-len (512) tokens of bench/anchors/prompt.txt (the text of SmolLM2's
bench/prompt_ids.json) under the GGUF's own tokenizer, the tokenizer.json `engine convert` writes, saved to
CACHE/prompt_ids.json. The report (bench/compare_gguf_report.py) takes each system's median over the rounds and the
ratios round by round; the engine's floor is the bytes its decode step streams (engine_streamed_bytes) over the
bandwidth the probe measured in the same round.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import onnx

from bench import compare_models as models
from bench import real_models
from bench.compare_machine import installed
from bench.compare_runner import Runner

ANCHOR_TEXT = Path(__file__).resolve().parent / "anchors" / "prompt.txt"
PROMPT_NOTE = "the first tokens of bench/anchors/prompt.txt under the GGUF's tokenizer: CACHE/prompt_ids.json"
PROMPT_TOKENS = 512


def steps(r: Runner, args: argparse.Namespace, cache: Path) -> None:
    gguf = real_models.gguf(args.model)
    build_opts = {"rebuild": args.rebuild, "keep": args.keep_engines}
    r.prompt_ids = prompt_ids(models.ensure_ckpt(cache, gguf, **build_opts), cache / "prompt_ids.json")
    r.step("bandwidth", "memory bandwidth", f"2 GiB torch sum / copy, {args.threads} threads",
           lambda: r.worker("bandwidth", r.spec()))

    sides: dict[str, tuple[str, dict, str, str]] = {}   # name -> (worker kind, spec, system, weights)
    needed = r.wanted("alternating")
    for variant in models.GGUF_VARIANTS:
        engine_dir = made(r, f"engine-{variant}", needed,
                          lambda v=variant: models.ensure_engine(cache, gguf, v, **build_opts))
        if engine_dir:
            sides[f"engine-{variant}"] = ("engine", r.spec(engine_dir=str(engine_dir)), "engine (session step)",
                                          models.GGUF_VARIANTS[variant][1])
    llama = installed("llama_cpp")
    name = f"llamacpp-{gguf.stem}"
    if not llama:
        r.step(name, "llama.cpp", gguf.name, None, missing=models.NO_LLAMA)
    elif not r.skipped(name):
        sides[name] = ("llamacpp", r.spec(gguf=str(gguf)), f"llama.cpp (llama-cpp-python {llama})", gguf.name)
    og, no_tf = installed("onnxruntime_genai"), "" if installed("transformers") else "transformers is not installed"
    if not og or no_tf:
        r.step("ortgenai-int4", "onnxruntime-genai", "int4", None,
               missing=no_tf or "onnxruntime-genai is not installed (pip install -e '.[bench]')")
    else:
        hf_dir = lambda: real_models.hf_dir(args.model, Path(args.cache_dir).resolve())   # noqa: E731
        genai_dir = made(r, "ortgenai-int4", needed, lambda: models.ensure_ortgenai(cache, hf_dir, "int4", og))
        if genai_dir:
            sides["ortgenai-int4"] = ("ortgenai", r.spec(model_dir=str(genai_dir)), f"onnxruntime-genai {og}",
                                      "int4 (MatMulNBits) of the dequantized weights, its model builder -e cpu")
    if not r.skipped("bandwidth"):
        sides["bandwidth"] = ("bandwidth", r.spec(), "memory bandwidth", f"2 GiB torch sum, {args.threads} threads")
    r.step("alternating", "every system, alternating processes", f"{', '.join(sides)}; {args.rounds} rounds",
           lambda: alternating(r, sides))


def made(r: Runner, name: str, needed: bool, make) -> Path | None:
    """make() -> the model of system `name`, as step make-<name> (its time recorded); None when --skip names the
    system or its model could not be made. Where the step does not run (a resumed run has it, or --only leaves it
    out) the model is made, or found in the cache, only when `needed`."""
    if r.skipped(name):
        return None
    rec = r.step(f"make-{name}", "model", name, lambda: {"path": models.relative(make())})
    if rec is not None:
        return make() if rec["status"] == "ok" else None
    return make() if needed else None


def alternating(r: Runner, sides: dict[str, tuple[str, dict, str, str]]) -> dict:
    if len(sides) < 2:
        raise RuntimeError(f"only {', '.join(sides) or 'no system'} could run: nothing to take turns with")
    turns = r.turns({name: (kind, spec) for name, (kind, spec, _, _) in sides.items()})
    systems = {name: {"system": system, "variant": weights, "turns": turns[name]}
               for name, (_, _, system, weights) in sides.items()}
    for name, (kind, spec, _, _) in sides.items():
        if kind == "engine":
            systems[name]["streamed_bytes"] = engine_streamed_bytes(
                Path(spec["engine_dir"]), spec["prompt_len"] + spec["new_tokens"] // 2)
    return {"sides": list(sides), "systems": systems}


def prompt_ids(ckpt: Path, out: Path) -> Path:
    """The first PROMPT_TOKENS ids of the anchors' prompt text under the checkpoint's tokenizer, written to `out`
    in the format of bench/prompt_ids.json ({"ids": [...]}, plus how they were made)."""
    from tokenizers import Tokenizer
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode(ANCHOR_TEXT.read_text(),
                                                                    add_special_tokens=False).ids
    if len(ids) < PROMPT_TOKENS:
        raise SystemExit(f"{ANCHOR_TEXT} is only {len(ids)} tokens under {ckpt}'s tokenizer, not {PROMPT_TOKENS}")
    out.write_text(json.dumps({"ids": ids[:PROMPT_TOKENS], "made": f"the first {PROMPT_TOKENS} tokens of "
                               f"bench/anchors/prompt.txt, tokenizers' encode without special tokens, under "
                               f"{models.relative(ckpt / 'tokenizer.json')}"}) + "\n")
    return out


def engine_streamed_bytes(engine_dir: Path, context: int) -> dict:
    """The bytes one decode step of the engine reads from memory: every initializer except those it only gathers
    rows of (the embedding table read by (Quant)Gather, the rotary tables indexed by position), plus the KV cache
    at `context` tokens (the config's kv_bytes_per_token)."""
    weights = gathered = 0
    config = json.loads((engine_dir / "config.json").read_text())
    for path in sorted(engine_dir.glob("rank0*.onnx")):
        graph = onnx.load(str(path), load_external_data=False).graph
        uses: dict[str, set[tuple[str, int]]] = {}
        for node in graph.node:
            for i, x in enumerate(node.input):
                uses.setdefault(x, set()).add((node.op_type, i))
        for t in graph.initializer:
            ext = {e.key: e.value for e in t.external_data}
            size = int(ext["length"]) if "length" in ext else len(t.raw_data)
            only_gathered = uses.get(t.name) and all(op.endswith("Gather") and i == 0 for op, i in uses[t.name])
            if only_gathered or t.name.startswith("rotary."):
                gathered += size
            else:
                weights += size
    kv = config["memory"]["kv_bytes_per_token"] * context
    return {"weights": weights, "kv": kv, "total": weights + kv, "gathered_not_streamed": gathered,
            "kv_context": context}
