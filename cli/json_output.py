"""Output for scripts and CI: `--json` (one JSON document of results on stdout) and `--no-progress`.

With `--json` a command prints exactly one JSON object on stdout and nothing else there (notes and errors go to
stderr), so `engine build ... --json | jq .digest` works. Every document carries `command` and `ok`; the other
fields are the command's results, documented in docs/ci.md. A failing command exits 1 (2 for a usage error)
after printing its error on stderr; `engine verify` also prints its document (`ok: false`, the mismatch).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from engine.core.serde import to_json

JSON = typer.Option(False, "--json", help="Print one JSON document with the results on stdout (nothing else goes "
                    "to stdout; notes and errors go to stderr).")
NO_PROGRESS = typer.Option(False, "--no-progress", help="Show no progress bar (it is off anyway when stderr is not "
                           "a terminal, e.g. in CI logs).")


def _plain(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def print_json(command: str, results: dict, *, ok: bool = True) -> None:
    """Print {"command": command, "ok": ok, **results} as one JSON document on stdout (dataclasses and paths are
    written as JSON objects and strings)."""
    doc = {"command": command, "ok": ok, **_plain(to_json(results))}
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    sys.stdout.flush()
