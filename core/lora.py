"""LoRA in an engine: which projections an engine built with `--lora-target-modules` adapts, and the graph inputs
that hold the adapters resident in a session (docs/lora.md).

Adapters name their modules as PEFT does. The engine fuses projections (q|k|v into one qkv projection, gate|up into
one), so each target module is a part of one of four groups, and each group of a layer is adapted by one LoraAdd
node over its projection (plugins/lora.py):

    group     modules (PEFT names)                       projection        the module's output columns
    qkv       q_proj, k_proj, v_proj  (phi3: qkv_proj)   hidden -> q|k|v   q: [0, Hq), k: [Hq, Hq+Hkv), v: ...
    dense     o_proj                                     Hq -> hidden      all
    gate_up   gate_proj, up_proj      (phi3: gate_up_proj) hidden -> gate|up gate: [0, I), up: [I, 2I)
    down      down_proj                                  I -> hidden       all

The adapters' weights are float32 or bfloat16 (BuildConfig.lora_dtype; `--lora-dtype auto` picks bfloat16 for
quantized bases, where a token's adapter bytes are a larger share of what it streams, and float32 otherwise).

Graph inputs of such an engine, for S slots (slot 0 is "no adapter" and stays zero) and R_g = max_lora_rank times
the group's modules, both chosen when a session is made (the dimensions are symbolic):
    lora_index        int64   [T]              each token's slot
    lora.{i}.{g}.a    dtype [S, R_g, in]       module m's A in rows [m * r, (m + 1) * r), zero padded past its rank
    lora.{i}.{g}.b    dtype [S, R_g, out]      module m's B^T times its scaling, in those rows and its own columns
"""
from __future__ import annotations

from engine.core.errors import EngineError
from engine.core.model_config import ModelConfig

LORA_INDEX = "lora_index"
LORA_DTYPES = ("float32", "bfloat16")

GROUPS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "dense": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
# PEFT's names of a whole fused group, as models that store the fused projection call them (Phi-3)
FUSED = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
MODULES = tuple(m for ms in GROUPS.values() for m in ms)
MODULE_GROUP = {m: g for g, ms in GROUPS.items() for m in ms} | FUSED


def lora_a_name(layer: int, group: str) -> str:
    return f"lora.{layer}.{group}.a"


def lora_b_name(layer: int, group: str) -> str:
    return f"lora.{layer}.{group}.b"


def resolve_target_modules(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`--lora-target-modules` as the engine stores it: PEFT module names (or "all"), in MODULES order."""
    names = list(names)
    if names == ["all"]:
        return MODULES
    unknown = [n for n in names if n not in MODULE_GROUP]
    if unknown:
        raise EngineError(f"--lora-target-modules {', '.join(unknown)}: not a projection the engine adapts; use "
                          f"'all' or any of {', '.join(MODULES)} (or {', '.join(FUSED)})", usage=True)
    expanded = {m for n in names for m in (GROUPS[FUSED[n]] if n in FUSED else (n,))}
    return tuple(m for m in MODULES if m in expanded)


def resolve_lora_dtype(flag: str, quant_mode: str | None) -> str:
    """--lora-dtype: auto is bfloat16 over quantized weights, float32 over float32 ones."""
    if flag == "auto":
        return "bfloat16" if quant_mode else "float32"
    if flag not in LORA_DTYPES:
        raise EngineError(f"--lora-dtype {flag!r} is not one of auto, {', '.join(LORA_DTYPES)}", usage=True)
    return flag


def target_groups(target_modules: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The groups an engine built for these modules adapts, in GROUPS order."""
    return tuple(g for g in GROUPS if any(MODULE_GROUP[m] == g for m in target_modules))


def group_shape(model: ModelConfig, group: str) -> tuple[int, int]:
    """(in, out) of a group's projection at tp 1."""
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    h, inter = model.hidden_size, model.intermediate_size
    return {"qkv": (h, q + 2 * kv), "dense": (q, h), "gate_up": (h, 2 * inter), "down": (inter, h)}[group]


def module_columns(model: ModelConfig, module: str) -> tuple[int, int]:
    """[start, stop) of a (split) module's output within its group's projection; an adapter of a fused module is
    split into its group's modules when it loads (runtime/lora/adapter.py)."""
    group = MODULE_GROUP[module]
    out = group_shape(model, group)[1]
    if len(GROUPS[group]) == 1:
        return 0, out
    q, kv, inter = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim, model.intermediate_size
    return {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv),
            "gate_proj": (0, inter), "up_proj": (inter, 2 * inter)}[module]


def group_row_blocks(group: str) -> int:
    """How many modules' rank rows a group's A and B hold (R_g = this x max_lora_rank)."""
    return len(GROUPS[group])


def group_columns(model: ModelConfig, group: str) -> list[int]:
    """The LoraAdd node's `columns` attribute: [start, stop) of each row block's output columns, flattened."""
    return [c for m in GROUPS[group] for c in module_columns(model, m)]
