"""Rich progress bars that step aside when output is not a terminal."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


@contextlib.contextmanager
def progress_bar(description: str, total: int) -> Iterator[Callable[[str], None]]:
    """Yield a callback that advances the bar by one step and shows the item's name."""
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("[dim]{task.fields[item]}"), console=console, transient=True,
                  disable=not console.is_terminal) as bar:
        task = bar.add_task(description, total=total, item="")
        yield lambda item: bar.update(task, advance=1, item=item)
