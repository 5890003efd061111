"""`engine serve`: an OpenAI-compatible HTTP server for an engine directory (vLLM's `vllm serve` flags).

    engine serve --engine-dir ENGINE --served-model-name smollm2 --port 8000 [--api-key KEY | ENGINE_API_KEY]

    engine serve --engine-dir ENGINE --ray --replicas 2 [--ray-address auto]   # replicas on Ray Serve (serve_ray.py)

    engine serve --models-dir ENGINES [--models-max 2] [--pin NAME]   # several engines, by `model` (serve_models.py)

    engine serve --engine-dir ENGINE --lora-modules sql=ADAPTER_DIR [--max-loras 4]   # LoRA adapters (serve_lora.py)

Binds 127.0.0.1 unless --host says otherwise. /health answers 200 once the engine is loaded and warmed. SIGTERM
or Ctrl-C stops admission and lets requests in flight finish for up to --shutdown-timeout seconds; with
--state-dir it saves them instead and exits at once, and the next server on that directory resumes them. The server
itself is runtime/server/; this module only parses flags, reads ENGINE_API_KEY and configures logging.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import typer

from engine.core.errors import EngineError

from . import options, serve_lora, serve_models, serve_ray
from .distributed import StopOnRankFailure, distributed_from_env, serve_rank_if_worker

HOST = typer.Option("127.0.0.1", "--host", help="Address to bind (default 127.0.0.1, this machine only; 0.0.0.0 "
                    "exposes the server to the network).")
PORT = typer.Option(8000, "--port", help="TCP port (default 8000; 0 picks a free one).")
SERVED_MODEL_NAME = typer.Option(None, "--served-model-name", help="The model name clients send and /v1/models "
                                 "lists, with one engine (default: the engine directory's name).")
API_KEY = typer.Option(None, "--api-key", envvar="ENGINE_API_KEY", help="Require 'Authorization: Bearer KEY' on "
                       "/v1/*, /tokenize and /detokenize (default: none; or the ENGINE_API_KEY environment "
                       "variable).")
MAX_QUEUE = typer.Option(256, "--max-queue", help="Sequences that may wait beyond one full batch; more are answered "
                         "429 with Retry-After (default 256).")
SCHEDULING_POLICY = typer.Option("fcfs", "--scheduling-policy", help="fcfs (default; requests with a nonzero "
                                 "priority are refused) or priority (the request's `priority` field orders the "
                                 "queue, lower first).")
SHUTDOWN_TIMEOUT = typer.Option(30.0, "--shutdown-timeout", help="Seconds requests in flight get to finish after "
                                "SIGTERM before they are aborted (default 30).")
STATE_DIR = typer.Option(None, "--state-dir", help="Directory for checkpoints of the requests in flight (written "
                         "atomically every --state-checkpoint-interval seconds and on SIGTERM); a server restarted "
                         "on it resumes them and clients reconnect with GET /v1/requests/ID/stream. SIGTERM then "
                         "saves and exits at once instead of draining (default: off).")
STATE_CHECKPOINT_INTERVAL = typer.Option(30.0, "--state-checkpoint-interval", help="Seconds between state "
                                         "checkpoints with --state-dir (default 30).")
STATE_RESULT_TTL = typer.Option(600.0, "--state-result-ttl", help="Seconds a resumed response is kept for its "
                                "client after it finished (default 600).")
MAX_BODY_BYTES = typer.Option(4 * 2**20, "--max-body-bytes", help="Largest request body accepted; larger ones are "
                              "answered 413 (bytes, default 4194304 = 4 MiB).")
MAX_HEADER_BYTES = typer.Option(64 * 1024, "--max-header-bytes", help="Largest request line + headers accepted; "
                                "larger ones are answered 431 and the connection closed (bytes, default 65536).")
HEADER_TIMEOUT = typer.Option(10.0, "--header-timeout", help="Seconds a client has to send a request's headers, "
                              "from its connection or its request's first byte; then 408 and the connection is "
                              "closed (default 10).")
KEEP_ALIVE_TIMEOUT = typer.Option(5.0, "--keep-alive-timeout", help="Seconds an idle keep-alive connection stays "
                                  "open between requests (default 5).")
STREAM_INTERVAL = typer.Option(1, "--stream-interval", help="Tokens per streamed chunk after the first: 1 (default) "
                               "sends every token; N sends every N-th, the chunk holding the N tokens since the "
                               "last (fewer SSE writes with many streams).")
LOG_LEVEL = typer.Option("info", "--log-level", help="debug, info, warning or error (default info).")


def serve_command(
    engine_dir: Optional[list[str]] = serve_models.ENGINE_DIRS,
    models_dir: Optional[Path] = serve_models.MODELS_DIR,
    models_max: Optional[int] = serve_models.MODELS_MAX,
    pin: Optional[list[str]] = serve_models.PIN,
    unload_idle_seconds: Optional[float] = serve_models.UNLOAD_IDLE,
    host: str = HOST,
    port: int = PORT,
    served_model_name: Optional[str] = SERVED_MODEL_NAME,
    api_key: Optional[str] = API_KEY,
    max_queue: int = MAX_QUEUE,
    scheduling_policy: str = SCHEDULING_POLICY,
    shutdown_timeout: float = SHUTDOWN_TIMEOUT,
    state_dir: Optional[Path] = STATE_DIR,
    state_checkpoint_interval: float = STATE_CHECKPOINT_INTERVAL,
    state_result_ttl: float = STATE_RESULT_TTL,
    max_body_bytes: int = MAX_BODY_BYTES,
    max_header_bytes: int = MAX_HEADER_BYTES,
    header_timeout: float = HEADER_TIMEOUT,
    keep_alive_timeout: float = KEEP_ALIVE_TIMEOUT,
    stream_interval: int = STREAM_INTERVAL,
    kv_cache_mem_fraction: float = options.KV_CACHE_MEM_FRACTION,
    max_kv_tokens: Optional[int] = options.MAX_KV_TOKENS,
    threads: Optional[int] = options.THREADS,
    tp_timeout: float = options.TP_TIMEOUT,
    log_level: str = LOG_LEVEL,
    speculative: Optional[str] = options.SPECULATIVE,
    num_speculative_tokens: Optional[int] = options.NUM_SPECULATIVE_TOKENS,
    draft_engine_dir: Optional[Path] = options.DRAFT_ENGINE_DIR,
    prompt_lookup_min: Optional[int] = options.PROMPT_LOOKUP_MIN,
    prompt_lookup_max: Optional[int] = options.PROMPT_LOOKUP_MAX,
    ray: bool = serve_ray.RAY,
    ray_address: Optional[str] = serve_ray.RAY_ADDRESS,
    replicas: Optional[int] = serve_ray.REPLICAS,
    min_replicas: Optional[int] = serve_ray.MIN_REPLICAS,
    max_replicas: Optional[int] = serve_ray.MAX_REPLICAS,
    routing: Optional[str] = serve_ray.ROUTING,
    lora_modules: Optional[list[str]] = serve_lora.LORA_MODULES,
    max_loras: Optional[int] = serve_lora.MAX_LORAS,
    max_lora_rank: int = serve_lora.MAX_LORA_RANK,
    max_cpu_loras: Optional[int] = serve_lora.MAX_CPU_LORAS,
    allow_runtime_lora_updating: bool = serve_lora.ALLOW_UPDATES,
):
    """Serve one engine or several (routed by `model`) over HTTP with the OpenAI API (completions, chat, models,
    metrics)."""
    from engine.runtime.server.app import create_app, run_server
    from engine.runtime.server.config import ServerConfig
    from engine.runtime.server.http_limits import HTTPLimits

    _check_flags(port, stream_interval, threads, log_level, api_key)
    speculation = options.speculative_config(speculative, num_speculative_tokens, draft_engine_dir, prompt_lookup_min,
                                             prompt_lookup_max)
    default, *more = serve_models.model_specs(engine_dir, models_dir, served_model_name)
    config = ServerConfig(engine_dir=default.engine_dir, served_model_name=default.name, extra_models=tuple(more),
                          models_max=models_max, pinned=tuple(pin or ()), unload_idle_s=unload_idle_seconds,
                          host=host, port=port, api_key=api_key, max_queue=max_queue,
                          scheduling_policy=scheduling_policy, shutdown_timeout=shutdown_timeout,
                          max_body_bytes=max_body_bytes,
                          http=HTTPLimits(max_header_bytes, header_timeout, keep_alive_timeout),
                          state_dir=state_dir, state_checkpoint_interval=state_checkpoint_interval,
                          state_result_ttl=state_result_ttl)
    adapters = serve_lora.adapter_table(lora_modules, max_loras, max_lora_rank, max_cpu_loras,
                                        allow_runtime_lora_updating, {m.name: m.engine_dir for m in config.models})
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    ray_flags = serve_ray.RayFlags(ray, ray_address, replicas, min_replicas, max_replicas, routing)
    serve_models.check_one_engine(config.models, ray=ray, speculation=speculation)
    if ray and adapters is not None:
        raise EngineError("LoRA adapters (--lora-modules, --max-loras) are not served through --ray yet; serve them "
                          "without --ray", usage=True)
    if ray:   # Ray is imported on this path only
        return serve_ray.serve_with_ray(config, ray_flags, kv_cache_mem_fraction=kv_cache_mem_fraction,
                                        max_kv_tokens=max_kv_tokens, threads=threads,
                                        stream_interval=stream_interval, speculation=speculation)
    ray_flags.check_unused()
    distributed = distributed_from_env(tp_timeout)
    serve_models.check_one_engine(config.models, distributed=distributed)
    if serve_rank_if_worker(config.engine_dir, distributed, threads):  # torchrun-style rank > 0: rank 0 serves
        return 0
    rank_failure = StopOnRankFailure()
    llm_options = dict(kv_cache_mem_fraction=kv_cache_mem_fraction, max_kv_tokens=max_kv_tokens, threads=threads,
                       scheduling_policy=scheduling_policy, stream_interval=stream_interval, distributed=distributed,
                       speculative_config=speculation)
    load = {m.name: _loader(m.name, m.engine_dir, llm_options, adapters, rank_failure) for m in config.models}
    app = create_app(config, load=load, adapters=adapters)
    rc = run_server(app, config, log_level=log_level)
    if rank_failure.message is not None:
        raise EngineError(rank_failure.message)
    if rc:
        raise EngineError(f"the engine failed to load: {app.state.server.load_error}")
    return rc


def _loader(name: str, engine_dir: Path, llm_options: dict, adapters, rank_failure: StopOnRankFailure):
    """Model `name`'s load(): an LLM of `engine_dir` with the serve flags and its LoRA adapters' settings. Reloads
    keep the first load's Tokenizer: parsing tokenizer.json would stall the other models' streams."""
    from engine.runtime import LLM
    kept = {}

    def load():
        llm = LLM(engine_dir, tokenizer=kept.get("tokenizer"),
                  lora_config=adapters.lora_config(name) if adapters else None, **llm_options)
        kept["tokenizer"] = llm.tokenizer
        rank_failure.attach(llm)
        return llm
    return load


def _check_flags(port: int, stream_interval: int, threads: int | None, log_level: str, api_key: str | None) -> None:
    from engine.runtime.engine_core import check_stream_interval

    if not 0 <= port <= 65535:
        raise EngineError(f"--port {port} must be in [0, 65535]", usage=True)
    check_stream_interval(stream_interval)
    if threads is not None and threads < 1:
        raise EngineError(f"--threads {threads} must be >= 1", usage=True)
    if log_level not in ("debug", "info", "warning", "error"):
        raise EngineError(f"--log-level {log_level!r} must be debug, info, warning or error", usage=True)
    if api_key is not None and not api_key.strip():
        raise EngineError("--api-key is empty; give a key or leave the flag (and ENGINE_API_KEY) out", usage=True)
