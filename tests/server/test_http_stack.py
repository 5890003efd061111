"""The server's HTTP stack: uvicorn on httptools (with the connection limits of http_limits.py) and uvloop (the
serve and test extras install them), and a warning that names what is missing when it must fall back to h11 and
asyncio's loop."""
from __future__ import annotations

import importlib.util
import logging

from fastapi import FastAPI

from engine.runtime.server.app import uvicorn_config


def test_the_server_runs_on_httptools_and_uvloop():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    config = uvicorn_config(FastAPI(), port=0)
    assert issubclass(config.http, HttpToolsProtocol) and config.loop == "uvloop"   # with http_limits.py's limits
    assert config.h11_max_incomplete_event_size == 64 * 1024 and config.timeout_keep_alive == 5


def test_without_them_it_falls_back_with_a_warning(monkeypatch, caplog):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("httptools", "uvloop") else find_spec(name, *a))
    with caplog.at_level(logging.WARNING, logger="engine.server"):
        config = uvicorn_config(FastAPI(), port=0)
    assert (config.http, config.loop) == ("h11", "asyncio")
    assert "pip install 'engine[serve]'" in caplog.text and "h11" in caplog.text
