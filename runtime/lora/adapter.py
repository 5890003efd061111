"""A PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) read and checked against an
engine, as the per-module matrices the slots hold (core/lora.py):

    LoraWeights.modules[(layer, module)] = (A [r, in], B^T [r, columns] times the module's scaling)

scaling = lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora (rank_pattern / alpha_pattern per module, as
PEFT matches them: the pattern is a suffix of the module's dotted name). A fused module of PEFT's (Phi-3's
qkv_proj, gate_up_proj) is split into its group's modules, each with the same A and its rows of B. Anything the
engine cannot apply exactly is refused naming it: DoRA, trained biases, modules_to_save (a replaced lm_head or
embedding), target modules the engine was not built for, shapes that do not match the base model, a rank above
max_lora_rank.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.core import lora
from engine.core.errors import EngineError
from engine.core.model_config import ModelConfig

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (an adapter name may precede .weight)
_KEY = re.compile(r"(?P<module_path>.*\blayers\.(?P<layer>\d+)\..*?(?P<module>\w+))\.lora_(?P<ab>[AB])(\.\w+)?\.weight")


@dataclass
class LoraWeights:
    rank: int = 0                       # the largest of its modules' ranks
    modules: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


def load_adapter(path: Path | str, model: ModelConfig, target_modules: tuple[str, ...],
                 max_lora_rank: int) -> LoraWeights:
    path = Path(path)
    config = _read_config(path)
    tensors = _read_tensors(path)
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    names: dict[tuple[int, str], str] = {}
    for key, value in tensors.items():
        m = _KEY.fullmatch(key)
        if m is None:
            raise EngineError(f"{path / WEIGHTS}: tensor {key} is not a LoRA A/B matrix of a decoder layer's "
                              "projection; the engine applies adapters of q/k/v/o and gate/up/down projections only")
        layer, module = int(m["layer"]), m["module"]
        if module not in lora.MODULE_GROUP or layer >= model.num_layers:
            raise EngineError(f"{path / WEIGHTS}: tensor {key} adapts {module} of layer {layer}; this model has "
                              f"{model.num_layers} layers and the engine adapts {', '.join(target_modules)}")
        pairs.setdefault((layer, module), {})[m["ab"]] = value
        names[(layer, module)] = m["module_path"]
    weights = LoraWeights()
    for (layer, module), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise EngineError(f"{path / WEIGHTS}: {names[(layer, module)]} has lora_{''.join(ab)} without its pair")
        name = names[(layer, module)]
        for part, a, b in _split(model, module, *_checked(path, model, module, name, ab["A"], ab["B"])):
            if part not in target_modules:
                raise EngineError(f"{path}: the adapter targets {part} (layer {layer}), which the engine was not built "
                                  f"to adapt (it adapts {', '.join(target_modules) or 'nothing'}); rebuild it with "
                                  f"`engine build --lora-target-modules all` (or one listing {part})")
            r = a.shape[0]
            if r > max_lora_rank:
                raise EngineError(f"{path}: {name} has rank {r}, above --max-lora-rank "
                                  f"{max_lora_rank}; raise --max-lora-rank to at least {r}", usage=True)
            scale = _scaling(config, name, r)
            weights.modules[(layer, part)] = (np.ascontiguousarray(a, dtype=np.float32),
                                              np.ascontiguousarray(b.T * scale, dtype=np.float32))
            weights.rank = max(weights.rank, r)
    if not weights.modules:
        raise EngineError(f"{path / WEIGHTS} holds no LoRA matrices")
    return weights


def adapter_rank(path: Path | str) -> int:
    """The largest rank an adapter directory declares (r, rank_pattern): what its slots must hold."""
    config = _read_config(Path(path))
    return max([int(config.get("r", 8)), *map(int, (config.get("rank_pattern") or {}).values())])


def _read_config(path: Path) -> dict:
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise EngineError(f"LoRA adapter {path}: expected a PEFT adapter directory with {CONFIG} and {WEIGHTS} "
                          "(peft's save_pretrained writes them)", usage=True)
    try:
        config = json.loads((path / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise EngineError(f"{path / CONFIG} is not readable JSON: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise EngineError(f"{path / CONFIG}: peft_type {config.get('peft_type')!r}; only LORA adapters apply")
    for key, ok, why in (("use_dora", not config.get("use_dora"), "DoRA's magnitude vectors"),
                         ("bias", config.get("bias", "none") == "none", "trained biases"),
                         ("modules_to_save", not config.get("modules_to_save"), "fully trained extra modules"),
                         ("fan_in_fan_out", not config.get("fan_in_fan_out"), "Conv1D-layout weights")):
        if not ok:
            raise EngineError(f"{path / CONFIG}: {key} = {json.dumps(config.get(key))}: the engine does not apply "
                              f"{why}; merge the adapter into the base model instead (peft's merge_and_unload)")
    return config


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    import ml_dtypes  # noqa: F401 - registers bfloat16 with NumPy: adapters are often saved in it
    from safetensors.numpy import load_file
    try:
        return load_file(str(path / WEIGHTS))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for bad files
        raise EngineError(f"{path / WEIGHTS} is not a readable safetensors file ({e}); save the adapter again "
                          "with peft's save_pretrained") from None


def _checked(path: Path, model: ModelConfig, module: str, name: str, a: np.ndarray,
             b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A [r, in] and B [out, r] of a module, their shapes checked against the base model's projection."""
    group = lora.MODULE_GROUP[module]
    k, n = lora.group_shape(model, group)
    c0, c1 = (0, n) if module in lora.FUSED else lora.module_columns(model, module)
    out = c1 - c0
    r = a.shape[0] if a.ndim == 2 else -1
    for what, arr, want in (("lora_A", a, (r, k)), ("lora_B", b, (out, r))):
        if arr.ndim != 2 or tuple(arr.shape) != want or r < 1:
            raise EngineError(f"{path / WEIGHTS}: {name}.{what}.weight has shape {tuple(arr.shape)}; the base "
                              f"model's {module} needs [{'r' if what == 'lora_A' else out}, "
                              f"{k if what == 'lora_A' else 'r'}] (rank r = lora_A's rows): the adapter was trained "
                              "for another base model")
    return a, b


def _split(model: ModelConfig, module: str, a: np.ndarray, b: np.ndarray):
    """(module, A, B) of each split module a (maybe fused) PEFT module covers: a fused one's B rows are its
    projection's output, in the group's column order."""
    if module not in lora.FUSED:
        yield module, a, b
        return
    for part in lora.GROUPS[lora.FUSED[module]]:
        c0, c1 = lora.module_columns(model, part)
        yield part, a, b[c0:c1]


def _scaling(config: dict, module_path: str, r: int) -> float:
    alpha = float(_pattern(config.get("alpha_pattern") or {}, module_path, config.get("lora_alpha", 8)))
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


def _pattern(patterns: dict, module_path: str, default):
    """PEFT's rule: a key matches a module whose dotted name ends with it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return value
    return default
