"""`engine serve`'s LoRA flags (vLLM's): adapters served by name on engines built with --lora-target-modules
(runtime/server/lora_adapters.py).

    engine serve --engine-dir ENGINE --lora-modules sql=adapters/sql chat=adapters/chat [--max-loras 4]
        [--max-lora-rank 16] [--max-cpu-loras 8] [--allow-runtime-lora-updating]

A request names an adapter by `model`; /v1/models lists each with its base model as parent.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

LORA_MODULES = typer.Option(None, "--lora-modules", metavar="NAME=PATH", help="A LoRA adapter (PEFT directory) "
                            "served as model NAME, on the default model; or JSON {\"name\", \"path\", "
                            "\"base_model_name\"}. Repeatable.")
MAX_LORAS = typer.Option(None, "--max-loras", help="LoRA adapters one step may use together (resident slots).",
                         show_default="1")
MAX_LORA_RANK = typer.Option(16, "--max-lora-rank", help="Largest adapter rank accepted (the slots' size).")
MAX_CPU_LORAS = typer.Option(None, "--max-cpu-loras", help="Adapters kept parsed in memory (LRU; the others are "
                             "read again when used).", show_default="--max-loras")
ALLOW_UPDATES = typer.Option(False, "--allow-runtime-lora-updating", help="Enable POST /v1/load_lora_adapter and "
                             "/v1/unload_lora_adapter.")


def adapter_table(modules: Optional[list[str]], max_loras: Optional[int], max_lora_rank: int,
                  max_cpu_loras: Optional[int], allow_updates: bool, bases: dict[str, Path]):
    """The server's AdapterTable, every --lora-modules adapter checked against its base; None without LoRA flags."""
    from engine.runtime.lora import LoraConfig
    from engine.runtime.server.lora_adapters import AdapterTable, LoraServing, parse_lora_module

    if not modules and max_loras is None and not allow_updates:
        return None
    LoraConfig(max_loras=max_loras or 1, max_lora_rank=max_lora_rank, max_cpu_loras=max_cpu_loras)   # checks them
    options = LoraServing(tuple(parse_lora_module(m) for m in modules or ()), max_loras or 1, max_lora_rank,
                          max_cpu_loras, allow_updates)
    return AdapterTable(options, bases)
