"""LoRA adapters served by name, as vLLM serves them: registered at start (`engine serve --lora-modules NAME=PATH`)
or at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter, with --allow-runtime-lora-updating), each on
a base model built with --lora-target-modules; a request whose `model` is an adapter's name runs on its base with
it (models.py's Adapters hook: base_of, names), and /v1/models lists it with its base as parent.

The table outlives the engines: a base model loaded (or reloaded) later gets every adapter of its own in its
lora_config, and one loaded now gets a new adapter at once (LLM.loras). An adapter is checked against its base's
engine when it is registered (shapes, target modules, rank: runtime/lora/adapter.py), so a bad one is refused
then, not by the first request that names it.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path

from engine.core.errors import EngineError

from ..engine_dir import load_engine_config
from ..lora.adapter import load_adapter


@dataclass(frozen=True)
class LoraModule:
    name: str
    path: Path
    base: str | None = None      # None: the server's default model


@dataclass(frozen=True)
class LoraServing:
    """vLLM's LoRA serving options."""
    modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    allow_updates: bool = False  # the load/unload endpoints


def parse_lora_module(value: str) -> LoraModule:
    """--lora-modules NAME=PATH, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    if value.lstrip().startswith("{"):
        try:
            d = json.loads(value)
            return LoraModule(str(d["name"]), Path(d["path"]), d.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise EngineError(f"--lora-modules {value!r}: not JSON with name and path ({e})", usage=True) from None
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise EngineError(f"--lora-modules {value!r}: give NAME=PATH (a PEFT adapter directory) or JSON "
                          '{"name": ..., "path": ..., "base_model_name": ...}', usage=True)
    return LoraModule(name, Path(path))


class AdapterTable:
    """Adapter name -> (its base model, its directory). `bases`: served model name -> engine directory; the
    first is the default base."""

    def __init__(self, options: LoraServing, bases: dict[str, Path]):
        self.options, self.bases = options, dict(bases)
        self.default = next(iter(self.bases))
        self._lock = threading.Lock()
        self._adapters: dict[str, LoraModule] = {}
        for module in options.modules:
            self.add(module)

    # ---- models.py's Adapters -----------------------------------------------------------------------------

    def base_of(self, name: str) -> str | None:
        with self._lock:
            module = self._adapters.get(name)
        return module.base if module else None

    def names(self) -> list[tuple[str, str]]:
        with self._lock:
            return [(m.name, m.base) for m in self._adapters.values()]

    # ---- registration -------------------------------------------------------------------------------------

    def add(self, module: LoraModule) -> LoraModule:
        """Check the adapter against its base's engine and register it; EngineError (usage) when it cannot be."""
        base = module.base or self.default
        if base not in self.bases:
            raise EngineError(f"LoRA adapter {module.name!r}: base model {base!r} is not served here; served: "
                              f"{', '.join(self.bases)}", usage=True)
        if module.name in self.bases:
            raise EngineError(f"LoRA adapter name {module.name!r} is a served model's name; pick another", usage=True)
        with self._lock:
            if module.name in self._adapters:
                raise EngineError(f"LoRA adapter {module.name!r} is already loaded; unload it first", usage=True)
        config = load_engine_config(self.bases[base])
        if not config.build.lora_target_modules:
            raise EngineError(f"LoRA adapter {module.name!r}: model {base!r} was built without LoRA support; "
                              "rebuild it with `engine build --lora-target-modules all`", usage=True)
        load_adapter(module.path, config.model, config.build.lora_target_modules, self.options.max_lora_rank)
        module = LoraModule(module.name, module.path, base)
        with self._lock:
            self._adapters[module.name] = module
        return module

    def remove(self, name: str) -> LoraModule:
        with self._lock:
            module = self._adapters.pop(name, None)
            loaded = ", ".join(self._adapters) or "none"
        if module is None:
            raise EngineError(f"LoRA adapter {name!r} is not loaded; loaded: {loaded}", usage=True)
        return module

    def lora_config(self, base: str) -> dict | None:
        """LLM(lora_config=...) for base model `base` now: None when its engine was built without LoRA."""
        if not load_engine_config(self.bases[base]).build.lora_target_modules:
            return None
        o = self.options
        with self._lock:
            modules = {m.name: str(m.path) for m in self._adapters.values() if m.base == base}
        return {"max_loras": o.max_loras, "max_lora_rank": o.max_lora_rank, "max_cpu_loras": o.max_cpu_loras,
                "modules": modules}
