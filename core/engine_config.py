"""config.json of an engine directory, and the engine's graph interface (shared by builder/ and runtime/).

One call per scheduler step, packed tokens with no padding (vLLM style), so a call can mix prefills, chunked
prefills and decodes. T packed tokens of B sequences; sequence b owns q_len[b] consecutive packed tokens and
has ctx_len[b] tokens of context (those already in the pool plus its new ones). The KV pool of each layer is a
runtime-owned array bound as both input and output (IOBinding), updated in place by ScatterND:

    kcache.{i} / vcache.{i}  [num_slots, kv_heads_per_rank * head_dim]   slot = block_id * tokens_per_block + offset

Graph inputs (int64 unless noted)                      shape
    input_ids          token ids, packed                    [T]
    positions          position of each token in its sequence [T]
    slot_mapping       pool slot where each token's new K/V is written  [T]
    q_index            packed index of query j of sequence b (pad: 0)   [B, Qmax]
    kv_slots           pool slot of context token l of sequence b (pad: 0)  [B, Lmax]
    attn_mask          bool, query j of b may see key l (causal, l < ctx_len[b])  [B, 1, Qmax, Lmax]
    attn_mask_sliding  bool, as attn_mask and within the sliding window (only when the model has sliding layers)
    out_index          for packed token t: its flat index b * Qmax + j in the [B, Qmax] attention output  [T]
    logits_indices     packed indices of the tokens whose logits are wanted  [S]
    kcache.{i}, vcache.{i}  float32 pools, as above
Graph outputs
    logits             float32 [S, vocab_size_padded / tp] (tp == 1: the real vocabulary may still be padded; the
                       runtime slices [:vocab_size])
    kcache_out.{i}, vcache_out.{i}  the updated pools, bound to the same buffers as the inputs
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .config import GenerationDefaults, Mapping, ModelConfig, QuantConfig

ENGINE_FORMAT = "engine"
ENGINE_FORMAT_VERSION = 1

INPUT_IDS = "input_ids"
POSITIONS = "positions"
SLOT_MAPPING = "slot_mapping"
Q_INDEX = "q_index"
KV_SLOTS = "kv_slots"
ATTN_MASK = "attn_mask"
ATTN_MASK_SLIDING = "attn_mask_sliding"
OUT_INDEX = "out_index"
LOGITS_INDICES = "logits_indices"
LOGITS = "logits"


def kcache_name(layer: int) -> str:
    return f"kcache.{layer}"


def vcache_name(layer: int) -> str:
    return f"vcache.{layer}"


def kcache_out_name(layer: int) -> str:
    return f"kcache_out.{layer}"


def vcache_out_name(layer: int) -> str:
    return f"vcache_out.{layer}"


def engine_file(rank: int, backend: str = "onnxruntime") -> str:
    return f"rank{rank}.engine" if backend == "tensorrt" else f"rank{rank}.onnx"


@dataclass(frozen=True)
class PluginConfig:
    """TensorRT-LLM-style plugin switches: enabled picks the fused backend lowering, disabled the plain
    reference lowering in standard ONNX ops."""
    gpt_attention_plugin: bool = True   # opset-23 Attention over the gathered paged KV
    rmsnorm_plugin: bool = True         # opset-23 RMSNormalization (ORT's fused Skip variant measured slower)
    rotary_plugin: bool = True          # opset-23 RotaryEmbedding
    gemm_swiglu_plugin: bool = True     # gated MLP as one gate+up MatMul
    weight_only_quant_matmul_plugin: bool = True  # quantized weights: MatMulNBits, or DequantizeLinear + MatMul


@dataclass(frozen=True)
class BuildConfig:
    max_batch_size: int = 32
    max_input_len: int = 1024
    max_seq_len: int = 2048
    max_num_tokens: int = 2048
    tokens_per_block: int = 32
    kv_cache_dtype: str = "float32"
    dtype: str = "float32"              # weights as stored in the engine
    backend: str = "onnxruntime"
    tp_size: int = 1
    opt_level: str = "all"              # ORT graph optimization level applied once at build


@dataclass(frozen=True)
class MemoryPlan:
    weight_bytes_per_rank: tuple[int, ...] = ()
    activation_bytes: int = 0           # peak activations of one step at max_num_tokens (estimate)
    kv_bytes_per_token: int = 0         # all layers, K and V, one rank
    kv_bytes_per_block: int = 0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    build: BuildConfig
    plugins: PluginConfig = field(default_factory=PluginConfig)
    mapping: Mapping = field(default_factory=Mapping)
    quantization: QuantConfig = field(default_factory=QuantConfig)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    memory: MemoryPlan = field(default_factory=MemoryPlan)
    precision: dict = field(default_factory=dict)  # what runs at which precision, for `engine inspect`
    toolchain_version: str = ""
    backend_version: str = ""
    format: str = ENGINE_FORMAT
    format_version: int = ENGINE_FORMAT_VERSION
