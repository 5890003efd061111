"""What a checkpoint and an engine both record of the model: its canonical description (ModelConfig, RopeConfig),
how it is split across ranks (Mapping), its quantization (QuantConfig) and its generation defaults.

A family's recipe turns a Hugging Face config into a `ModelConfig`; the builder and runtime read only this.
Every field a family adds has a neutral default, so Llama needs none of them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import EngineError

DTYPES = ("float32", "float16", "bfloat16")
ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_TYPES = ("default", "linear", "llama3")
LAYER_TYPES = ("full", "sliding")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding frequencies. `llama3` uses factor, low/high_freq_factor and original_max_positions."""
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_positions: int | None = None

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise EngineError(f"rope scaling type {self.type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")


@dataclass(frozen=True)
class MoeConfig:
    """Mixture-of-experts MLPs (Mixtral, Qwen2-MoE, Qwen3-MoE). A token's MLP output is the sum over its top_k
    experts of p_e * expert_e(x), each expert a gated MLP of intermediate_size, where p = softmax(x @ router^T) over
    all experts, the top_k kept and renormalized to sum 1 when normalize_top_k (Mixtral always; Qwen's
    norm_topk_prob). A shared expert (shared_intermediate_size > 0, Qwen2-MoE) runs on every token and is added,
    scaled by sigmoid(x . shared_gate) when shared_gate. dense_layers keep a dense MLP of ModelConfig's
    intermediate_size (Qwen2-MoE's mlp_only_layers and decoder_sparse_step)."""
    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool = True
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.num_experts < 1 or self.intermediate_size < 1 or self.shared_intermediate_size < 0:
            raise EngineError(f"num_experts {self.num_experts}, expert intermediate_size {self.intermediate_size} "
                              f"and shared_intermediate_size {self.shared_intermediate_size} must be positive")
        if not 1 <= self.top_k <= self.num_experts:
            raise EngineError(f"top_k {self.top_k} experts per token must be between 1 and num_experts "
                              f"{self.num_experts}")
        if self.shared_gate and not self.shared_intermediate_size:
            raise EngineError("a shared-expert gate needs a shared expert (shared_intermediate_size > 0)")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str               # the exact HF architecture name, e.g. "LlamaForCausalLM"
    vocab_size: int                 # real vocabulary; lm_head may be padded for tensor parallelism
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    activation: str = "silu"        # of the gated MLP: act(gate) * up
    qkv_bias: bool = False          # Qwen2
    qk_norm: bool = False           # Qwen3, Gemma3: RMSNorm over head_dim of q and k before rotary
    sandwich_norms: bool = False    # Gemma2/3: extra norms after attention and after the MLP
    norm_weight_offset: float = 0.0  # Gemma: RMSNorm multiplies by (offset + weight)
    embedding_multiplier: float = 1.0  # Gemma: embeddings scaled by sqrt(hidden_size)
    attention_scale: float | None = None  # None: 1/sqrt(head_dim); Gemma: query_pre_attn_scalar**-0.5
    attn_logit_softcap: float | None = None   # Gemma2
    final_logit_softcap: float | None = None  # Gemma2
    sliding_window: int | None = None  # keys visible to a "sliding" layer, the query's own included
    layer_types: tuple[str, ...] = ()  # per layer "full" | "sliding"; empty means all full
    local_rope: RopeConfig | None = None  # Gemma3: rotary of the sliding layers, when it differs
    moe: MoeConfig | None = None   # mixture-of-experts MLPs; None: every layer's MLP is dense

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise EngineError(f"{name} {getattr(self, name)} must be at least 1")
        if self.activation not in ACTIVATIONS:
            raise EngineError(f"activation {self.activation!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        if self.num_heads % self.num_kv_heads:
            raise EngineError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise EngineError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise EngineError(f"unknown layer types {bad}; known: {', '.join(LAYER_TYPES)}")
            if "sliding" in self.layer_types and not self.sliding_window:
                raise EngineError("sliding layers need a sliding_window")
        if self.moe is not None and not all(0 <= i < self.num_layers for i in self.moe.dense_layers):
            raise EngineError(f"dense_layers {list(self.moe.dense_layers)} name layers outside "
                              f"0..{self.num_layers - 1}")

    def layer_type(self, i: int) -> str:
        return self.layer_types[i] if self.layer_types else "full"

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is the mixture of experts (else dense)."""
        return self.moe is not None and i not in self.moe.dense_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class Mapping:
    """How a model is split across ranks (TensorRT-LLM's naming). Pipeline parallelism is not supported yet."""
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1


@dataclass(frozen=True)
class QuantConfig:
    """Quantization of the weights, activations and KV cache; `None` modes mean unquantized.

    Weight-only modes (quantization/modes.py): `group_size` input features share one scale; `quantize_lm_head` also
    quantizes lm_head (and, when tied, the embedding table that shares it); `accuracy_level` is ORT MatMulNBits' compute
    mode; `accuracy` is the build's perplexity report (quantization/accuracy.py); `calibration` records the data of
    ModelOpt-calibrated modes (quantization/modelopt_calibration.py). `kv_cache_dtype` mirrors BuildConfig's when the KV
    cache is quantized, and `kv_cache` records its scales. `source_grid`: int4_wo / int4_awq found every projection of
    the checkpoint already on 4-bit blocks of 32 (a GGUF Q4_1 source) and kept them exactly instead of RTN or AWQ
    (quantization/weight_only.block_grid). `lm_head_dtype` bfloat16 stores lm_head (and a tied embedding) in bfloat16
    for the engine's Bf16MatMul instead of float32, int8 in blocks of 32 on llama.cpp's Q8_0 rule beside weight-only
    layers (neither with quantize_lm_head). `formats`: mode gguf's stored tensors kept as GGUF blocks, by name (a
    stacked q|k|v of mixed kinds by its parts' logical names), and their kinds."""
    mode: str | None = None
    kv_cache_dtype: str | None = None
    group_size: int | None = None
    quantize_lm_head: bool = False
    accuracy_level: int | None = None
    accuracy: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)  # calibrated modes: the calibration data used
    kv_cache: dict = field(default_factory=dict)  # int8 KV cache: its calibrated scales (quantization/kv_cache.py)
    source_grid: bool = False
    lm_head_dtype: str = "float32"
    formats: dict = field(default_factory=dict)  # gguf: each tensor kept as blocks -> its GGUF kind ("Q4_K")
    float_activations: bool = False  # gguf's accuracy reference: the kept blocks with float32 activations


@dataclass(frozen=True)
class GenerationDefaults:
    """Special tokens and the chat template location, from generation_config.json / tokenizer_config.json."""
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None


def parse_dtype(name: str) -> str:
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}
    name = aliases.get(name, name)
    if name not in DTYPES:
        raise EngineError(f"--dtype {name!r} is not supported; use one of: auto, {', '.join(DTYPES)}", usage=True)
    return name
