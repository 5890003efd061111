"""Gemma 2: Llama's tensors with sandwich norms, (1 + w) RMSNorm, scaled embeddings, soft-capping, sliding layers.

Checked against transformers 5.24 (models/gemma2/configuration_gemma2.py, modeling_gemma2.py). What the builder
must compute from ModelConfig alone:
- Decoder block (Gemma2DecoderLayer):
      h = x + attn_post_norm(attention(attn_norm(x)))        HF: input_layernorm, post_attention_layernorm
      y = h + mlp_post_norm(mlp(mlp_norm(h)))                HF: pre_feedforward_layernorm, post_feedforward_layernorm
  Note the renaming: Gemma's post_attention_layernorm is applied to the attention OUTPUT (our attn_post_norm), not
  before the MLP as in Llama; the pre-MLP norm is pre_feedforward_layernorm (our mlp_norm).
- Gemma2RMSNorm: `out = x.float() * rsqrt(mean(x.float()^2) + eps) * (1.0 + w.float())`, then cast to x's dtype:
  the whole norm, offset and weight included, runs in float32 (Llama multiplies by w after casting back).
  norm_weight_offset = 1.0 for every norm of the model, the final norm included.
- Embeddings: `embed(ids) * embed_scale.to(weight.dtype)` with embed_scale = hidden_size ** 0.5 (a float32
  buffer), so in bfloat16 the multiplier itself is rounded (sqrt(3072) = 55.43 -> 55.5) before the multiply.
  embedding_multiplier = hidden_size ** 0.5; the builder rounds it to the compute dtype. lm_head is not scaled.
- Attention: scaling = query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5); scores = tanh(s / cap) * cap with
  cap = attn_logit_softcapping, applied after scaling and before the mask; softmax in float32.
- Logits: tanh(logits / cap) * cap with cap = final_logit_softcapping (on the whole vocabulary, after lm_head).
- layer_types default (config without them): layer i is sliding iff (i + 1) % 2, i.e. even layers slide; every
  layer uses the same rotary (one rope_parameters). sliding_window is copied unchanged (see Recipe.sliding_fields).
- MLP: gelu_pytorch_tanh(gate) * up (config.hidden_activation; config.hidden_act is ignored by transformers).
- tie_word_embeddings defaults to true (lm_head.weight absent from the checkpoint).
Refused: attention_bias (biases on q, k, v and o_proj), use_bidirectional_attention (encoder use).
"""
from __future__ import annotations

from engine.core.errors import EngineError

from .llama import LlamaRecipe


class Gemma2Recipe(LlamaRecipe):
    architecture = "Gemma2ForCausalLM"
    TENSOR_NAMES = {
        **LlamaRecipe.TENSOR_NAMES,
        "model.layers.{i}.post_attention_layernorm.weight": "layers.{i}.attn_post_norm.weight",
        "model.layers.{i}.pre_feedforward_layernorm.weight": "layers.{i}.mlp_norm.weight",
        "model.layers.{i}.post_feedforward_layernorm.weight": "layers.{i}.mlp_post_norm.weight",
    }
    DEFAULTS = {"head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 8192,
                "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "query_pre_attn_scalar": 256,
                "sliding_window": 4096, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0}
    ACTIVATION_KEY = "hidden_activation"

    def model_config_fields(self) -> dict:
        fields = super().model_config_fields()  # refuses attention_bias
        if self.get("use_bidirectional_attention", False):
            raise EngineError(f"this {self.architecture} model sets use_bidirectional_attention (an encoder / "
                              "embedding model); only causal language models can be converted")
        fields.update(
            sandwich_norms=True,
            norm_weight_offset=1.0,
            embedding_multiplier=float(self.require("hidden_size")) ** 0.5,
            attention_scale=float(self.require("query_pre_attn_scalar")) ** -0.5,
            attn_logit_softcap=self.softcap("attn_logit_softcapping"),
            final_logit_softcap=self.softcap("final_logit_softcapping"),
        )
        fields.update(self.sliding_fields(self.layer_types(), self.get("sliding_window")))
        return fields

    def softcap(self, key: str) -> float | None:
        value = self.get(key)
        return None if value is None else float(value)

    def hf_layer_types(self) -> list[str] | None:
        return self.hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(self.require("num_hidden_layers"))]
