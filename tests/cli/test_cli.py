"""The CLI's contract: help and version, one-line errors with exit status 1 (bad files, full disk) or 2 (bad flag
values), tracebacks only with --verbose, no progress-bar garbage outside a terminal, and the success line.

Most cases run `main()` in-process (fast); the ones about the process itself (a full disk through RLIMIT_FSIZE,
what a pipe or a pseudo-terminal receives) run the installed `engine` script in a subprocess.
"""
from __future__ import annotations

import os
import re
import resource
import shutil
import signal
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest
import typer

from engine.cli.app import COMMANDS, main, make_app
from tests.cli.engine_cli import run_with_terminal_stderr
from tests.tiny_models import make_tiny_model

ENGINE = str(Path(sys.executable).with_name("engine"))
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_model("LlamaForCausalLM", tmp_path_factory.mktemp("tiny") / "llama")


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `engine *args` in-process; return (exit status, stdout, stderr)."""
    with pytest.raises(SystemExit) as info:
        main(list(args))
    out, err = capsys.readouterr()
    return info.value.code, out, err


def assert_one_line_error(err: str, *needles: str) -> str:
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def no_output(out: Path) -> bool:
    return not out.exists() and not any(p.name.startswith(f".{out.name}.") for p in out.parent.iterdir())


def plain_env(**extra: str) -> dict:
    """The environment of a CI job: no terminal, no forced colours."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE",
                                                            "NO_COLOR", "COLUMNS", "LINES")}
    env.update(TERM="xterm-256color", **extra)
    return env


# ---- help and version ---------------------------------------------------------------------------------------

def test_version(capsys):
    code, out, err = cli(capsys, "--version")
    assert code == 0 and out.strip() == f"engine {version('engine')}" and err == ""


def test_help_lists_the_commands(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = cli(capsys, "--help")
    assert code == 0
    assert "Usage: engine" in out and "convert" in out and "--verbose" in out and "--version" in out


def _option_blocks(help_text: str) -> dict[str, str]:
    """'--tp' -> the text of its row in click's options list: a row starts two spaces in with the option column
    (flags and metavar, e.g. "-v, --verbose" or "--prefix-caching / --no-prefix-caching"); its help follows,
    indented further."""
    blocks: dict[str, str] = {}
    current: list[str] = []
    for line in help_text.splitlines():
        if re.match(r"^  -", line):
            column = line[2:].split("  ")[0]
            current = re.findall(r"(?<![\w<-])(--?[A-Za-z][\w-]*)", column)
            for flag in current:
                blocks[flag] = ""
        elif not line.startswith("   "):
            current = []
        for flag in current:
            blocks[flag] += " " + line.strip()
    return blocks


def test_help_at_80_columns_shows_every_flag_whole(capsys, monkeypatch):
    """A CI log is 80 columns wide: every command's --help names each of its flags in full (from the click
    command's own options, so a flag cut to "--repetition-pe..." fails), and no line is wider."""
    monkeypatch.setenv("COLUMNS", "80")
    group = typer.main.get_command(make_app(COMMANDS))
    checked = 0
    for words, command in [((), group), *(((name,), group.commands[name]) for name in COMMANDS)]:
        code, out, _ = cli(capsys, *words, "--help")
        assert code == 0
        blocks = _option_blocks(out)
        for param in command.params:
            if param.param_type_name == "option":
                for flag in (*param.opts, *param.secondary_opts):
                    assert flag in blocks, (words, flag, out)
                    checked += 1
        assert max(map(len, out.splitlines())) <= 80, out
    assert checked > 100  # the flags were found on the commands, not skipped


def test_convert_help_shows_every_flag_with_its_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = cli(capsys, "convert", "--help")
    assert code == 0
    blocks = _option_blocks(out)
    expected = {"--model-dir": "(none)", "--gguf": "(none)", "--tp": "1", "--pp": "1", "--dtype": "auto",
                "--force": "(off)"}
    for flag, default in expected.items():
        assert f"[default: {default}]" in blocks[flag], (flag, blocks.get(flag))
    assert "[required]" in blocks["--output-dir"]
    assert "float32, float16, bfloat16" in blocks["--dtype"]


# ---- errors -------------------------------------------------------------------------------------------------

def test_bad_file_is_one_line_exit_1(tiny, tmp_path, capsys):
    model = Path(shutil.copytree(tiny, tmp_path / "model"))
    (model / "config.json").write_text("{broken")
    code, out, err = cli(capsys, "convert", "--model-dir", str(model), "--output-dir", str(tmp_path / "out"))
    assert code == 1 and out == ""
    assert_one_line_error(err, "config.json is not valid JSON")
    assert no_output(tmp_path / "out")


def test_verbose_adds_the_traceback(tiny, tmp_path, capsys):
    model = Path(shutil.copytree(tiny, tmp_path / "model"))
    (model / "model.safetensors").unlink()
    code, _, err = cli(capsys, "--verbose", "convert", "--model-dir", str(model), "--output-dir", str(tmp_path / "o"))
    assert code == 1
    assert "Traceback (most recent call last)" in err and "EngineError" in err
    assert err.splitlines()[-1].startswith("error: no weights in")


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler for the test, whatever this process inherited: a shell's background job starts
    with SIGINT ignored, and Python then installs no handler (nor does the CLI: cli/app.py _invoke)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("interrupted", [True, False])
def test_error_an_extension_makes_of_ctrl_c_is_the_interruption(capsys, monkeypatch, python_sigint, interrupted):
    """torch, building the tensor safetensors' get_tensor returns, turns a KeyboardInterrupt raised inside it into
    "ValueError: could not determine the shape ..." (CI saw it in test_interrupt_leaves_nothing); after a Ctrl-C
    that error is reported as the interruption (130, one line), and without one it stays a crash (a traceback)."""
    import typer

    from engine.cli import app as cli_app

    fake = typer.Typer()
    fake.callback()(lambda: None)

    @fake.command("convert")
    def swallowing_extension():
        try:
            if interrupted:
                os.kill(os.getpid(), signal.SIGINT)  # Python runs the handler before the next bytecode
            raise ValueError("nothing interrupted this")
        except KeyboardInterrupt:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'") from None

    monkeypatch.setattr(cli_app, "make_app", lambda names: fake)
    if not interrupted:
        with pytest.raises(ValueError, match="nothing interrupted this"):
            main(["convert"])
        return
    code, out, err = cli(capsys, "convert")
    assert code == 130 and out == ""
    assert assert_one_line_error(err) == "error: interrupted"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_message_with_brackets_is_printed_literally(tiny, tmp_path, capsys):
    # rich markup must not eat "[bold]" in a path
    model = Path(shutil.copytree(tiny, tmp_path / "[bold]model"))
    (model / "config.json").unlink()
    code, _, err = cli(capsys, "convert", "--model-dir", str(model), "--output-dir", str(tmp_path / "out"))
    assert code == 1
    assert_one_line_error(err, "[bold]model has no config.json")


@pytest.mark.parametrize("args, needles", [
    (["--tp", "3"], ["--tp 3", "1, 2, 4"]),
    (["--tp", "0"], ["--tp 0 must be at least 1"]),
    (["--dtype", "int7"], ["'int7'", "float32, float16, bfloat16"]),
    (["--pp", "2"], ["--pp 2", "not supported"]),
    (["--tp", "two"], ["'--tp'", "engine convert --help"]),
    (["--gguf", "model.gguf"], ["exactly one of --model-dir DIR or --gguf FILE", "both"]),
    (["--bogus"], ["No such option: --bogus"]),
])
def test_bad_flag_values_are_one_line_exit_2(tiny, tmp_path, capsys, args, needles):
    out_dir = tmp_path / "out"
    code, out, err = cli(capsys, "convert", "--model-dir", str(tiny), "--output-dir", str(out_dir), *args)
    assert code == 2 and out == ""
    assert_one_line_error(err, *needles)
    assert no_output(out_dir)


def test_neither_model_dir_nor_gguf(tmp_path, capsys):
    code, _, err = cli(capsys, "convert", "--output-dir", str(tmp_path / "out"))
    assert code == 2
    assert_one_line_error(err, "exactly one of --model-dir DIR or --gguf FILE", "neither")


def test_flag_values_are_checked_before_the_files(tmp_path, capsys):
    code, _, err = cli(capsys, "convert", "--model-dir", str(tmp_path / "nowhere"), "--output-dir",
                       str(tmp_path / "out"), "--dtype", "int7")
    assert code == 2
    assert_one_line_error(err, "'int7'")


def test_existing_output_needs_force(tiny, tmp_path, capsys):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, _, err = cli(capsys, "convert", "--model-dir", str(tiny), "--output-dir", str(out_dir))
    assert code == 2
    assert_one_line_error(err, "already exists; pass --force")
    code, out, err = cli(capsys, "convert", "--model-dir", str(tiny), "--output-dir", str(out_dir), "--force")
    assert code == 0 and (out_dir / "rank0.safetensors").is_file()
    assert out.startswith("converted LlamaForCausalLM")


def _limit_file_size(limit: int):
    def preexec():
        # EFBIG from write() instead of the process being killed by SIGXFSZ, as a full disk gives ENOSPC
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_full_disk_is_a_clear_error_and_leaves_nothing(tiny, tmp_path):
    """RLIMIT_FSIZE makes writes past 100 kB fail (EFBIG) the way a full disk fails them (ENOSPC); it works as
    root and needs no mount. The rank file (~350 kB) cannot be written; config.json (~1 kB) could."""
    out_dir = tmp_path / "out"
    r = subprocess.run([ENGINE, "convert", "--model-dir", str(tiny), "--output-dir", str(out_dir)],
                       capture_output=True, text=True, env=plain_env(), preexec_fn=_limit_file_size(100_000),
                       timeout=120)
    assert r.returncode == 1, r.stderr
    assert r.stdout == ""
    assert_one_line_error(r.stderr, "no space left while writing", str(out_dir), "nothing was written")
    assert no_output(out_dir)


# ---- output outside and inside a terminal -------------------------------------------------------------------

SUCCESS = re.compile(r"^converted LlamaForCausalLM \(2 layers, hidden 64, vocab 512\) to (\S+) — dtype float32, "
                     r"tp 2$")


@pytest.mark.parametrize("force_color", [False, True])
def test_piped_output_is_one_clean_line(tiny, tmp_path, force_color):
    """In CI (stdout and stderr are pipes, maybe FORCE_COLOR=1 for colours) the live progress bar must stay off:
    its redraws would land in the log as cursor-control garbage."""
    out_dir = tmp_path / "out"
    env = plain_env(**({"FORCE_COLOR": "1"} if force_color else {}))
    r = subprocess.run([ENGINE, "convert", "--model-dir", str(tiny), "--output-dir", str(out_dir), "--tp", "2"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    stdout = ANSI.sub("", r.stdout) if force_color else r.stdout
    assert stdout.endswith("\n") and stdout.count("\n") == 1, repr(r.stdout)
    m = SUCCESS.match(stdout.rstrip("\n"))
    assert m and m.group(1) == str(out_dir), repr(stdout)
    if not force_color:
        assert "\x1b" not in r.stdout and "\r" not in r.stdout


def test_terminal_shows_the_progress_bar_then_the_success_line(tiny, tmp_path):
    out_dir = tmp_path / "out"
    r, received = run_with_terminal_stderr(
        [ENGINE, "convert", "--model-dir", str(tiny), "--output-dir", str(out_dir), "--tp", "2"],
        env=plain_env(COLUMNS="120"), timeout=120)
    assert r.returncode == 0
    assert SUCCESS.match(r.stdout.rstrip("\n")), repr(r.stdout)  # the bar went to the terminal, not stdout
    terminal = received.decode(errors="replace")
    assert "converting" in terminal and "/" in terminal, repr(terminal)  # "converting ━━━ 12/24 ..."
