"""Flags shared by the commands that load an engine (run, serve, bench): one definition, the same help everywhere."""
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
MAX_NUM_TOKENS = typer.Option(None, "--max-num-tokens", help="Token budget of one engine step (prefill chunks + "
                              "decodes) (default: the engine's build limit).")
MAX_BATCH_SIZE = typer.Option(None, "--max-batch-size", help="Sequences per engine step (default: the engine's "
                              "build limit).")
PREFIX_CACHING = typer.Option(True, "--prefix-caching/--no-prefix-caching", help="Reuse the KV cache of prompt "
                              "prefixes shared between requests (default: on).")
