"""The recipe of a model family: HF config -> ModelConfig, HF tensor names -> logical canonical names.

A family subclasses its nearest relative and overrides only what differs (llama.cpp's converter style):
`TENSOR_NAMES` entries, `model_config_fields()`, or `modify_tensors()` for tensors that need reshaping.
Nothing outside recipes/ knows Hugging Face names.
"""
from __future__ import annotations

import re
from typing import ClassVar, Iterable

import torch

from engine.core.config import GenerationDefaults, ModelConfig, RopeConfig
from engine.core.errors import EngineError

_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


class Recipe:
    architecture: ClassVar[str]
    # HF tensor name -> logical canonical name; "{i}" stands for the layer index.
    TENSOR_NAMES: ClassVar[dict[str, str]] = {}
    # HF tensors that carry no weights of the model (buffers saved by old transformers versions).
    IGNORED: ClassVar[tuple[str, ...]] = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

    def __init__(self, hf_config: dict):
        self.hf = hf_config
        self._patterns = [(re.compile("^" + re.escape(hf).replace(r"\{i\}", r"(\d+)") + "$"), canon)
                          for hf, canon in self.TENSOR_NAMES.items()]
        self._ignored = [re.compile("^" + p + "$") for p in self.IGNORED]

    # ---- config -------------------------------------------------------------------------------------------

    def get(self, key: str, default=None):
        value = self.hf.get(key)
        return default if value is None else value

    def require(self, key: str):
        if key not in self.hf or self.hf[key] is None:
            raise EngineError(f"config.json of this {self.architecture} model lacks {key!r}; the model directory "
                              "is incomplete or not a Hugging Face checkpoint")
        return self.hf[key]

    def model_config(self) -> ModelConfig:
        heads = self.require("num_attention_heads")
        hidden = self.require("hidden_size")
        act = self.get("hidden_act", self.get("hidden_activation", "silu"))
        if act not in _HF_ACTIVATIONS:
            raise EngineError(f"activation {act!r} of this {self.architecture} model is not supported; supported: "
                              f"{', '.join(_HF_ACTIVATIONS)}")
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
            activation=_HF_ACTIVATIONS[act],
        )
        fields.update(self.model_config_fields())
        return ModelConfig(**fields)

    def model_config_fields(self) -> dict:
        """What a family adds to or changes in the common fields."""
        return {}

    def rope(self, layer_type: str = "full_attention") -> RopeConfig:
        """Rotary config from either transformers 5 `rope_parameters` or the older rope_theta/rope_scaling."""
        params = self.hf.get("rope_parameters")
        if isinstance(params, dict) and layer_type in params and isinstance(params[layer_type], dict):
            params = params[layer_type]  # per-layer-type parameters (Gemma3)
        if not params:
            params = dict(self.hf.get("rope_scaling") or {})
            params.setdefault("rope_theta", self.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        return RopeConfig(
            theta=float(params.get("rope_theta", self.get("rope_theta", 10000.0))),
            type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_positions=params.get("original_max_position_embeddings"),
        )

    def layer_types(self, num_layers: int) -> tuple[str, ...]:
        """HF layer_types ("full_attention" / "sliding_attention") as ours; () when every layer is full."""
        hf_types = self.hf.get("layer_types")
        if not hf_types:
            return ()
        names = {"full_attention": "full", "sliding_attention": "sliding"}
        unknown = sorted(set(hf_types) - set(names))
        if unknown:
            raise EngineError(f"layer types {unknown} of this {self.architecture} model are not supported")
        types = tuple(names[t] for t in hf_types[:num_layers])
        return () if set(types) == {"full"} else types

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

    def expected_tensors(self, model: ModelConfig) -> set[str]:
        """Every logical tensor a complete model of this family has."""
        names = {"vocab_embedding.weight", "final_norm.weight"}
        if not model.tie_word_embeddings:
            names.add("lm_head.weight")
        per_layer = ["attn_norm.weight", "attention.q.weight", "attention.k.weight", "attention.v.weight",
                     "attention.dense.weight", "mlp_norm.weight", "mlp.gate.weight", "mlp.up.weight",
                     "mlp.down.weight"]
        if model.qkv_bias:
            per_layer += ["attention.q.bias", "attention.k.bias", "attention.v.bias"]
        if model.qk_norm:
            per_layer += ["attention.q_norm.weight", "attention.k_norm.weight"]
        if model.sandwich_norms:
            per_layer += ["attn_post_norm.weight", "mlp_post_norm.weight"]
        for i in range(model.num_layers):
            names.update(f"layers.{i}.{n}" for n in per_layer)
        return names
