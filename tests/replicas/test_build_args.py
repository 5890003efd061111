"""build_app's arguments, as `serve run KEY=VALUE` and Serve config files give them, become the same configs as
`engine serve --ray`'s flags; a bad one is refused before anything is deployed."""
from __future__ import annotations

import pydantic
import pytest

from engine.core.errors import EngineError

pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'engine[ray]'")
from engine.runtime.replicas.app import BuildArgs  # noqa: E402


def test_command_line_strings_become_the_configs(tmp_path, monkeypatch):
    monkeypatch.delenv("ENGINE_API_KEY", raising=False)
    replica, cluster = BuildArgs.model_validate({"engine_dir": str(tmp_path / "smollm2"), "replicas": "2",
                                                 "threads": "8", "max_kv_tokens": "4096"}).configs()
    assert replica.server.served_model_name == "smollm2" and replica.server.api_key is None
    assert (replica.engine.threads, replica.engine.max_kv_tokens) == (8, 4096)
    assert (cluster.replicas, cluster.routing, cluster.autoscaling) == (2, "prefix", False)


def test_the_api_key_comes_from_the_environment_when_not_an_argument(tmp_path, monkeypatch):
    monkeypatch.setenv("ENGINE_API_KEY", "from-a-secret")
    replica, _ = BuildArgs.model_validate({"engine_dir": str(tmp_path)}).configs()
    assert replica.server.api_key == "from-a-secret"


def test_bad_arguments_are_refused(tmp_path):
    with pytest.raises(pydantic.ValidationError, match="replica"):
        BuildArgs.model_validate({"engine_dir": str(tmp_path), "replica": 2})     # a misspelt name
    with pytest.raises(EngineError, match="--min-replicas"):
        BuildArgs.model_validate({"engine_dir": str(tmp_path), "min_replicas": 1}).configs()
