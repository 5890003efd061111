"""`engine serve`: an OpenAI-compatible HTTP server for an engine directory (vLLM's `vllm serve` flags).

    engine serve --engine-dir ENGINE --served-model-name smollm2 --port 8000 [--api-key KEY | ENGINE_API_KEY]

Binds 127.0.0.1 unless --host says otherwise. /health answers 200 once the engine is loaded and warmed. SIGTERM
or Ctrl-C stops admission and lets requests in flight finish for up to --shutdown-timeout seconds. The server
itself is runtime/server.py; this module only parses flags, reads ENGINE_API_KEY and configures logging.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from engine.core.errors import EngineError

from . import options


def serve_command(
    engine_dir: Path = typer.Option(..., "--engine-dir", help="Engine directory made by `engine build` (required)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (default 127.0.0.1, this machine "
                             "only; 0.0.0.0 exposes the server to the network)."),
    port: int = typer.Option(8000, "--port", help="TCP port (default 8000; 0 picks a free one)."),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", help="The model name clients "
                                                    "send and /v1/models lists (default: the engine "
                                                    "directory's name)."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="ENGINE_API_KEY", help="Require "
                                          "'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize "
                                          "(default: none; or the ENGINE_API_KEY environment variable)."),
    max_queue: int = typer.Option(256, "--max-queue", help="Sequences that may wait beyond one full batch; more "
                                  "are answered 429 with Retry-After (default 256)."),
    scheduling_policy: str = typer.Option("fcfs", "--scheduling-policy", help="fcfs (default; requests with a "
                                          "nonzero priority are refused) or priority (the request's `priority` "
                                          "field orders the queue, lower first)."),
    shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", help="Seconds requests in flight get to "
                                           "finish after SIGTERM before they are aborted (default 30)."),
    kv_cache_mem_fraction: float = options.KV_CACHE_MEM_FRACTION,
    max_kv_tokens: Optional[int] = options.MAX_KV_TOKENS,
    threads: Optional[int] = options.THREADS,
    log_level: str = typer.Option("info", "--log-level", help="debug, info, warning or error (default info)."),
):
    """Serve an engine over HTTP with the OpenAI API (completions, chat completions, models, metrics)."""
    from engine.runtime import LLM
    from engine.runtime.server import ServerConfig, create_app, run_server

    if not 0 <= port <= 65535:
        raise EngineError(f"--port {port} must be in [0, 65535]", usage=True)
    if threads is not None and threads < 1:
        raise EngineError(f"--threads {threads} must be >= 1", usage=True)
    if log_level not in ("debug", "info", "warning", "error"):
        raise EngineError(f"--log-level {log_level!r} must be debug, info, warning or error", usage=True)
    if api_key is not None and not api_key.strip():
        raise EngineError("--api-key is empty; give a key or leave the flag (and ENGINE_API_KEY) out", usage=True)
    config = ServerConfig(engine_dir=engine_dir, served_model_name=served_model_name or engine_dir.resolve().name,
                          host=host, port=port, api_key=api_key, max_queue=max_queue,
                          scheduling_policy=scheduling_policy, shutdown_timeout=shutdown_timeout)
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app = create_app(config, load=lambda: LLM(engine_dir, kv_cache_mem_fraction=kv_cache_mem_fraction,
                                              max_kv_tokens=max_kv_tokens, threads=threads,
                                              scheduling_policy=scheduling_policy))
    rc = run_server(app, config, log_level=log_level)
    if rc:
        raise EngineError(f"the engine in {engine_dir} failed to load: {app.state.server.load_error}")
    return rc
