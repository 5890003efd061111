"""The Typer app, the global options (--version, --verbose) and the error boundary.

Exit status: 0 ok, 1 failure (bad input files, a full disk, a failed build), 2 usage error (a bad flag value).

Each command lives in its own module, imported only when it runs: `engine run ...` builds an app holding `run` alone
(the other command modules, with their imports, cost ~0.15 s of a ~1.5 s cold start); `engine`, `engine --help` or
an unknown word build the app with every command, so help and "no such command" stay complete.
"""
from __future__ import annotations

import errno
import importlib
import inspect
import signal
import sys
import threading
import traceback
from dataclasses import dataclass

import click
import typer
from rich.console import Console
from rich.markup import escape

from engine.core import VERSION
from engine.core.errors import EngineError

from . import flags_file

# command name -> (module under engine.cli, function), in the order help lists them
COMMANDS = {
    "download": ("download", "download_command"),
    "convert": ("convert", "convert_command"),
    "build": ("build", "build_command"),
    "inspect": ("inspect", "inspect_command"),
    "verify": ("verify", "verify_command"),
    "pack": ("pack", "pack_command"),
    "unpack": ("pack", "unpack_command"),
    "run": ("run", "run_command"),
    "eval": ("eval", "eval_command"),
    "serve": ("serve", "serve_command"),
    "bench": ("bench", "bench_command"),
}
# typer >= 0.29 vendors click (its ClickException derives from typer.TyperException); older typer uses click's.
_CLICK_ERRORS = (click.ClickException, getattr(typer, "TyperException", click.ClickException))


@dataclass
class Session:
    verbose: bool = False


def _version(value: bool):
    if value:
        typer.echo(f"engine {VERSION}")
        raise typer.Exit()


def _global(
    ctx: typer.Context,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print the full traceback of errors (give it before "
                                 "the command: engine --verbose convert ...)."),
    _: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
):
    ctx.obj.verbose = verbose


def make_app(names) -> typer.Typer:
    """The engine app with the commands `names` (keys of COMMANDS), importing only their modules."""
    app = typer.Typer(
        name="engine",
        help="Compile LLM checkpoints into optimized inference engines and run them.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        # click's plain help, not rich's panels: rich's options table levels its columns to fit the terminal and
        # cuts long flag names ("--weight-only-quant-matmul…") in an 80-column CI log; click wraps only the help text
        rich_markup_mode=None,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(_global)
    for name in names:
        module, function = COMMANDS[name]
        command = getattr(importlib.import_module(f"engine.cli.{module}"), function)
        app.command(name, no_args_is_help=True, short_help=_summary(command))(command)
    return app


def _summary(command) -> str:
    """The first paragraph of a command's docstring, whole: click would cut the listing's line at the terminal's
    width with "..."."""
    return " ".join(inspect.getdoc(command).split("\n\n")[0].split())


def _command_word(argv: list[str]) -> str | None:
    """The command `argv` names: its first word that is not an option (the global options take no value)."""
    return next((a for a in argv if not a.startswith("-")), None)


def _invoke(app: typer.Typer, argv: list[str], session: Session):
    """Run the app; an error that follows a Ctrl-C is the interruption. Some extensions turn the KeyboardInterrupt
    raised inside them into an error of their own (torch, building the tensor safetensors' get_tensor returns,
    reports "ValueError: could not determine the shape of object type 'torch.storage.UntypedStorage'"), which
    would otherwise reach the user as a traceback and exit status 1 instead of "interrupted" and 130."""
    interrupted = False

    def on_sigint(signum, frame):
        nonlocal interrupted
        interrupted = True
        signal.default_int_handler(signum, frame)

    # only over Python's own handler (not over SIG_IGN, which a shell's background job inherits), and only from the
    # main thread, the one that may set handlers
    ours = threading.current_thread() is threading.main_thread() \
        and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, on_sigint)
    try:
        return app(args=argv, prog_name="engine", standalone_mode=False, obj=session)
    except Exception as e:
        if interrupted:
            raise KeyboardInterrupt from e
        raise
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: list[str] | None = None) -> None:
    """Run the CLI on `argv` (default sys.argv[1:]) and exit: 0 ok, 1 failure, 2 usage error, 130 interrupted."""
    session = Session()
    argv = sys.argv[1:] if argv is None else list(argv)
    word = _command_word(argv)
    app = make_app([word] if word in COMMANDS else COMMANDS)
    try:
        rc = _invoke(app, argv, session)
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
            _print_error(e.format_message() + flags_file.origin(e) + hint)
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
