"""`engine eval`: perplexity of any engine on a text file (runtime/perplexity.py does the scoring)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from engine.core.errors import EngineError

from .json_output import JSON, print_json


def eval_command(
    engine_dir: Path = typer.Option(..., "--engine-dir", help="Engine directory made by `engine build`."),
    data: Path = typer.Option(..., "--data", help="UTF-8 text file to score."),
    window: Optional[int] = typer.Option(None, "--window", help="Tokens per scored window; each window is a fresh "
                                         "sequence (tokens).", show_default="1024, at most the engine's "
                                         "max_num_tokens and max_seq_len"),
    max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Score at most this many tokens of the file "
                                             "(tokens).", show_default="all"),
    as_json: bool = JSON,
):
    """Report the perplexity of an engine on a text file: exp of the mean negative log-likelihood of every token
    given the tokens before it in its window."""
    import time

    from engine.runtime.perplexity import max_window, perplexity, split_windows
    from engine.runtime.tokenizer import Tokenizer

    if not data.is_file():
        raise EngineError(f"--data {data} is not a file; pass a UTF-8 text file", usage=True)
    longest = max_window(engine_dir)
    window = window if window is not None else min(1024, longest)
    if not 2 <= window <= longest:
        raise EngineError(f"--window {window} must be between 2 and {longest} tokens for this engine", usage=True)
    if max_tokens is not None and max_tokens < 2:
        raise EngineError(f"--max-tokens {max_tokens} must be at least 2", usage=True)
    try:
        text = data.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise EngineError(f"cannot read --data {data}: {e}; pass a UTF-8 text file") from None
    ids = Tokenizer(engine_dir).encode(text)[:max_tokens]
    windows = split_windows(ids, window)
    if not windows:
        raise EngineError(f"--data {data} has {len(ids)} tokens; perplexity needs at least 2")
    start = time.perf_counter()
    result = perplexity(engine_dir, windows)
    seconds = time.perf_counter() - start
    if as_json:
        print_json("eval", {"engine_dir": str(engine_dir), "data": str(data), "perplexity": result.perplexity,
                            "nll": result.nll, "tokens": result.tokens, "windows": result.windows, "window": window,
                            "seconds": round(seconds, 3)})
        return
    Console(highlight=False, soft_wrap=True).print(
        f"perplexity {result.perplexity:.4f} (mean NLL {result.nll:.4f} nats) over {result.tokens} tokens in "
        f"{result.windows} windows of up to {window} tokens, {escape(str(data))} ({seconds:.1f} s)")
