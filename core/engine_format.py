"""The engine format: config.json of an engine directory (EngineConfig, BuildConfig, PluginConfig, MemoryPlan),
its graph files, and the graphs' interface (shared by builder/ and runtime/).

One call per scheduler step, packed tokens with no padding (vLLM style), so a call can mix prefills, chunked
prefills and decodes. T packed tokens of S sequences; sequence s owns q_len[s] consecutive packed tokens and
has ctx_len[s] tokens of context (those already in the pool plus its new ones). Attention runs on B rows, each
at most Qmax consecutive new tokens of one sequence (runtime/step_inputs.py cuts long chunks beside short ones).
The KV pool of each layer is a runtime-owned array bound as both input and output (IOBinding), updated in place
by ScatterND:

    kcache.{i} / vcache.{i}  [num_slots, kv_heads_per_rank * head_dim]   slot = block_id * tokens_per_block + offset

Graph inputs (int64 unless noted)                      shape
    input_ids          token ids, packed                    [T]
    positions          position of each token in its sequence [T]
    slot_mapping       pool slot where each token's new K/V is written  [T]
    q_index            packed index of query j of attention row b (pad: 0)  [B, Qmax]
    kv_slots           pool slot of context token l of row b (pad: 0)  [B, Lmax]
    attn_mask          bool, query j of row b may see key l (causal within its sequence)  [B, 1, Qmax, Lmax]
    attn_mask_sliding  bool, as attn_mask and within the sliding window (only when the model has sliding layers)
    out_index          for packed token t: its flat index b * Qmax + j in the [B, Qmax] attention output  [T]
    logits_indices     packed indices of the tokens whose logits are wanted  [S]
    kcache.{i}, vcache.{i}  float32 pools, as above
Graph outputs
    logits             float32 [S, vocab_size_padded / tp] (tp == 1: the real vocabulary may still be padded; the
                       runtime slices [:vocab_size])
    kcache_out.{i}, vcache_out.{i}  the updated pools, bound to the same buffers as the inputs

Tensor parallelism (tp > 1, onnxruntime): each rank's graph is cut at its all-reduce points (after o_proj and after
mlp down of every layer; int8_sq also before both, see segment_reduces) into segment graphs rank{r}.seg{k:03d}.onnx,
so that the collectives run outside ONNX Runtime (runtime/tp/). Segment k < last ends with output allreduce.{k} (this
rank's partial sum [T, hidden_size], or its per-token amax [T, 1]); the runtime reduces it over the ranks in place and
feeds it to segment k + 1 as input allreduce.{k}.
Every other value that crosses segments (the residual stream) keeps its name. The step inputs and the pools of
layer i are inputs of the segments that use them, as above; the last segment outputs this rank's logits columns.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .manifest import Manifest
from .model_config import GenerationDefaults, Mapping, ModelConfig, QuantConfig

ENGINE_FORMAT = "engine"
ENGINE_FORMAT_VERSION = 2  # 2: manifest (size and sha256 of every file, source and checkpoint digests), build_flags

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


def allreduce_name(segment: int) -> str:
    """The value that segment `segment` of a tp > 1 engine outputs for the all-reduce (and the next one inputs)."""
    return f"allreduce.{segment}"


SUM, MAX = "sum", "max"


def segment_reduces(num_layers: int, quant_mode: str | None) -> tuple[str, ...]:
    """The collective after each segment but the last of a tp > 1 onnxruntime engine, in order: a sum of the partial
    results after o_proj and after mlp down of every layer. int8_sq adds a max before each of those two: the amax of
    every token of the row-parallel projection's input, of which each rank holds a slice, so that every rank rounds
    the token with the scale a tp 1 engine uses. A max carries one value per token, a sum hidden_size."""
    per_layer = (MAX, SUM, MAX, SUM) if quant_mode == "int8_sq" else (SUM, SUM)
    return per_layer * num_layers


def num_segments(num_layers: int, quant_mode: str | None) -> int:
    """Segment graphs per rank of a tp > 1 onnxruntime engine."""
    return len(segment_reduces(num_layers, quant_mode)) + 1


def segment_file(rank: int, segment: int) -> str:
    return f"rank{rank}.seg{segment:03d}.onnx"


def rank_files(rank: int, backend: str, tp: int, num_layers: int, quant_mode: str | None) -> list[str]:
    """The graph files of one rank: one engine, or the segment graphs of a tp > 1 onnxruntime engine."""
    if backend == "onnxruntime" and tp > 1:
        return [segment_file(rank, k) for k in range(num_segments(num_layers, quant_mode))]
    return [engine_file(rank, backend)]


@dataclass(frozen=True)
class PluginConfig:
    """TensorRT-LLM-style plugin switches: enabled picks the fused backend lowering, disabled the plain
    reference lowering in standard ONNX ops."""
    gpt_attention_plugin: bool = True   # opset-23 Attention over the gathered paged KV
    # the engine's own ORT ops (plugins/kernels/, compiled on first use by plugins/native.py): attention reading the
    # paged KV pools in place (replacing the context gather and gpt_attention_plugin's lowering), and the offsets of
    # kept Q4_1 blocks in one op (replacing Reshape + ReduceSum + MatMul + Add)
    engine_kernels_plugin: bool = True
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
    moe_ep_size: int = 1                # experts split into this many groups of tp / moe_ep_size ranks (docs/moe.md)
    # projections that take LoRA adapters at run time (PEFT module names, core/lora.py); () builds none
    lora_target_modules: tuple[str, ...] = ()
    lora_dtype: str = "float32"         # the adapters' weights in the session: float32 | bfloat16


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
    # every flag of `engine build` as resolved from --config and the command line (paths of the checkpoint and the
    # output excepted); `engine build --config ENGINE/config.json` builds with them again. {} when built from Python
    build_flags: dict = field(default_factory=dict)
    plugins: PluginConfig = field(default_factory=PluginConfig)
    mapping: Mapping = field(default_factory=Mapping)
    quantization: QuantConfig = field(default_factory=QuantConfig)
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    memory: MemoryPlan = field(default_factory=MemoryPlan)
    precision: dict = field(default_factory=dict)  # what runs at which precision, for `engine inspect`
    toolchain_version: str = ""
    backend_version: str = ""
    # which threads run the graph's parallel work on onnxruntime: "engine" when every node that computes in parallel
    # is one of the engine's kernels (plugins/kernels/), which then run on their own pool (spin_pool.h) while ONNX
    # Runtime's few other nodes run on one thread; else "onnxruntime", its intra-op pool, which the kernels share
    thread_pool: str = "onnxruntime"
    # TensorRT engines: the GPU they were built for (runtime/trt_session.DeviceStamp: compute_capability,
    # device_name, max_slots); loading refuses another architecture. {} on onnxruntime
    backend_device: dict = field(default_factory=dict)
    format: str = ENGINE_FORMAT
    format_version: int = ENGINE_FORMAT_VERSION
    manifest: Manifest = field(default_factory=Manifest)  # written last, when every other file is complete
