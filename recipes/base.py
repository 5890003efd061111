"""The recipe of a model family: HF config -> ModelConfig, HF tensor names -> logical canonical names.

A family subclasses its nearest relative and overrides only what differs (llama.cpp's converter style):
`TENSOR_NAMES` entries, `model_config_fields()`, or `modify_tensors()` for tensors that need reshaping.
Nothing outside recipes/ knows Hugging Face names.
"""
from __future__ import annotations

import re
from typing import ClassVar, Iterable

import torch

from engine.core.errors import EngineError
from engine.core.model_config import ROPE_TYPES, GenerationDefaults, ModelConfig, RopeConfig

# HF hidden_act -> ours. Every entry is the same function in transformers' ACT2FN, not an approximation of it.
_HF_ACTIVATIONS = {
    "silu": "silu",                    # Llama, Mistral, Qwen2/3, Phi3
    "swish": "silu",                   # older configs; nn.SiLU
    "gelu_pytorch_tanh": "gelu_tanh",  # Gemma 2/3 (hidden_activation)
    "gelu_python_tanh": "gelu_tanh",   # the same tanh approximation written out in Python
    "gelu_tanh": "gelu_tanh",          # our own name, for sources (GGUF) that already speak it
}


class Recipe:
    architecture: ClassVar[str]
    # HF tensor name -> logical canonical name; "{i}" stands for the layer index.
    TENSOR_NAMES: ClassVar[dict[str, str]] = {}
    # HF tensors that carry no weights of the model (buffers saved by old transformers versions).
    IGNORED: ClassVar[tuple[str, ...]] = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
    # The family's transformers config defaults, used when config.json omits a key (hub configs written by older
    # versions often do). A key present with null stays null: Mistral's sliding_window null means no window.
    DEFAULTS: ClassVar[dict] = {}
    # The config key naming the MLP activation (Gemma reads hidden_activation and ignores hidden_act).
    ACTIVATION_KEY: ClassVar[str] = "hidden_act"

    def __init__(self, hf_config: dict):
        self.hf = hf_config
        self._patterns = [(re.compile("^" + re.escape(hf).replace(r"\{i\}", r"(\d+)") + "$"), canon)
                          for hf, canon in self.TENSOR_NAMES.items()]
        self._ignored = [re.compile("^" + p + "$") for p in self.IGNORED]

    # ---- config -------------------------------------------------------------------------------------------

    def get(self, key: str, default=None):
        """config.json's value, else the family's default (DEFAULTS), else `default`; null counts as absent."""
        value = self.hf[key] if key in self.hf else self.DEFAULTS.get(key)
        return default if value is None else value

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise EngineError(f"config.json of this {self.architecture} model lacks {key!r}; the model directory "
                              "is incomplete or not a Hugging Face checkpoint")
        return value

    def model_config(self) -> ModelConfig:
        heads = self.require("num_attention_heads")
        hidden = self.require("hidden_size")
        fields = dict(
            architecture=self.architecture,
            vocab_size=self.require("vocab_size"),
            hidden_size=hidden,
            num_layers=self.require("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=self.get("num_key_value_heads", heads),
            head_dim=self.get("head_dim", hidden // heads),
            intermediate_size=self.require("intermediate_size"),
            norm_eps=float(self.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=self.get("max_position_embeddings", 2048),
            rope=self.rope(),
            tie_word_embeddings=bool(self.get("tie_word_embeddings", False)),
            activation=self.activation(),
        )
        fields.update(self.model_config_fields())
        return ModelConfig(**fields)

    def model_config_fields(self) -> dict:
        """What a family adds to or changes in the common fields."""
        return {}

    def activation(self) -> str:
        act = self.get(self.ACTIVATION_KEY, "silu")
        if act not in _HF_ACTIVATIONS:
            raise EngineError(f"activation {self.ACTIVATION_KEY}={act!r} of this {self.architecture} model is not "
                              f"supported; supported: {', '.join(_HF_ACTIVATIONS)}")
        return _HF_ACTIVATIONS[act]

    def rope(self, layer_type: str = "full_attention") -> RopeConfig:
        """Rotary config from either transformers 5 `rope_parameters` or the older rope_theta/rope_scaling."""
        params = self.hf.get("rope_parameters")
        if isinstance(params, dict) and layer_type in params and isinstance(params[layer_type], dict):
            params = params[layer_type]  # per-layer-type parameters (Gemma3)
        if not params:
            params = dict(self.hf.get("rope_scaling") or {})
            params.setdefault("rope_theta", self.get("rope_theta", 10000.0))
        return self.rope_config(params)

    def rope_config(self, params: dict) -> RopeConfig:
        """RopeConfig from one HF rope parameter dict (rope_type, rope_theta, factor, ...)."""
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in ROPE_TYPES:
            raise EngineError(f"rope type {rope_type!r} of this {self.architecture} model is not supported; "
                              f"supported: {', '.join(ROPE_TYPES)}")
        partial = float(params.get("partial_rotary_factor", self.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            # transformers rotates only the first head_dim * factor channels; our rotary rotates all of them
            raise EngineError(f"partial_rotary_factor {partial} of this {self.architecture} model is not supported "
                              "(only rotary over the whole head, factor 1.0)")
        return RopeConfig(
            theta=float(params.get("rope_theta", self.get("rope_theta", 10000.0))),
            type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_positions=params.get("original_max_position_embeddings"),
        )

    def hf_layer_types(self) -> list[str] | None:
        """HF's per-layer attention kinds; a family whose transformers config derives them when absent overrides."""
        return self.hf.get("layer_types")

    def layer_types(self) -> tuple[str, ...]:
        """HF layer_types ("full_attention" / "sliding_attention") as ours; () when every layer is full."""
        hf_types = self.hf_layer_types()
        if not hf_types:
            return ()
        names = {"full_attention": "full", "sliding_attention": "sliding"}
        unknown = sorted(set(hf_types) - set(names))
        if unknown:
            raise EngineError(f"layer types {unknown} of this {self.architecture} model are not supported; "
                              f"supported: {', '.join(names)}")
        num_layers = self.require("num_hidden_layers")
        if len(hf_types) != num_layers:
            raise EngineError(f"config.json of this {self.architecture} model has {len(hf_types)} layer_types for "
                              f"{num_layers} layers; the config is inconsistent")
        types = tuple(names[t] for t in hf_types)
        return () if set(types) == {"full"} else types

    def sliding_fields(self, types: tuple[str, ...], window: int | None) -> dict:
        """ModelConfig's layer_types and sliding_window.

        The window means the same in transformers 5.24 and in our ModelConfig, so it is copied unchanged:
        masking_utils.sliding_window_overlay lets query q see key k when `q - window < k <= q` (with the causal
        mask), i.e. the `window` most recent keys, the query's own included; DynamicSlidingWindowLayer likewise
        keeps window - 1 past keys for the next token.
        """
        if "sliding" in types and not window:
            raise EngineError(f"this {self.architecture} model has sliding-window layers but no sliding_window in "
                              "config.json (transformers cannot run it either); set sliding_window or make the "
                              "layers full_attention")
        return {"layer_types": types, "sliding_window": int(window) if types else None}

    def generation_defaults(self, generation_config: dict) -> GenerationDefaults:
        def pick(key):
            value = generation_config.get(key)
            return self.hf.get(key) if value is None else value
        eos = pick("eos_token_id")
        eos = () if eos is None else (tuple(eos) if isinstance(eos, list) else (eos,))
        return GenerationDefaults(bos_token_id=pick("bos_token_id"), eos_token_ids=eos,
                                  pad_token_id=pick("pad_token_id"))

    # ---- tensors ------------------------------------------------------------------------------------------

    def canonical_name(self, hf_name: str) -> str | None:
        """The logical canonical name of an HF tensor, None for ignored buffers; unknown names are an error."""
        for pattern, canon in self._patterns:
            m = pattern.match(hf_name)
            if m:
                return canon.replace("{i}", m.group(1)) if m.groups() else canon
        if any(p.match(hf_name) for p in self._ignored):
            return None
        raise EngineError(f"tensor {hf_name!r} is not part of a {self.architecture} model as this engine knows it; "
                          "the checkpoint has modules the recipe does not support")

    def modify_tensors(self, hf_name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """Logical canonical tensors made from one HF tensor (usually one; fused sources give several)."""
        name = self.canonical_name(hf_name)
        if name is not None:
            yield name, tensor
