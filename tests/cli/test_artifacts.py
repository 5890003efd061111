"""Engines as CI artifacts, through the CLI: `--json` documents, `--config` files and their precedence, the
manifest that `engine verify` and loading check, and `engine pack` / `engine unpack`.

Commands run in-process (`main()`), with stdout and stderr captured; the tiny Llama keeps each under a few seconds.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli.app import main
from engine.core.errors import EngineError
from engine.plugins import native
from tests.cli.engine_cli import run_with_terminal_stderr
from tests.tiny_models import make_tiny_model

ENGINE = str(Path(sys.executable).with_name("engine"))
LIMITS = {"max_batch_size": 4, "max_input_len": 32, "max_seq_len": 64, "max_num_tokens": 64, "tokens_per_block": 4}


def engine(*args) -> tuple[int, str, str]:
    """Run `engine *args` in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        main([str(a) for a in args])
    return info.value.code, out.getvalue(), err.getvalue()


def json_of(*args) -> dict:
    code, out, err = engine(*args, "--json")
    assert code == 0, err
    doc = json.loads(out)  # exactly one JSON document on stdout
    assert doc["ok"] is True and doc["command"] == args[0]
    return doc


def sha256(path: Path) -> str:
    return "sha256:" + hashlib.sha256(path.read_bytes()).hexdigest()


def flip_byte(path: Path, at: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def edit_text(path: Path, old: str, new: str) -> None:
    """A same-size edit that leaves the file valid (a tampered vocabulary entry): only the manifest can tell."""
    text = path.read_text()
    assert old in text and len(old) == len(new)
    path.write_text(text.replace(old, new, 1))


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("artifacts")
    make_tiny_model("LlamaForCausalLM", root / "hf")
    (root / "build.yaml").write_text("".join(f"{k}: {v}\n" for k, v in LIMITS.items()))
    return root


@pytest.fixture(scope="module")
def ckpt(root) -> tuple[Path, dict]:
    doc = json_of("convert", "--model-dir", root / "hf", "--output-dir", root / "ckpt")
    return root / "ckpt", doc


@pytest.fixture(scope="module")
def built(root, ckpt) -> tuple[Path, dict]:
    doc = json_of("build", "--config", root / "build.yaml", "--checkpoint-dir", ckpt[0], "--output-dir",
                  root / "engine")
    return root / "engine", doc


@pytest.fixture
def copy(built, tmp_path) -> Path:
    """A copy of the built engine a test may damage."""
    return Path(shutil.copytree(built[0], tmp_path / "engine"))


# ---- --json documents ---------------------------------------------------------------------------------------

def test_convert_json_names_the_checkpoint_and_its_digests(root, ckpt):
    ckpt_dir, doc = ckpt
    assert doc["checkpoint_dir"] == str(ckpt_dir) and doc["architecture"] == "LlamaForCausalLM" and doc["tp"] == 1
    assert doc["digest"] == sha256(ckpt_dir / "config.json")
    config = json.loads((ckpt_dir / "config.json").read_text())
    listed = {f["path"]: f for f in config["manifest"]["files"]}
    assert set(listed) == {"rank0.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    for name, entry in listed.items():
        assert "sha256:" + entry["sha256"] == sha256(ckpt_dir / name)
    assert doc["files"] == 4 and doc["bytes"] == sum(f["size"] for f in listed.values())
    # the source digest: the canonical list of the HF directory's files; a file conversion does not read is no part
    files = [{"path": p.name, "sha256": sha256(p)[7:], "size": p.stat().st_size}
             for p in sorted((root / "hf").iterdir())]
    expected = "sha256:" + hashlib.sha256(json.dumps(files, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    assert doc["source_digest"] == config["manifest"]["source_digest"] == expected
    assert config["source"] == {"kind": "hf", "name": "hf"}  # no machine path


def test_build_json_and_config_json_carry_the_manifest_and_the_resolved_flags(ckpt, built):
    engine_dir, doc = built
    assert doc["engine_dir"] == str(engine_dir) and doc["digest"] == sha256(engine_dir / "config.json")
    assert doc["checkpoint_digest"] == ckpt[1]["digest"] and doc["source_digest"] == ckpt[1]["source_digest"]
    assert doc["backend"] == "onnxruntime" and doc["backend_version"] and doc["toolchain_version"]
    assert {k: doc["build"][k] for k in LIMITS} == LIMITS and doc["quantization"]["mode"] is None
    config = json.loads((engine_dir / "config.json").read_text())
    assert config["format_version"] == 2 and config["build_flags"] == doc["build_flags"]
    assert {p.name for p in engine_dir.iterdir()} - {"config.json"} == {f["path"] for f in config["manifest"]["files"]}
    flags = config["build_flags"]
    assert {k: flags[k] for k in LIMITS} == LIMITS and flags["dtype"] == "float32" and flags["backend"] == "onnxruntime"
    assert not {"checkpoint_dir", "output_dir", "config_file", "force", "as_json"} & set(flags)


def test_dry_run_json_is_the_memory_plan(root, ckpt):
    doc = json_of("build", "--config", root / "build.yaml", "--checkpoint-dir", ckpt[0], "--output-dir",
                  root / "never", "--dry-run")
    assert doc["dry_run"] is True and doc["build"]["max_seq_len"] == 64 and doc["memory_plan"]
    assert not (root / "never").exists()


def test_inspect_verify_and_eval_json(root, built):
    engine_dir, build_doc = built
    doc = json_of("inspect", "--engine-dir", engine_dir)
    assert doc["runs_here"] is True and doc["why_not"] is None and doc["digest"] == build_doc["digest"]
    assert doc["config"]["manifest"]["checkpoint_digest"] == build_doc["checkpoint_digest"]
    attention = "engine.QuantRotaryPagedAttention" if native.has_int8_dot() else "engine.RotaryPagedAttention"
    assert doc["op_counts"]["rank0.onnx"][attention] == 2  # the tiny Llama has two layers (float32 tiles: with q|k|v)
    doc = json_of("verify", "--engine-dir", engine_dir)
    assert doc["mismatch"] is None and doc["error"] is None and doc["files"] == build_doc["files"]
    assert doc["digest"] == build_doc["digest"]
    (root / "text.txt").write_text("The quick brown fox jumps over the lazy dog. " * 8)
    doc = json_of("eval", "--engine-dir", engine_dir, "--data", root / "text.txt", "--window", 32)
    assert doc["perplexity"] > 1 and doc["tokens"] > 0 and doc["window"] == 32


# ---- --config -----------------------------------------------------------------------------------------------

def test_command_line_overrides_the_config_file_which_overrides_defaults(root, ckpt, tmp_path):
    cfg = tmp_path / "build.json"
    cfg.write_text(json.dumps({**{k.replace("_", "-"): v for k, v in LIMITS.items()}, "rmsnorm_plugin": "disable"}))
    code, _, err = engine("build", "--config", cfg, "--checkpoint-dir", ckpt[0], "--output-dir", tmp_path / "e",
                          "--max-batch-size", 2, "--rmsnorm-plugin", "enable")
    assert code == 0, err
    config = json.loads((tmp_path / "e" / "config.json").read_text())
    assert config["build"]["max_batch_size"] == 2          # command line over the file
    assert config["build"]["max_seq_len"] == 64            # the file over the default (the model's 128)
    assert config["plugins"]["rmsnorm_plugin"] is True     # command line over the file
    assert config["build"]["opt_level"] == "all"           # the default
    assert config["build_flags"]["max_batch_size"] == 2 and config["build_flags"]["rmsnorm_plugin"] == "enable"


def test_an_engines_config_json_rebuilds_it_byte_for_byte(ckpt, built, tmp_path):
    code, _, err = engine("build", "--config", built[0] / "config.json", "--checkpoint-dir", ckpt[0],
                          "--output-dir", tmp_path / "again")
    assert code == 0, err
    for path in sorted(built[0].iterdir()):
        assert (tmp_path / "again" / path.name).read_bytes() == path.read_bytes(), path.name


@pytest.mark.parametrize("content,needle,status", [
    ("max_batch_size: 4\nmax_bach_size: 2\n", "unknown flags ['max_bach_size']", 2),
    ("- 1\n- 2\n", "must map flag names to values", 2),
    ("max_batch_size: [4\n", "is not valid YAML", 2),
    ("max_batch_size: many\n", "--max-batch-size", 2),  # converted and checked as on the command line
    ("max_seq_len: 100000\n", "--max-seq-len 100000", 2),
])
def test_bad_config_files_are_one_line_errors(ckpt, tmp_path, content, needle, status):
    cfg = tmp_path / "build.yaml"
    cfg.write_text(content)
    code, out, err = engine("build", "--config", cfg, "--checkpoint-dir", ckpt[0], "--output-dir", tmp_path / "e")
    assert code == status and out == ""
    assert len(err.splitlines()) == 1 and needle in err and "Traceback" not in err, err
    assert str(cfg) in err or needle.startswith("--max-seq-len")  # limits are checked after merging, like flags
    assert not (tmp_path / "e").exists()


# ---- the manifest: verify and load ----------------------------------------------------------------------------

@pytest.mark.parametrize("damage,path,problem", [
    (lambda d: flip_byte(d / "rank0.onnx.data"), "rank0.onnx.data", "sha256"),
    (lambda d: edit_text(d / "tokenizer.json", "<|im_end|>", "<|im_enD|>"), "tokenizer.json", "sha256"),  # loads
    (lambda d: (d / "rank0.onnx").write_bytes((d / "rank0.onnx").read_bytes()[:-1]), "rank0.onnx", "size"),
    (lambda d: (d / "generation_config.json").unlink(), "generation_config.json", "missing"),
])
def test_a_damaged_engine_is_named_by_verify_and_refused_at_load(copy, damage, path, problem):
    damage(copy)
    code, out, err = engine("verify", "--engine-dir", copy, "--json")
    assert code == 1
    doc = json.loads(out)
    assert doc["ok"] is False and doc["mismatch"]["path"] == path and problem in doc["mismatch"]["problem"]
    assert len(err.splitlines()) == 1 and path in err
    from engine.runtime import LLM
    with pytest.raises(EngineError, match=f"does not match its manifest: {path}: {problem}"):
        LLM(copy, max_kv_tokens=256)
    code, _, err = engine("run", "--engine-dir", copy, "--input-text", "hi", "--max-output-len", 2)
    assert code == 1 and path in err and "engine verify" in err
    (copy.parent / "text.txt").write_text("Some text to score. " * 4)
    code, _, err = engine("eval", "--engine-dir", copy, "--data", copy.parent / "text.txt", "--window", 16)
    assert code == 1 and path in err


def test_a_stray_file_fails_verify_but_not_loading(copy):
    (copy / "notes.txt").write_text("added by hand")
    code, out, err = engine("verify", "--engine-dir", copy, "--json")
    assert code == 1 and json.loads(out)["mismatch"] == {"path": "notes.txt", "problem": "not in the manifest"}
    from engine.runtime import LLM, SamplingParams
    out = LLM(copy, max_kv_tokens=256).generate(["hi"], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(out[0].token_ids) == 2


def test_an_engine_without_a_manifest_is_refused(copy):
    config = json.loads((copy / "config.json").read_text())
    del config["manifest"]
    (copy / "config.json").write_text(json.dumps(config))
    code, _, err = engine("verify", "--engine-dir", copy)
    assert code == 1 and "config.json: lists no files (no manifest)" in err


def test_verify_checks_the_versions_after_the_files(copy):
    config = json.loads((copy / "config.json").read_text())
    config["backend_version"] = "0.0.1"
    (copy / "config.json").write_text(json.dumps(config))
    code, out, err = engine("verify", "--engine-dir", copy, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["mismatch"] is None and "onnxruntime 0.0.1" in doc["error"]


# ---- pack / unpack ----------------------------------------------------------------------------------------------

def test_pack_unpack_keeps_the_engine_valid(built, tmp_path):
    engine_dir, build_doc = built
    packed = json_of("pack", "--engine-dir", engine_dir, "--output", tmp_path / "e.tar")
    again = json_of("pack", "--engine-dir", engine_dir, "--output", tmp_path / "f.tar")
    assert packed["archive_sha256"] == again["archive_sha256"] == sha256(tmp_path / "e.tar")[7:]
    assert packed["digest"] == build_doc["digest"] and packed["files"] == build_doc["files"]
    doc = json_of("unpack", "--input", tmp_path / "e.tar", "--output-dir", tmp_path / "moved")
    assert doc["digest"] == build_doc["digest"]
    assert json_of("verify", "--engine-dir", tmp_path / "moved")["ok"] is True
    code, _, err = engine("pack", "--engine-dir", engine_dir, "--output", tmp_path / "e.tar")
    assert code == 2 and "--force" in err


# ---- non-interactive ------------------------------------------------------------------------------------------

def test_json_output_in_a_pipe_is_only_the_document(root, tmp_path):
    """In a subprocess with pipes (a CI job): stdout is exactly one JSON document, stderr is empty."""
    r = subprocess.run([ENGINE, "convert", "--model-dir", str(root / "hf"), "--output-dir", str(tmp_path / "c"),
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert json.loads(r.stdout)["digest"] == sha256(tmp_path / "c" / "config.json")
    assert "\x1b" not in r.stdout


def test_no_progress_keeps_the_bar_off_on_a_terminal(root, tmp_path):
    """stderr is a pseudo-terminal, where the bar would show (tests/cli/test_cli.py); --no-progress keeps it off."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE")}
    r, received = run_with_terminal_stderr(
        [ENGINE, "convert", "--model-dir", str(root / "hf"), "--output-dir", str(tmp_path / "c"), "--tp", "2",
         "--no-progress"], env={**env, "TERM": "xterm-256color", "COLUMNS": "120"}, timeout=300)
    assert r.returncode == 0 and r.stdout.startswith("converted")
    assert received == b"", received
