"""`engine serve`: the OpenAI-compatible HTTP server (FastAPI on uvicorn), a client of the engine core's async API.

    from engine.runtime.server.app import create_app, run_server
    from engine.runtime.server.config import ServerConfig

    app.py         create_app (middleware, error handlers, routes), the lifespan that loads the engine, run_server
    routes.py      the endpoints, one registration function per group (generation, resume, info, tokens)
    admission.py   ServerState: readiness (503) and each model's bounded count of sequences in flight (429)
    models.py      ModelRegistry: the served engines by name, routing `model`, loading on use, LRU/idle unloads
    completions.py OpenAIServing: a parsed request -> engine sequences -> JSON response or SSE chunks
    protocol.py    the request bodies (pydantic) and APIError, OpenAI's error shape
    sse.py         the `data:` event format and the resume event ids of a stream
    resume.py      --state-dir: checkpoints of the responses in flight, resuming them after a restart
    state_file.py  the inference-state file those checkpoints are written to (versioned JSON, atomic)
    journal.py     the request journal: each admitted response appended (group-committed) before its first byte
    body_limit.py  the ASGI middleware answering 413 to oversized request bodies
    internal_errors.py  the ASGI middleware answering unexpected exceptions 500 with a request id, not their text
    http_limits.py each connection's limits below the app: header size (431) and time (408), idle, HTTP/1.0
    metrics.py     the Prometheus metrics, under vLLM's names
    config.py      ServerConfig, the settings of `engine serve`

This package imports the web stack; the engine core (runtime/) never imports this package, and this package
never reaches into the core's internals (it uses the LLM's public API, SamplingParams, RequestOutput,
SequenceState and load_engine_config).
"""
