"""`engine serve`'s flags for several engines (cli/serve_models.py): how models are named, and the combinations
refused as one-line usage errors before any engine loads."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.cli.serve_models import model_specs
from engine.core.errors import EngineError
from engine.runtime.server.config import ModelSpec, ServerConfig
from tests.cli.engine_cli import assert_one_line_error, engine_cmd


def _engines(root: Path, *names: str) -> Path:
    for n in names:
        (root / n).mkdir(parents=True)
        (root / n / "config.json").write_text("{}")
    return root


def test_models_are_named_by_name_eq_path_or_their_directory(tmp_path):
    _engines(tmp_path / "models", "b-model", "a-model")
    (tmp_path / "models" / "notes").mkdir()                  # no config.json: not an engine
    specs = model_specs(["smol=/e/smol", "/e/qwen-int4"], tmp_path / "models", None)
    assert [(s.name, s.engine_dir) for s in specs] == [
        ("smol", Path("/e/smol")), ("qwen-int4", Path("/e/qwen-int4")),
        ("a-model", tmp_path / "models" / "a-model"), ("b-model", tmp_path / "models" / "b-model")]
    assert model_specs(["/e/x"], None, "tiny") == [ModelSpec("tiny", Path("/e/x"))]


@pytest.mark.parametrize("engine_dirs, models_dir, name, needle", [
    (None, None, None, "give the engine to serve with --engine-dir"),
    (["/e/a", "/e/b"], None, "tiny", "with several, name each with --engine-dir NAME=PATH"),
    (None, "missing", None, "is not a directory"),
    (None, "empty", None, "holds no engine"),
])
def test_bad_model_flags_are_usage_errors(tmp_path, engine_dirs, models_dir, name, needle):
    (tmp_path / "empty").mkdir()
    with pytest.raises(EngineError, match=needle) as e:
        model_specs(engine_dirs, tmp_path / models_dir if models_dir else None, name)
    assert e.value.usage


@pytest.mark.parametrize("config, needle", [
    (dict(extra_models=(ModelSpec("m", Path("b")),)), "model name 'm' is given to two engines"),
    (dict(pinned=("x",)), "--pin 'x' is not a served model; served: m"),
    (dict(extra_models=(ModelSpec("n", Path("b")),), pinned=("m", "n"), models_max=1), "--models-max 1 must be"),
    (dict(unload_idle_s=0), "--unload-idle-seconds 0 must be > 0"),
    (dict(extra_models=(ModelSpec("n", Path("b")),), state_dir=Path("s")), "--state-dir resumes the requests of one"),
])
def test_bad_model_settings_are_refused(config, needle):
    with pytest.raises(EngineError, match=needle):
        ServerConfig(engine_dir=Path("a"), served_model_name="m", **config)


@pytest.mark.parametrize("args, needle", [
    (["--engine-dir", "b=elsewhere", "--ray"], "--ray serves one engine; 2 were given (engine, b)"),
    (["--engine-dir", "b=elsewhere", "--speculative", "draft", "--draft-engine-dir", "d"],
     "--draft-engine-dir drafts for one engine"),
    (["--engine-dir", "b=elsewhere", "--served-model-name", "x"], "--served-model-name names a server's only"),
])
def test_the_cli_refuses_several_engines_where_one_is_served(tmp_path, args, needle):
    assert_one_line_error(engine_cmd("serve", tmp_path / "engine", *args, check_rc=2), needle)
