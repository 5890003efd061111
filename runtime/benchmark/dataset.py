"""Benchmark datasets: the requests `engine bench` sends, made or read and checked before the engine loads.

synthetic  `num_requests` prompts of exactly `input_len` random token ids (numpy's default_rng(seed), drawn from
           the vocabulary without the tokenizer's bos / eos / pad / unk ids), each asking for `output_len` tokens.
           Ids, not text, so every prompt has exactly the length asked for (text would re-tokenize differently).
FILE       JSON Lines, one request per line (blank lines skipped), trtllm-bench's dataset format included:

               {"prompt": "Explain paged attention.", "output_len": 64}
               {"input_ids": [504, 3458, 282], "output_tokens": 32, "task_id": 7}
               {"prompt": "Hello"}

           exactly one of "prompt" (text, tokenized with the engine's tokenizer, special tokens added as
           `LLM.generate` does) or "input_ids" (token ids, used as they are); optional "output_len" (alias
           "output_tokens", trtllm-bench's name), else the --output-len default; "task_id" is accepted and ignored.
           Any other key is refused, so a misspelt field never silently falls back to a default.

`make_requests` picks one of the two by the --dataset value. Every request runs with ignore_eos, so it produces
exactly its output_len tokens; a request the engine cannot hold whole is refused here, naming the line and the
limit (instead of the runtime clipping it with a warning mid-benchmark).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np

from engine.core.engine_format import BuildConfig, EngineConfig
from engine.core.errors import EngineError

from ..tokenizer import Tokenizer

_KEYS = {"prompt", "input_ids", "output_len", "output_tokens", "task_id"}
DEFAULT_SYNTHETIC_REQUESTS = 16
DEFAULT_INPUT_LEN = 128


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int
    where: str = ""                     # "line 12 of FILE" for a file dataset, for error messages


def make_requests(dataset: str, engine: EngineConfig, tokenizer: Tokenizer, *, output_len: int,
                  num_requests: int | None = None, input_len: int | None = None, seed: int = 0) -> list[BenchRequest]:
    """The requests of `dataset` ("synthetic" or a JSON Lines file), checked against the engine's limits.
    Defaults: synthetic, DEFAULT_SYNTHETIC_REQUESTS requests of DEFAULT_INPUT_LEN tokens; a file, all its lines."""
    for flag, value in (("--num-requests", num_requests), ("--input-len", input_len), ("--output-len", output_len)):
        check_positive(flag, value)
    vocab = engine.model.vocab_size
    if dataset == "synthetic":
        input_len = input_len or DEFAULT_INPUT_LEN
        check_synthetic_fits(input_len, output_len, engine.build)
        special = special_token_ids(tokenizer, engine.generation.eos_token_ids)
        return synthetic_requests(num_requests or DEFAULT_SYNTHETIC_REQUESTS, input_len, output_len,
                                  vocab_size=vocab, exclude_ids=special, seed=seed)
    if input_len is not None:
        raise EngineError(f"--input-len applies to --dataset synthetic only; the prompts of {dataset} have their own "
                          "lengths: leave --input-len out", usage=True)
    requests = read_jsonl_requests(Path(dataset), tokenizer, output_len=output_len, num_requests=num_requests)
    check_requests_fit(requests, engine.build, vocab)
    return requests


def check_positive(flag: str, value: int | None) -> None:
    """EngineError(usage) unless `value` (when given) is an integer >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise EngineError(f"{flag} {value!r} must be an integer >= 1", usage=True)


def special_token_ids(tokenizer: Tokenizer, eos_token_ids: Iterable[int]) -> set[int]:
    """The eos ids and the tokenizer's bos / eos / pad / unk ids: kept out of synthetic prompts."""
    named = (tokenizer.token_to_id(t) for t in tokenizer.special_tokens.values())
    return {int(t) for t in (*eos_token_ids, *named) if t is not None}


def synthetic_requests(num_requests: int, input_len: int, output_len: int, *, vocab_size: int,
                       exclude_ids: Iterable[int] = (), seed: int | tuple[int, ...] = 0) -> list[BenchRequest]:
    """`num_requests` random prompts of `input_len` ids in [0, vocab_size) minus `exclude_ids`, reproducible by
    seed (an int, or a tuple of ints naming an independent stream, as numpy's SeedSequence takes)."""
    for flag, value in (("--num-requests", num_requests), ("--input-len", input_len),
                        ("--output-len", output_len)):
        check_positive(flag, value)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(exclude_ids, dtype=np.int64))
    assert allowed.size, "the vocabulary has ordinary tokens"
    rng = np.random.default_rng(seed)
    ids = rng.choice(allowed, size=(num_requests, input_len))
    return [BenchRequest(tuple(int(t) for t in row), output_len, f"synthetic request {i}")
            for i, row in enumerate(ids)]


def read_jsonl_requests(path: Path, tokenizer: Tokenizer, *, output_len: int,
                        num_requests: int | None = None) -> list[BenchRequest]:
    """The requests of a JSON Lines file (format above): all of them, or the first `num_requests`."""
    check_positive("--output-len", output_len)
    check_positive("--num-requests", num_requests)
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise EngineError(f"cannot read --dataset {path}: {reason}; give a readable JSON Lines file or "
                          "'synthetic'") from None
    requests = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if num_requests is not None and len(requests) == num_requests:
            break
        requests.append(_parse_line(line, f"line {number} of {path}", tokenizer, output_len))
    if not requests:
        raise EngineError(f"--dataset {path} holds no requests; give one JSON object per line")
    if num_requests is not None and len(requests) < num_requests:
        raise EngineError(f"--num-requests {num_requests} is more than the {len(requests)} requests in --dataset "
                          f"{path}; ask for at most {len(requests)} or leave --num-requests out to use them all",
                          usage=True)
    return requests


def _parse_line(line: str, where: str, tokenizer: Tokenizer, default_output_len: int) -> BenchRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise EngineError(f"{where} is not valid JSON ({e.msg} at column {e.colno}); write one JSON object per "
                          "line") from None
    if not isinstance(obj, dict):
        raise EngineError(f"{where} is a JSON {type(obj).__name__}, not an object like "
                          '{"prompt": "...", "output_len": 64}')
    unknown = sorted(set(obj) - _KEYS)
    if unknown:
        raise EngineError(f"{where} has unknown key(s) {unknown}; accepted: {sorted(_KEYS)}")
    if ("prompt" in obj) == ("input_ids" in obj):
        raise EngineError(f'{where} must have exactly one of "prompt" (text) or "input_ids" (token ids)')
    if "output_len" in obj and "output_tokens" in obj:
        raise EngineError(f'{where} has both "output_len" and "output_tokens" (the same field); keep one')
    output_len = obj.get("output_len", obj.get("output_tokens", default_output_len))
    if isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1:
        raise EngineError(f"{where}: output length {output_len!r} must be an integer >= 1")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise EngineError(f'{where}: "prompt" must be a non-empty string')
        ids = tokenizer.encode(obj["prompt"])
    else:
        ids = obj["input_ids"]
        if (not isinstance(ids, list) or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)):
            raise EngineError(f'{where}: "input_ids" must be a non-empty list of token ids (integers >= 0)')
    return BenchRequest(tuple(int(t) for t in ids), output_len, where)


def check_synthetic_fits(input_len: int, output_len: int, build: BuildConfig) -> None:
    """EngineError(usage) naming the engine's limit unless synthetic requests of these lengths fit whole."""
    prompt_limit = min(build.max_input_len, build.max_seq_len - 1)
    if input_len > prompt_limit:
        raise EngineError(f"--input-len {input_len} is more than the engine's prompt limit of {prompt_limit} "
                          f"(max_input_len {build.max_input_len}, max_seq_len {build.max_seq_len}); lower it or "
                          "rebuild with a larger --max-input-len", usage=True)
    if input_len + output_len > build.max_seq_len:
        raise EngineError(f"--input-len {input_len} + --output-len {output_len} = {input_len + output_len} exceeds "
                          f"the engine's max_seq_len {build.max_seq_len}; lower them or rebuild with a larger "
                          "--max-seq-len", usage=True)


def check_requests_fit(requests: list[BenchRequest], build: BuildConfig, vocab_size: int) -> None:
    """EngineError naming the request and the limit unless every request fits the engine whole."""
    prompt_limit = min(build.max_input_len, build.max_seq_len - 1)
    for r in requests:
        n = len(r.prompt_token_ids)
        if n > prompt_limit:
            raise EngineError(f"{r.where}: the prompt has {n} tokens, more than the engine's limit of "
                              f"{prompt_limit} (max_input_len {build.max_input_len}, max_seq_len "
                              f"{build.max_seq_len}); shorten it or rebuild with a larger --max-input-len")
        if n + r.output_len > build.max_seq_len:
            raise EngineError(f"{r.where}: {n} prompt tokens + {r.output_len} output tokens = {n + r.output_len} "
                              f"exceeds the engine's max_seq_len {build.max_seq_len}; lower the lengths or rebuild "
                              "with a larger --max-seq-len")
        bad = next((t for t in r.prompt_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise EngineError(f"{r.where}: token id {bad} is outside the vocabulary [0, {vocab_size})")
