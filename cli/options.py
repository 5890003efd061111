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
SPECULATIVE = typer.Option(None, "--speculative", help="Speculative decoding: ngram (prompt lookup: propose what "
                           "followed the last tokens' earlier occurrence) or draft (a smaller engine with the same "
                           "tokenizer proposes, --draft-engine-dir) (default: off).")
NUM_SPECULATIVE_TOKENS = typer.Option(None, "--num-speculative-tokens", help="Tokens proposed a step, in [1, 16] "
                                      "(default 4).")
DRAFT_ENGINE_DIR = typer.Option(None, "--draft-engine-dir", help="--speculative draft: the draft engine's directory.")
PROMPT_LOOKUP_MIN = typer.Option(None, "--prompt-lookup-min", help="--speculative ngram: shortest run of last "
                                 "tokens matched (default 2).")
PROMPT_LOOKUP_MAX = typer.Option(None, "--prompt-lookup-max", help="--speculative ngram: longest run of last "
                                 "tokens matched, tried first (default 4).")


def speculative_config(method: str | None, num_speculative_tokens: int | None, draft_engine_dir,
                       prompt_lookup_min: int | None, prompt_lookup_max: int | None):
    """LLM's speculative_config from the flags above, validated (a SpeculativeConfig, or None without
    --speculative), so a bad flag is refused before anything loads; an option given without --speculative is an
    error."""
    from engine.core.errors import EngineError
    from engine.runtime.speculative import SpeculativeConfig

    given = {"num_speculative_tokens": num_speculative_tokens, "draft_engine_dir": draft_engine_dir,
             "prompt_lookup_min": prompt_lookup_min, "prompt_lookup_max": prompt_lookup_max}
    given = {k: v for k, v in given.items() if v is not None}
    if method is None:
        if given:
            flag = "--" + next(iter(given)).replace("_", "-")
            raise EngineError(f"{flag} needs --speculative ngram or --speculative draft", usage=True)
        return None
    return SpeculativeConfig(method=method, **given)
