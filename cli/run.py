"""`engine run`: generate text from prompts with an engine directory (TensorRT-LLM's run.py, on our runtime).

All prompts run together under continuous batching. Generated text goes to stdout; warnings, errors and the
summary table (prompt / generated tokens, time to first token, decode tokens per second) go to stderr, so
stdout can be piped.

Scheduling: continuous batching under a per-step token budget (--max-num-tokens) with chunked prefill; prefix
caching on by default (--no-prefix-caching); --scheduling-policy priority with --priority per prompt.

--streaming prints text as it is produced, whole UTF-8 characters only. With several prompts (which decode in
lockstep, so token-by-token interleaving would be unreadable) each prompt's text is streamed line by line: a line
is printed as "[i] line" as soon as prompt i completes it, and its last line when it finishes.
"""
from __future__ import annotations

import json
import logging
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from engine.core.errors import EngineError

from . import options
from .distributed import distributed_from_env, serve_rank_if_worker

ENGINE_DIR = typer.Option(..., "--engine-dir", help="Engine directory made by `engine build` (required).")
INPUT_TEXT = typer.Option(None, "--input-text", help="A prompt; repeat the flag for several prompts, which run "
                          "together (default: none).")
INPUT_FILE = typer.Option(None, "--input-file", help="Prompts from a file: a .json list of strings (or of token-id "
                          "lists), else one prompt per line, blank lines skipped (default: none).")
MAX_OUTPUT_LEN = typer.Option(..., "--max-output-len", help="Maximum new tokens per prompt (required; clipped to "
                              "max_seq_len - prompt tokens with a warning).")
TEMPERATURE = typer.Option(0.0, "--temperature", help="Sampling temperature (default 0 = greedy; top-k / top-p / "
                           "min-p apply only above 0).")
TOP_K = typer.Option(0, "--top-k", help="Keep the k most likely tokens (default 0 = off).")
TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling probability mass, in (0, 1] (default 1.0 = off).")
MIN_P = typer.Option(0.0, "--min-p", help="Drop tokens below min-p times the top probability, in [0, 1] (default "
                     "0.0 = off).")
REPETITION_PENALTY = typer.Option(1.0, "--repetition-penalty", help="Divide the logits of tokens of the prompt and "
                                  "output by this, > 0 (default 1.0 = off).")
PRESENCE_PENALTY = typer.Option(0.0, "--presence-penalty", help="Subtract from the logits of generated tokens, in "
                                "[-2, 2] (default 0.0 = off).")
FREQUENCY_PENALTY = typer.Option(0.0, "--frequency-penalty", help="Subtract per occurrence among generated tokens, "
                                 "in [-2, 2] (default 0.0 = off).")
SEED = typer.Option(None, "--seed", help="Random seed of every prompt's sampler (default: none, nondeterministic).")
STOP = typer.Option(None, "--stop", help="Stop string; repeatable; the output is cut before it (default: none).")
END_ID = typer.Option(None, "--end-id", help="Token id that ends generation, instead of the engine's eos ids "
                      "(default: the engine's eos ids).")
STREAMING = typer.Option(False, "--streaming", help="Print text as it is produced, whole characters only (default: "
                         "off); several prompts: line by line, tagged [i].")
CHAT = typer.Option(False, "--chat", help="Send each prompt as one user message through the engine's chat template "
                    "(default: off).")
OUTPUT_JSON = typer.Option(None, "--output-json", help="Also write the results to this JSON file (default: none).")
KV_CACHE_MEMORY_BYTES = typer.Option(None, "--kv-cache-memory-bytes", help="KV cache size in bytes, e.g. 536870912, "
                                     "512MiB or 2GB; overrides --kv-cache-mem-fraction (default: none).")
SCHEDULING_POLICY = typer.Option("fcfs", "--scheduling-policy", help="fcfs (arrival order) or priority (lower "
                                 "--priority first, ties by arrival) (default: fcfs).")
PRIORITY = typer.Option(None, "--priority", help="Priority of the prompts, lower runs first: once for all prompts "
                        "or once per prompt, in order; needs --scheduling-policy priority (default: 0).")
JSON_SCHEMA = typer.Option(None, "--json-schema", help="Constrain every output to JSON valid under the JSON schema "
                           "in this file (default: none).")
REGEX = typer.Option(None, "--regex", help="Constrain every output to match this regular expression (default: none).")
CHOICE = typer.Option(None, "--choice", help="Constrain every output to one of these strings; repeat the flag for "
                      "each choice (default: none).")
GRAMMAR = typer.Option(None, "--grammar", help="Constrain every output to this Lark or GBNF grammar file (default: "
                       "none).")
LORA = typer.Option(None, "--lora", help="Run every prompt with this LoRA adapter (a PEFT directory), on an engine "
                    "built with --lora-target-modules (default: none).")


@dataclass(frozen=True)
class RunFlags:
    """`engine run`'s flags as given, not yet checked."""
    engine_dir: Path
    input_text: Optional[list[str]]
    input_file: Optional[Path]
    max_output_len: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    seed: Optional[int]
    stop: Optional[list[str]]
    end_id: Optional[int]
    streaming: bool
    chat: bool
    output_json: Optional[Path]
    kv_cache_mem_fraction: float
    max_kv_tokens: Optional[int]
    threads: Optional[int]
    tp_timeout: float
    kv_cache_memory_bytes: Optional[str]
    max_num_tokens: Optional[int]
    max_batch_size: Optional[int]
    prefix_caching: bool
    scheduling_policy: str
    priority: Optional[list[int]]
    speculative: Optional[str]
    num_speculative_tokens: Optional[int]
    draft_engine_dir: Optional[Path]
    prompt_lookup_min: Optional[int]
    prompt_lookup_max: Optional[int]
    json_schema: Optional[Path]
    regex: Optional[str]
    choice: Optional[list[str]]
    grammar: Optional[Path]
    lora: Optional[Path]


def run_command(
    engine_dir: Path = ENGINE_DIR,
    input_text: Optional[list[str]] = INPUT_TEXT,
    input_file: Optional[Path] = INPUT_FILE,
    max_output_len: int = MAX_OUTPUT_LEN,
    temperature: float = TEMPERATURE,
    top_k: int = TOP_K,
    top_p: float = TOP_P,
    min_p: float = MIN_P,
    repetition_penalty: float = REPETITION_PENALTY,
    presence_penalty: float = PRESENCE_PENALTY,
    frequency_penalty: float = FREQUENCY_PENALTY,
    seed: Optional[int] = SEED,
    stop: Optional[list[str]] = STOP,
    end_id: Optional[int] = END_ID,
    streaming: bool = STREAMING,
    chat: bool = CHAT,
    output_json: Optional[Path] = OUTPUT_JSON,
    kv_cache_mem_fraction: float = options.KV_CACHE_MEM_FRACTION,
    max_kv_tokens: Optional[int] = options.MAX_KV_TOKENS,
    threads: Optional[int] = options.THREADS,
    tp_timeout: float = options.TP_TIMEOUT,
    kv_cache_memory_bytes: Optional[str] = KV_CACHE_MEMORY_BYTES,
    max_num_tokens: Optional[int] = options.MAX_NUM_TOKENS,
    max_batch_size: Optional[int] = options.MAX_BATCH_SIZE,
    prefix_caching: bool = options.PREFIX_CACHING,
    scheduling_policy: str = SCHEDULING_POLICY,
    priority: Optional[list[int]] = PRIORITY,
    speculative: Optional[str] = options.SPECULATIVE,
    num_speculative_tokens: Optional[int] = options.NUM_SPECULATIVE_TOKENS,
    draft_engine_dir: Optional[Path] = options.DRAFT_ENGINE_DIR,
    prompt_lookup_min: Optional[int] = options.PROMPT_LOOKUP_MIN,
    prompt_lookup_max: Optional[int] = options.PROMPT_LOOKUP_MAX,
    json_schema: Optional[Path] = JSON_SCHEMA,
    regex: Optional[str] = REGEX,
    choice: Optional[list[str]] = CHOICE,
    grammar: Optional[Path] = GRAMMAR,
    lora: Optional[Path] = LORA,
):
    """Generate from prompts with an engine: several prompts run together, with a summary of speeds."""
    flags = RunFlags(**locals())  # first: the parameters are all there is in locals()
    prompts = _read_prompts(flags.input_text, flags.input_file)
    priorities = _check_flags(flags, len(prompts))
    params = _sampling_params(flags)
    distributed = distributed_from_env(flags.tp_timeout)
    if serve_rank_if_worker(flags.engine_dir, distributed, flags.threads):  # torchrun-style rank > 0: no output
        return
    err = Console(stderr=True, highlight=False)
    _log_warnings_to(err)
    llm = _load(flags, distributed, len(prompts))
    start = time.monotonic()
    results = _generate(llm, flags, prompts, params, priorities)
    wall = time.monotonic() - start
    if not flags.streaming:
        for i, (p, out) in enumerate(zip(prompts, results)):
            print(f"Input [Text {i}]: {json.dumps(p, ensure_ascii=False)}")
            print(f"Output [Text {i}]: {json.dumps(out.text, ensure_ascii=False)}")
    sys.stdout.flush()
    err.print(_summary(results, wall, llm.kv_plan, llm.stats()))
    if flags.output_json is not None:
        _write_json(flags.output_json, prompts, results)


def _check_flags(flags: RunFlags, num_prompts: int) -> list[int]:
    """Refuse bad values; returns each prompt's priority."""
    if flags.max_output_len < 1:
        raise EngineError(f"--max-output-len {flags.max_output_len} must be >= 1", usage=True)
    if flags.threads is not None and flags.threads < 1:
        raise EngineError(f"--threads {flags.threads} must be >= 1", usage=True)
    priorities = list(flags.priority or [0])
    if len(priorities) == 1:
        priorities *= num_prompts
    if len(priorities) != num_prompts:
        raise EngineError(f"{len(priorities)} --priority values for {num_prompts} prompts; give one for all, or "
                          "one per prompt", usage=True)
    if any(priorities) and flags.scheduling_policy != "priority":
        raise EngineError(f"--priority {next(p for p in priorities if p)} needs --scheduling-policy priority "
                          f"(under {flags.scheduling_policy} every request runs in arrival order)", usage=True)
    return priorities


def _sampling_params(flags: RunFlags):
    from engine.runtime import SamplingParams

    return SamplingParams(
        temperature=flags.temperature, top_k=flags.top_k, top_p=flags.top_p, min_p=flags.min_p,
        repetition_penalty=flags.repetition_penalty, presence_penalty=flags.presence_penalty,
        frequency_penalty=flags.frequency_penalty, seed=flags.seed, max_tokens=flags.max_output_len,
        stop=tuple(flags.stop or ()), stop_token_ids=() if flags.end_id is None else (flags.end_id,),
        ignore_eos=flags.end_id is not None, structured_outputs=_structured_outputs(flags))


def _structured_outputs(flags: RunFlags) -> dict | None:
    """The output constraint of --json-schema / --regex / --choice / --grammar (at most one)."""
    given = {f"--{k.replace('_', '-')}": v for k, v in (("json_schema", flags.json_schema), ("regex", flags.regex),
                                                      ("choice", flags.choice), ("grammar", flags.grammar)) if v}
    if len(given) > 1:
        raise EngineError(f"{' and '.join(given)} each constrain the output; give only one", usage=True)
    if flags.json_schema is not None:
        return {"json": _read_text(flags.json_schema, "--json-schema")}
    if flags.grammar is not None:
        return {"grammar": _read_text(flags.grammar, "--grammar")}
    if flags.regex is not None:
        return {"regex": flags.regex}
    return {"choice": flags.choice} if flags.choice else None


def _read_text(path: Path, flag: str) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise EngineError(f"{flag} {path}: cannot read it ({e.strerror or e}); give a readable text file",
                          usage=True) from None


def _load(flags: RunFlags, distributed, num_prompts: int):
    from engine.runtime import LLM
    from engine.runtime.lora.adapter import adapter_rank

    # the prompts are all the sequences this run has: a pool for more of them would only take memory
    return LLM(flags.engine_dir, kv_cache_mem_fraction=flags.kv_cache_mem_fraction, max_sequences=num_prompts,
               max_kv_tokens=flags.max_kv_tokens, threads=flags.threads,
               kv_cache_memory_bytes=_parse_bytes(flags.kv_cache_memory_bytes),
               enable_prefix_caching=flags.prefix_caching, scheduling_policy=flags.scheduling_policy,
               max_num_tokens=flags.max_num_tokens, max_batch_size=flags.max_batch_size, distributed=distributed,
               speculative_config=options.speculative_config(flags.speculative, flags.num_speculative_tokens,
                                                             flags.draft_engine_dir, flags.prompt_lookup_min,
                                                             flags.prompt_lookup_max),
               lora_config=None if flags.lora is None else {"max_lora_rank": adapter_rank(flags.lora),
                                                            "modules": {"lora": flags.lora}})


def _generate(llm, flags: RunFlags, prompts: list, params, priorities: list[int]) -> list:
    """Every prompt's final output, in the prompts' order; --streaming prints the text as it comes."""
    inputs = [llm.chat_prompt([{"role": "user", "content": p}]) if flags.chat and isinstance(p, str) else p
              for p in prompts]
    outputs = {}
    printer = _StreamPrinter(tagged=len(prompts) > 1) if flags.streaming else None
    lora = "lora" if flags.lora is not None else None
    for out in llm.stream(inputs, params, request_ids=(order := []), priority=priorities, lora=lora):
        if out.finished:
            outputs[out.request_id] = out
        if printer is not None:
            printer.add(order.index(out.request_id), out.delta_text, out.finished)
    return [outputs[rid] for rid in order]


class _StreamPrinter:
    """Streams deltas to stdout: as they come for one prompt; line by line, tagged "[i] ", for several."""

    def __init__(self, tagged: bool):
        self.tagged = tagged
        self.pending: dict[int, str] = {}

    def add(self, i: int, delta: str, finished: bool) -> None:
        if not self.tagged:
            sys.stdout.write(delta + ("\n" if finished else ""))
        else:
            text = self.pending.pop(i, "") + delta
            *lines, rest = text.split("\n")
            if finished and rest:
                lines.append(rest)
            elif rest:
                self.pending[i] = rest
            for line in lines:
                sys.stdout.write(f"[{i}] {line}\n")
        sys.stdout.flush()


def _read_prompts(input_text: list[str] | None, input_file: Path | None) -> list:
    if bool(input_text) == (input_file is not None):
        raise EngineError("give prompts with --input-text TEXT (repeatable) or --input-file FILE, exactly one of "
                          "them", usage=True)
    if input_text:
        prompts = list(input_text)
    else:
        try:
            raw = input_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise EngineError(f"cannot read --input-file {input_file}: {e}") from None
        if input_file.suffix == ".json":
            try:
                prompts = json.loads(raw)
            except json.JSONDecodeError as e:
                raise EngineError(f"--input-file {input_file} is not valid JSON: {e}") from None
            ok = isinstance(prompts, list) and all(
                isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompts)
            if not ok:
                raise EngineError(f"--input-file {input_file} must hold a JSON list of strings or of token-id lists")
        else:
            prompts = [line for line in raw.splitlines() if line.strip()]
    if not prompts:
        raise EngineError("no prompts given: the input is empty", usage=True)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise EngineError(f"prompt {i} is empty; give at least one character of text", usage=True)
    return prompts


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}


def _parse_bytes(text: str | None) -> int | None:
    """'536870912', '512MiB', '2GB', '1.5GiB' -> bytes."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m and m.group(2).lower()
    if not m or unit not in _UNITS:
        raise EngineError(f"--kv-cache-memory-bytes {text!r} is not a size; give bytes, or a number with B, KB, MB, "
                          "GB, KiB, MiB or GiB (e.g. 512MiB)", usage=True)
    return int(float(m.group(1)) * _UNITS[unit])


def _log_warnings_to(console: Console) -> None:
    class _Handler(logging.Handler):
        def emit(self, record):
            console.print(f"[yellow]warning:[/] {record.getMessage()}", markup=True, soft_wrap=True)
    logger = logging.getLogger("engine.runtime")
    logger.handlers = [_Handler(level=logging.WARNING)]
    logger.propagate = False


def _summary(results, wall: float, kv, stats) -> Table:
    title = (f"{len(results)} prompt(s) in {wall:.2f} s; KV cache {kv.num_tokens} tokens ({kv.num_blocks} blocks "
             f"of {kv.tokens_per_block}, {kv.num_bytes / (1 << 20):.1f} MiB); prefix cache hits "
             f"{stats.prefix_cache_hits} of {stats.prefix_cache_queries} prompt tokens; "
             f"{stats.preemptions} preemption(s)")
    if (sp := stats.speculation) is not None:
        title += (f"; speculation: {sp.num_accepted_tokens} of {sp.num_draft_tokens} proposed tokens accepted, "
                  f"{sp.mean_acceptance_length:.2f} tokens a verified step")
    table = Table(title=title, title_justify="left",
                  caption="TTFT: time to first token (queueing + prefill); decode tok/s: tokens after the first, "
                          "per second", caption_justify="left")
    for col in ("#", "prompt tokens", "generated tokens", "finish", "TTFT (ms)", "decode tok/s"):
        table.add_column(col, justify="right")
    for i, out in enumerate(results):
        ttft, tps = out.time_to_first_token, out.decode_tokens_per_second
        table.add_row(str(i), str(out.num_prompt_tokens), str(out.num_generated_tokens), out.finish_reason or "-",
                      "-" if ttft is None else f"{ttft * 1000:.1f}", "-" if tps is None else f"{tps:.1f}")
    generated = sum(o.num_generated_tokens for o in results)
    table.add_section()
    table.add_row("all", str(sum(o.num_prompt_tokens for o in results)), str(generated), "", "",
                  f"{generated / wall:.1f} (overall)" if wall > 0 else "-")
    return table


def _write_json(path: Path, prompts: list, results) -> None:
    data = [{"prompt": p, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
             "stop_reason": o.stop_reason, "prompt_tokens": o.num_prompt_tokens,
             "generated_tokens": o.num_generated_tokens, "time_to_first_token_s": o.time_to_first_token,
             "decode_tokens_per_s": o.decode_tokens_per_second} for p, o in zip(prompts, results)]
    try:
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    except OSError as e:
        raise EngineError(f"cannot write --output-json {path}: {e.strerror or e}") from None
