"""Rich progress bars that step aside when output is not an interactive terminal.

A live bar redraws its line with cursor-control codes; in a CI log or a file those arrive as garbage. Rich
honours FORCE_COLOR / TTY_COMPATIBLE (set by many CI setups to get colours) by pretending the stream is a
terminal, so the bar asks the stream itself, and stays off for TERM=dumb.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def _interactive(console: Console) -> bool:
    stream = console.file
    return console.is_terminal and not console.is_dumb_terminal and hasattr(stream, "isatty") and stream.isatty()


@contextlib.contextmanager
def progress_bar(description: str, total: int, *, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """Yield a callback that advances the bar by one step and shows the item's name; the bar vanishes at the end.
    `enabled=False` (--no-progress, --json) keeps it off even on a terminal."""
    console = Console(file=sys.stderr)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[item]}", style="dim", markup=False), console=console, transient=True,
                  disable=not (enabled and _interactive(console))) as bar:
        task = bar.add_task(description, total=total, item="")
        yield lambda item: bar.update(task, advance=1, item=item)
