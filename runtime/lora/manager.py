"""LoRA adapters of an LLM by name: registered from PEFT directories, kept parsed in memory (LRU of
max_cpu_loras), and made resident in the session's slots (LRU of max_loras) for the steps that use them.

    LLM(engine, lora_config={"max_loras": 4, "max_lora_rank": 16, "modules": {"sql": "adapters/sql"}})
    llm.loras.add("chat", "adapters/chat"); llm.generate(prompt, params, lora="chat"); llm.loras.remove("chat")

A name resolves to a registration id (Sequence.lora_id): re-adding a name after removing it gives a new id, so
neither a resident slot nor a prefix-cache block of the old adapter is taken for the new one. Requests in flight
keep the adapter they started with. The scheduler keeps at most max_loras distinct adapters among the running
sequences (scheduler.py), so the engine core can always make a step's adapters resident (slots_for).
add/remove/names run on any thread; slots_for on the engine's.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from engine.core.engine_format import EngineConfig
from engine.core.errors import EngineError

from .adapter import LoraWeights, load_adapter
from .slots import LoraSlots


@dataclass(frozen=True)
class LoraConfig:
    """vLLM's LoRA options: max_loras adapters resident in a step, max_lora_rank the largest rank taken,
    max_cpu_loras kept parsed in memory (default max_loras), modules registered at start (name -> directory)."""
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    modules: dict = field(default_factory=dict)

    def __post_init__(self):
        for flag, value in (("--max-loras", self.max_loras), ("--max-lora-rank", self.max_lora_rank),
                            ("--max-cpu-loras", self.max_cpu_loras or self.max_loras)):
            if value < 1:
                raise EngineError(f"{flag} {value} must be at least 1", usage=True)
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise EngineError(f"--max-cpu-loras {self.max_cpu_loras} is below --max-loras {self.max_loras}; "
                              "give at least as many", usage=True)

    @classmethod
    def of(cls, value: "LoraConfig | dict | None") -> "LoraConfig | None":
        if value is None or isinstance(value, LoraConfig):
            return value
        unknown = sorted(set(value) - {"max_loras", "max_lora_rank", "max_cpu_loras", "modules"})
        if unknown:
            raise EngineError(f"lora_config keys {unknown} are unknown; use max_loras, max_lora_rank, max_cpu_loras, "
                              "modules", usage=True)
        return cls(**value)


class LoraManager:
    def __init__(self, config: EngineConfig, options: LoraConfig | None):
        self.config, self.options = config, options
        self.targets = config.build.lora_target_modules
        # without options the graph's inputs still need binding: one zero slot (every token on the base model)
        self.slots = LoraSlots(config.model, self.targets, 1 + options.max_loras if options else 1,
                               options.max_lora_rank if options else 1, config.build.lora_dtype)
        self._lock = threading.Lock()
        self._names: dict[str, int] = {}                    # registered name -> id
        self._paths: dict[int, Path] = {}                   # id -> directory (kept for requests in flight)
        self._parsed: OrderedDict[int, LoraWeights] = OrderedDict()   # LRU, at most max_cpu_loras
        self._resident: OrderedDict[int, int] = OrderedDict()         # id -> slot, LRU order
        self._next_id = 1
        for name, path in (options.modules.items() if options else ()):
            self.add(name, path)

    def add(self, name: str, path: Path | str) -> int:
        """Register (or replace) adapter `name` from a PEFT directory, refusing one this engine cannot apply."""
        if self.options is None:
            raise EngineError("this LLM was made without LoRA support; pass lora_config (engine serve/run: "
                              "--lora-modules or --max-loras)", usage=True)
        weights = load_adapter(path, self.config.model, self.targets, self.options.max_lora_rank)
        with self._lock:
            lora_id, self._next_id = self._next_id, self._next_id + 1
            self._names[name] = lora_id
            self._paths[lora_id] = Path(path)
            self._keep_parsed(lora_id, weights)
        return lora_id

    def remove(self, name: str) -> None:
        with self._lock:
            if self._names.pop(name, None) is None:
                raise self._not_loaded(name)

    def names(self) -> list[str]:
        with self._lock:
            return list(self._names)

    def resolve(self, name: str) -> int:
        """The registration id requests for `name` run with."""
        with self._lock:
            if name not in self._names:
                raise self._not_loaded(name)
            return self._names[name]

    def _not_loaded(self, name: str) -> EngineError:
        return EngineError(f"LoRA adapter {name!r} is not loaded; loaded: {', '.join(self._names) or 'none'}",
                           usage=True)

    def unreadable(self, lora_ids: list[int]) -> dict[int, str]:
        """Those of these ids whose weights are neither resident nor parsed and can no longer be read (their
        directory changed or vanished since they were registered), with why; the others are then at hand."""
        failed = {}
        for lora_id in set(lora_ids) - {0} - set(self._resident):
            try:
                self._weights(lora_id)
            except EngineError as e:
                failed[lora_id] = str(e)
        return failed

    def slots_for(self, lora_ids: list[int]) -> list[int]:
        """The slot of each id (0 for none), loading the missing ones into free or least recently used slots;
        the ids' distinct adapters must fit the slots (the scheduler's max_loras)."""
        needed = set(lora_ids) - {0}
        for lora_id in needed:
            if lora_id in self._resident:
                self._resident.move_to_end(lora_id)
        for lora_id in needed - set(self._resident):
            taken = set(self._resident.values())
            free = [s for s in range(1, self.slots.num_slots) if s not in taken]
            if free:
                slot = free[0]
            else:
                victim = next(i for i in self._resident if i not in needed)
                slot = self._resident.pop(victim)
            self.slots.write(slot, self._weights(lora_id))
            self._resident[lora_id] = slot
        return [self._resident[i] if i else 0 for i in lora_ids]

    def _weights(self, lora_id: int) -> LoraWeights:
        with self._lock:
            weights = self._parsed.get(lora_id)
            if weights is not None:
                self._parsed.move_to_end(lora_id)
                return weights
            path = self._paths[lora_id]
        weights = load_adapter(path, self.config.model, self.targets, self.options.max_lora_rank)
        with self._lock:
            self._keep_parsed(lora_id, weights)
        return weights

    def _keep_parsed(self, lora_id: int, weights: LoraWeights) -> None:
        self._parsed[lora_id] = weights
        self._parsed.move_to_end(lora_id)
        limit = self.options.max_cpu_loras or self.options.max_loras
        while len(self._parsed) > limit:
            self._parsed.popitem(last=False)
