"""The accuracy report of a quantized build and its gate: perplexity of the quantized engine and of its
unquantized reference on the same held-out tokens.

    held-out tokens:  --eval-data FILE (tokenized with the checkpoint's tokenizer, first eval_tokens tokens,
                      windows of `window`), or, with no file, sequences the reference engine samples from its
                      own distribution (seeded, temperature 1), so a build never needs a download
    report:           {"data", "tokens", "windows", "window", "reference_ppl", "quantized_ppl",
                       "ppl_increase_pct"}, written to config.json's quantization.accuracy
    gate:             --max-ppl-increase PCT fails the build when ppl_increase_pct exceeds it
    cost:             sampled text is scored by the reference while it samples it (each token's log-probability
                      under the distribution it was drawn from), so only the quantized engine runs a scoring pass

Self-sampled text is what the reference model finds typical, so its perplexity is low and the increase
measures how far the quantized model drifts from the reference's own distribution; a file of real text
measures the usual thing. Both are relative measurements of one engine against another.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine.core.errors import EngineError
from engine.runtime.perplexity import PerplexityResult, perplexity, sample_scored, split_windows


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
    windows: list[list[int]]                  # token ids to score, each window a fresh sequence
    source: str                               # where they came from, for the report
    reference: PerplexityResult | None = None  # the reference's perplexity over them, when measured while sampling


def held_out_windows(opts: AccuracyOptions, reference_dir: Path, tokenizer_dir: Path,
                     start_token: int | None) -> HeldOut:
    """The windows of token ids to score and where they came from (sampled: with the reference's perplexity)."""
    from engine.runtime.perplexity import max_window
    window = min(opts.window, max_window(reference_dir))
    if opts.eval_data is not None:
        ids = read_text_tokens(Path(opts.eval_data), tokenizer_dir)[:opts.eval_tokens]
        return HeldOut(split_windows(ids, window), f"file {opts.eval_data}")
    from engine.runtime.engine_dir import load_engine_config
    build = load_engine_config(reference_dir).build
    sequences = max(1, min(-(-opts.eval_tokens // window), build.max_batch_size))
    windows, reference = sample_scored(reference_dir, sequences=sequences, length=window, seed=opts.seed,
                                       start_token=start_token if start_token is not None else 0)
    return HeldOut(windows, f"sampled from the reference engine (seed {opts.seed}, temperature 1)", reference)


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


def accuracy_report(reference_dir: Path, quantized_dir: Path, held_out: HeldOut) -> dict:
    windows = held_out.windows
    ref = held_out.reference or perplexity(reference_dir, windows)
    quant = perplexity(quantized_dir, windows)
    return {"data": held_out.source, "tokens": ref.tokens, "windows": ref.windows,
            "window": max(len(w) for w in windows),
            "reference_ppl": round(ref.perplexity, 4), "quantized_ppl": round(quant.perplexity, 4),
            "ppl_increase_pct": round(100.0 * (quant.perplexity / ref.perplexity - 1.0), 3)}


def check_gate(report: dict, opts: AccuracyOptions, mode: str) -> None:
    """Fail the build when the perplexity increase exceeds --max-ppl-increase."""
    if opts.max_ppl_increase is None:
        return
    if report["ppl_increase_pct"] > opts.max_ppl_increase:
        raise EngineError(f"{mode} raises perplexity by {report['ppl_increase_pct']:.2f}% "
                          f"({report['reference_ppl']:.3f} -> {report['quantized_ppl']:.3f} on {report['data']}), "
                          f"over --max-ppl-increase {opts.max_ppl_increase}%; use a smaller --group-size, "
                          "int8_wo, or raise the limit. No engine was written")
