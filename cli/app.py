"""The Typer app, the global options (--version, --verbose) and the error boundary.

Exit status: 0 ok, 1 failure (bad input files, a full disk, a failed build), 2 usage error (a bad flag value).
"""
from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from importlib.metadata import version

import click
import typer
from rich.console import Console

from engine.core.errors import EngineError

from . import convert

app = typer.Typer(
    name="engine",
    help="Compile LLM checkpoints into optimized inference engines and run them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    context_settings={"help_option_names": ["-h", "--help"]},
)


@dataclass
class Session:
    verbose: bool = False


def _version(value: bool):
    if value:
        typer.echo(f"engine {version('engine')}")
        raise typer.Exit()


@app.callback()
def _global(
    ctx: typer.Context,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print the full traceback of errors."),
    _: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
):
    ctx.obj.verbose = verbose


app.command("convert", no_args_is_help=True)(convert.convert_command)


def main() -> None:
    session = Session()
    err = Console(stderr=True, highlight=False)
    try:
        app(standalone_mode=False, obj=session)
    except EngineError as e:
        if session.verbose:
            traceback.print_exc()
        err.print(f"[bold red]error:[/] {e}", markup=True, soft_wrap=True)
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        err.print("aborted")
        sys.exit(130)
