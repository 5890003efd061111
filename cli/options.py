"""Flags shared by the commands that load an engine (run, serve): one definition, the same help everywhere."""
from __future__ import annotations

import typer

KV_CACHE_MEM_FRACTION = typer.Option(
    0.5, "--kv-cache-mem-fraction",
    help="Fraction of available memory (after weights) for the KV cache, in (0, 1] (default 0.5).")
MAX_KV_TOKENS = typer.Option(
    None, "--max-kv-tokens", help="KV cache size in tokens; overrides --kv-cache-mem-fraction (default: none).")
THREADS = typer.Option(None, "--threads", help="CPU threads of the engine (default: onnxruntime's, all physical cores).")
TP_TIMEOUT = typer.Option(
    60.0, "--tp-timeout", help="Tensor-parallel engines: seconds the ranks wait for each other (start-up and each "
    "step) before a silent rank is an error (default 60).")
