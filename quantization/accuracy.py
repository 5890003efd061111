"""The accuracy report of a quantized build and its gate: the quantized engine against its unquantized reference,
teacher-forced on the same tokens, as llama.cpp's `perplexity --kl-divergence` compares two models.

    held-out tokens:  --eval-data FILE (tokenized with the checkpoint's tokenizer, first eval_tokens tokens,
                      windows of `window`), or, with no file, sequences the reference engine samples from its
                      own distribution (seeded, temperature 1), so a build never needs a download
    chat:             for a model with a chat template, CHAT_PROMPTS rendered with it and answered by the reference
                      (greedy, CHAT_ANSWER_TOKENS tokens): the text an instruct model really sees; only the answers'
                      tokens are scored
    report:           {"data", "tokens", "windows", "window", "reference_ppl", "quantized_ppl",
                       "ppl_increase_pct", "top1_agreement", "mean_kl", "chat": {the same for the conversations}},
                      written to config.json's quantization.accuracy. top1_agreement: the share of scored tokens
                      where both engines' most likely next token is the same (on the greedy answers: where the
                      quantized engine predicts the reference's next token); mean_kl: KL(reference || quantized) of
                      the next-token distributions, nats per token
    gate:             --max-ppl-increase PCT fails the build when ppl_increase_pct exceeds it

Self-sampled text is what the reference model finds typical, so its perplexity is low and the increase
measures how far the quantized model drifts from the reference's own distribution; a file of real text
measures the usual thing. Both are relative measurements of one engine against another.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import math
import tempfile

import numpy as np

from engine.core.errors import EngineError
from engine.runtime.engine_dir import load_engine_config
from engine.runtime.perplexity import ScoringSession, sample_tokens, split_windows, token_nll

# conversations a chat model is scored on (general and code, as a coding assistant is asked)
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain in two sentences what a hash table is.",
    "How do I reverse a list in JavaScript?",
    "Give me three tips for writing clear commit messages.",
    "What does the SQL keyword JOIN do?",
    "Write a bash command that counts the lines of every .py file in a directory.",
    "Why is the sky blue?",
)
CHAT_ANSWER_TOKENS = 96
ROWS_AT_ONCE = 32


@dataclass(frozen=True)
class AccuracyOptions:
    eval_data: Path | None = None          # text file; None: sampled by the reference engine
    max_ppl_increase: float | None = None  # percent; None: report only
    eval_tokens: int = 2048                # held-out tokens scored (at most); 0: no report
    window: int = 256                      # tokens per scored window (each a fresh sequence)
    seed: int = 0                          # of the sampled held-out text

    def __post_init__(self):
        if self.eval_tokens == 1 or self.eval_tokens < 0:
            raise EngineError(f"--eval-tokens {self.eval_tokens} must be 0 (no accuracy report) or at least 2",
                              usage=True)
        if self.eval_tokens == 0 and self.max_ppl_increase is not None:
            raise EngineError("--max-ppl-increase needs the accuracy report: drop --eval-tokens 0", usage=True)
        if self.max_ppl_increase is not None and self.max_ppl_increase < 0:
            raise EngineError(f"--max-ppl-increase {self.max_ppl_increase} must not be negative", usage=True)


@dataclass(frozen=True)
class HeldOut:
    windows: list[list[int]]   # token ids to score, each window a fresh sequence
    source: str                # where they came from, for the report


def held_out_windows(opts: AccuracyOptions, reference_dir: Path, tokenizer_dir: Path,
                     start_token: int | None) -> HeldOut:
    """The windows of token ids to score and where they came from."""
    from engine.runtime.perplexity import max_window
    window = min(opts.window, max_window(reference_dir))
    if opts.eval_data is not None:
        ids = read_text_tokens(Path(opts.eval_data), tokenizer_dir)[:opts.eval_tokens]
        return HeldOut(split_windows(ids, window), f"file {opts.eval_data}")
    build = load_engine_config(reference_dir).build
    sequences = max(1, min(-(-opts.eval_tokens // window), build.max_batch_size))
    windows = sample_tokens(reference_dir, sequences=sequences, length=window, seed=opts.seed,
                            start_token=start_token if start_token is not None else 0)
    return HeldOut(windows, f"sampled from the reference engine (seed {opts.seed}, temperature 1)")


def read_text_tokens(path: Path, tokenizer_dir: Path) -> list[int]:
    from engine.runtime.tokenizer import Tokenizer
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EngineError(f"cannot read evaluation text {path}: {e}; pass a UTF-8 text file") from None
    ids = Tokenizer(tokenizer_dir).encode(text)
    if len(ids) < 2:
        raise EngineError(f"evaluation text {path} has {len(ids)} tokens; it needs at least 2")
    return ids


def chat_windows(reference_dir: Path, tokenizer_dir: Path,
                 eos: tuple[int, ...] = ()) -> tuple[list[list[int]], list[int]] | None:
    """CHAT_PROMPTS under the model's chat template with the reference's greedy answers (up to CHAT_ANSWER_TOKENS,
    ending at an `eos` token): (each conversation's ids, where its answer starts); None without a chat template."""
    from engine.runtime.perplexity import max_window
    from engine.runtime.session import EngineSession
    from engine.runtime.step_inputs import SeqChunk
    from engine.runtime.tokenizer import Tokenizer
    tokenizer = Tokenizer(tokenizer_dir)
    if tokenizer.chat_template is None:
        return None
    limit = min(max_window(reference_dir), 2 * CHAT_ANSWER_TOKENS)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    seqs = [list(ids) for ids in prompts if len(ids) + 2 <= limit]
    if not seqs:
        return None
    starts = [len(ids) for ids in seqs]
    tpb = load_engine_config(reference_dir).build.tokens_per_block
    per_seq = -(-limit // tpb)
    session = EngineSession(reference_dir, num_blocks=len(seqs) * per_seq)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(seqs))]

    def advance(chunks: list[SeqChunk]) -> list[SeqChunk]:
        """One step: each chunk's sequence gains its greedy next token; the decodes of those that go on."""
        going = []
        for chunk, row in zip(chunks, session.run(chunks)):
            i = tables.index(chunk.block_table)
            seqs[i].append(int(row.argmax()))
            if seqs[i][-1] not in eos and len(seqs[i]) - starts[i] < CHAT_ANSWER_TOKENS and len(seqs[i]) < limit:
                going.append(SeqChunk([seqs[i][-1]], len(seqs[i]) - 1, tables[i], True))
        return going

    # each prompt's prefill a step of its own (a step holds at most max_num_tokens), then the decodes together
    live = [c for i in range(len(seqs)) for c in advance([SeqChunk(list(seqs[i]), 0, tables[i], True)])]
    while live:
        live = advance(live)
    return seqs, starts


def compare(reference_dir: Path, quantized_dir: Path, windows: list[list[int]],
            starts: list[int] | None = None) -> dict:
    """Both engines teacher-forced over `windows` (each a fresh sequence), scoring the predictions of tokens
    starts[i].. of window i (default: every token after the first): perplexities, top-1 agreement, mean KL.
    The engines score in turn, so a build holds one of them at a time; the reference's logits of the scored rows
    wait in a temporary file meanwhile (page cache, not the process's memory: 0.6 MB a token at 151936 words)."""
    starts = starts or [1] * len(windows)
    length = max(len(w) for w in windows)
    # the positions predicting the scored tokens of each window
    scored = [(w, slice(max(start, 1) - 1, len(w) - 1)) for w, start in zip(windows, starts)]
    scored = [(w, rows) for w, rows in scored if rows.start < rows.stop]
    if not scored:
        raise EngineError("no text to score: the accuracy report needs windows of 2 or more tokens")
    nll, agree, kl, count = np.zeros(2), 0, 0.0, 0
    with tempfile.TemporaryFile() as spill:
        session = ScoringSession(reference_dir, length)
        for w, rows in scored:
            spill.write(np.ascontiguousarray(session.logits(w)[rows], dtype=np.float32).tobytes())
        del session
        spill.seek(0)
        session = ScoringSession(quantized_dir, length)
        for w, rows in scored:
            quant = session.logits(w)[rows]
            ref = np.frombuffer(spill.read(quant.size * 4), dtype=np.float32).reshape(quant.shape)
            targets = w[rows.start + 1:rows.stop + 1]
            for i in range(0, len(targets), ROWS_AT_ONCE):   # float64 temporaries of a few rows, not a window's
                r, q, t = (x[i:i + ROWS_AT_ONCE] for x in (ref, quant, targets))
                nll += [float(token_nll(r, t).sum()), float(token_nll(q, t).sum())]
                agree += int((r.argmax(-1) == q.argmax(-1)).sum())
                kl += float(_kl_rows(r, q).sum())
            count += len(targets)
    reference_ppl, quantized_ppl = (math.exp(x / count) for x in nll)
    return {"tokens": count, "windows": len(windows), "window": length,
            "reference_ppl": round(reference_ppl, 4), "quantized_ppl": round(quantized_ppl, 4),
            "ppl_increase_pct": round(100.0 * (quantized_ppl / reference_ppl - 1.0), 3),
            "top1_agreement": round(agree / count, 4), "mean_kl": round(kl / count, 6)}


def _kl_rows(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row, in float64 nats."""
    def log_softmax(x):
        x = np.asarray(x, dtype=np.float64)
        x = x - x.max(axis=-1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    return (np.exp(lp) * (lp - lq)).sum(axis=-1)


def accuracy_report(reference_dir: Path, quantized_dir: Path, held_out: HeldOut,
                    chat: tuple[list[list[int]], list[int]] | None = None) -> dict:
    """The report (module docstring) over the held-out text, and over the conversations `chat` (chat_windows)."""
    report = {"data": held_out.source, **compare(reference_dir, quantized_dir, held_out.windows)}
    if chat is not None:
        report["chat"] = {"data": f"{len(chat[0])} conversations answered by the reference (greedy, up to "
                                  f"{CHAT_ANSWER_TOKENS} tokens), their answers scored",
                          **compare(reference_dir, quantized_dir, *chat)}
    return report


def check_gate(report: dict, opts: AccuracyOptions, mode: str) -> None:
    """Fail the build when the perplexity increase exceeds --max-ppl-increase."""
    if opts.max_ppl_increase is None:
        return
    if report["ppl_increase_pct"] > opts.max_ppl_increase:
        raise EngineError(f"{mode} raises perplexity by {report['ppl_increase_pct']:.2f}% "
                          f"({report['reference_ppl']:.3f} -> {report['quantized_ppl']:.3f} on {report['data']}), "
                          f"over --max-ppl-increase {opts.max_ppl_increase}%; use a smaller --group-size, "
                          "int8_wo, or raise the limit. No engine was written")
