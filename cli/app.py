"""The Typer app, the global options (--version, --verbose) and the error boundary.

Exit status: 0 ok, 1 failure (bad input files, a full disk, a failed build), 2 usage error (a bad flag value).
"""
from __future__ import annotations

import errno
import sys
import traceback
from dataclasses import dataclass
from importlib.metadata import version

import click
import typer
from rich.console import Console
from rich.markup import escape

from engine.core.errors import EngineError

from . import bench, build, convert, inspect
from . import eval as eval_
from . import config_file, pack, run
from . import serve
from . import verify

# typer >= 0.29 vendors click (its ClickException derives from typer.TyperException); older typer uses click's.
_CLICK_ERRORS = (click.ClickException, getattr(typer, "TyperException", click.ClickException))

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
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print the full traceback of errors (give it before "
                                 "the command: engine --verbose convert ...)."),
    _: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
):
    ctx.obj.verbose = verbose


app.command("convert", no_args_is_help=True)(convert.convert_command)
app.command("build", no_args_is_help=True)(build.build_command)
app.command("inspect", no_args_is_help=True)(inspect.inspect_command)
app.command("verify", no_args_is_help=True)(verify.verify_command)
app.command("pack", no_args_is_help=True)(pack.pack_command)
app.command("unpack", no_args_is_help=True)(pack.unpack_command)
app.command("run", no_args_is_help=True)(run.run_command)
app.command("eval", no_args_is_help=True)(eval_.eval_command)
app.command("serve", no_args_is_help=True)(serve.serve_command)
app.command("bench", no_args_is_help=True)(bench.bench_command)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI on `argv` (default sys.argv[1:]) and exit: 0 ok, 1 failure, 2 usage error, 130 interrupted."""
    session = Session()
    try:
        rc = app(args=argv, prog_name="engine", standalone_mode=False, obj=session)
    except EngineError as e:
        if session.verbose:
            traceback.print_exc()
        _print_error(str(e))
        sys.exit(e.exit_code)
    except _CLICK_ERRORS as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `engine` or `engine convert` alone: show the help
            e.show()
        else:  # a bad command line (unknown option, a value of the wrong type): one line, like EngineError
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            _print_error(e.format_message() + config_file.origin(e) + hint)
        sys.exit(e.exit_code)
    except (typer.Abort, KeyboardInterrupt):
        _print_error("interrupted")
        sys.exit(130)
    except (OSError, MemoryError) as e:  # the machine, not the input: a full disk outside an output directory
        if session.verbose:
            traceback.print_exc()
        _print_error(_environment_error(e))
        sys.exit(1)
    rc = rc if isinstance(rc, int) else 0
    if rc == 130:  # typer turns Ctrl-C inside a command into exit status 130, after the command cleaned up
        _print_error("interrupted")
    sys.exit(rc)


def _environment_error(e: BaseException) -> str:
    """One line for an OSError or MemoryError that reached the boundary (outputs word their own, see
    core/artifacts.atomic_output_dir): a disk full while a library wrote its temporary or cache files, no
    usable temporary directory (Python's tempfile tries each and fails on a full disk), memory exhausted."""
    if isinstance(e, MemoryError):
        return "out of memory; free memory, or use a smaller model, batch or KV cache (--kv-cache-mem-fraction)"
    where = f" ({e.filename})" if getattr(e, "filename", None) else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"no space left on the disk: {e.strerror}{where}; free disk space (or set TMPDIR to a disk with room)"
    if "No usable temporary directory" in str(e):
        return f"{e.strerror or e}: no temporary directory can be written (a full disk?); free disk space or set " \
               "TMPDIR to a writable directory"
    return f"{e.strerror or e}{where}; run with --verbose for the traceback"


def _print_error(message: str) -> None:
    """One line on stderr; markup in the message (paths with [brackets]) is printed literally."""
    one_line = " ".join(message.split())
    Console(stderr=True, highlight=False, soft_wrap=True).print(f"[bold red]error:[/] {escape(one_line)}")
