"""The TensorRT backend: which ONNX graph TensorRT gets, the builder settings derived from the build flags, and
the ONNX -> serialized-engine call. NOTHING TENSORRT HAS RUN: no TensorRT and no GPU exist where this project is
developed (bench/anchors/check_tensorrt.txt), so this module is written to TensorRT's documented Python API
(10.x and 11.x) and everything before the TensorRT call is tested here as plain functions.

    BuildConfig + TensorRTOptions ──builder_settings──▶ BuilderSettings (workspace bytes, one optimization profile:
                                                         min/opt/max of every dynamic input, timing-cache paths)
    rank{N}.raw.onnx (TensorRT flavour, never ORT-optimized: ORT's fused contrib ops are not ONNX TensorRT parses)
        ──build_serialized(trt, ...)──▶ Builder ─ create_network(STRONGLY_TYPED) ─ OnnxParser.parse_from_file
            ─ create_builder_config: set_memory_pool_limit(WORKSPACE), add_optimization_profile, set_timing_cache
            ─ build_serialized_network ──▶ rank{N}.engine  (+ the timing cache written to --output-timing-cache)
    config.json (runtime/trt_session.DeviceStamp): the TensorRT version (backend_version) and the GPU's compute
        capability (backend_device). Loading refuses either mismatch with a rebuild hint.

What the documentation says, and the choices it led to:
- Strong typing. TensorRT 11 makes every network strongly typed and removes the precision builder flags (FP16,
  INT8, FP8...): reduced precision comes from the graph's types and explicit Q/DQ nodes (TensorRT 11.0.0 release
  notes; "Migrating from TensorRT 10.x to 11.x", docs.nvidia.com/deeplearning/tensorrt/latest/api/migration/).
  On 10.x we opt in with NetworkDefinitionCreationFlag.STRONGLY_TYPED; 11.x accepts and ignores it. No builder
  precision flag is ever set; weight-only modes and int4_awq reach TensorRT as DequantizeLinear + MatMul (the
  reference lowering, symmetric: no zero point, which the parser requires; int4 in blocks of 64 or 128, the only
  ones TensorRT takes), fp8 as QuantizeLinear/DequantizeLinear with static per-tensor scales; int8_sq (scales
  computed per token in the graph) is refused: builder/tensorrt_quant.py. Whether TensorRT takes the blocked
  (group-wise) int8 DequantizeLinear of int8_wo, as it does int4 blocks, is unverified. TF32, on by default for
  FP32 layers, is cleared: a float32 engine computes in float32.
- Parser coverage. onnx-tensorrt docs/operators.md (TensorRT 10.0/10.1, commit 96e78110) lists every op of our
  reference lowerings as supported: Gather, ScatterND (no `reduction`), Where, Softmax, MatMul, Gemm, Split,
  Reshape, Transpose, Expand, Unsqueeze/Squeeze (axes as initializers: ours are), ReduceMean, Sqrt, Div, Tanh,
  Sigmoid, Gelu, Concat, DequantizeLinear (INT8/INT4, zero point 0), with INT64 and BOOL tensors. The opset-23
  ops of the plugin lowerings arrived later: Attention in 10.14 GA, RMSNormalization and RotaryEmbedding (and
  TensorScatter) in 10.15 GA (onnx-tensorrt Changelog). The parser only refuses opsets below 7
  (ModelImporter.cpp), so our opset-23 model with older ops parses on 10.0+. Hence `tensorrt_plugins`: the
  TensorRT flavour uses the reference lowerings for attention, RMSNorm and rotary (the `tensorrt>=10,<12` extra
  admits 10.0-10.13, and none of the opset-23 importers has been tried on our shapes) and DequantizeLinear instead
  of com.microsoft MatMulNBits; the gemm_swiglu switch is honoured (plain MatMul either way). TensorRT fuses the
  MatMul-Softmax-MatMul attention pattern itself ("Fused Attention", method 2, docs.nvidia.com/deeplearning/
  tensorrt/latest/inference-library/transformers-fused-attention.html).
- The KV pool. TensorRT documents an in-place cache only through IKVCacheUpdateLayer (10.15+): cache input
  [B, heads, S_max, hd] with a static S_max, per-sequence write indices, linear mode only, and an output that must
  share the cache input's device address (".../inference-library/transformers-kv-cache.html", ".../operators/
  KVCacheUpdate.html"). That is a dense per-sequence cache, not our paged slot pool ([num_slots, kv] addressed
  by slot_mapping), and aliasing a ScatterND output with its input is not documented. So the graph is unchanged
  (ScatterND writes kcache_out.{i}) and the runtime ping-pongs two pool buffers (runtime/trt_session.py): correct
  by the documented semantics, at twice the pool memory and one device copy of the pool per step. Measuring the
  alternatives (aliased ScatterND; a dense-cache layout for KVCacheUpdate/TensorScatter) needs a GPU.
- Tensor parallelism (TensorRT 11+). Each rank's graph marks its all-reduces (after o_proj and mlp down) with
  com.microsoft AllReduce, which the parser does not know. `mark_all_reduces` turns each into an Identity and keeps
  the pair of names; after parsing, `insert_all_reduces` adds a DistCollective layer (ALL_REDUCE, SUM, num_ranks =
  tp) on the partial sum and points every reader of the Identity (or, had the parser folded it, of the partial sum)
  at the layer's output (INetworkDefinition.add_dist_collective; "Multi-Device Inference", TensorRT 11 docs). The
  collective runs inside the engine over the NCCL communicator the runtime sets on each rank's execution context
  (runtime/tp/trt_shard.py). TensorRT 10.x has no such layer: tp > 1 is refused there with the installed version.
  builder/tensorrt_collectives.py holds both steps.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx

from engine.core.engine_format import BuildConfig, PluginConfig
from engine.core.errors import EngineError
from engine.runtime.trt_session import import_tensorrt

from .tensorrt_collectives import AllReduce, insert_all_reduces
from .tensorrt_quant import TENSORRT_QUANT_MODES

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GIB": 1 << 30}


@dataclass(frozen=True)
class TensorRTOptions:
    """The TensorRT-only flags of `engine build`."""
    workspace_size: int | None = None        # bytes; None: TensorRT's default (all device memory)
    input_timing_cache: Path | None = None   # read before building, when given (must exist)
    output_timing_cache: Path | None = None  # written after a successful build


@dataclass(frozen=True)
class ShapeRange:
    name: str
    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]


@dataclass(frozen=True)
class BuilderSettings:
    workspace_bytes: int | None
    profile: tuple[ShapeRange, ...]          # one optimization profile covering every input
    input_timing_cache: Path | None = None
    output_timing_cache: Path | None = None


def parse_size(text: str) -> int:
    """--workspace-size: bytes as an integer or with a binary unit (512MiB, 4GiB, 4G)."""
    match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).upper() if match else None
    if not match or unit not in _UNITS or int(match.group(1)) < 1:
        raise EngineError(f"--workspace-size {text!r} is not a size; use bytes or a number with KiB, MiB or GiB "
                          "(e.g. 4GiB)", usage=True)
    return int(match.group(1)) * _UNITS[unit]


def check_options(opts: TensorRTOptions) -> None:
    if opts.workspace_size is not None and opts.workspace_size < 1:
        raise EngineError(f"--workspace-size {opts.workspace_size} must be positive", usage=True)
    if opts.input_timing_cache is not None and not Path(opts.input_timing_cache).is_file():
        raise EngineError(f"--input-timing-cache {opts.input_timing_cache} is not a file; pass a cache written by "
                          "--output-timing-cache, or leave the flag out to start from an empty cache", usage=True)
    if opts.output_timing_cache is not None and not Path(opts.output_timing_cache).absolute().parent.is_dir():
        raise EngineError(f"--output-timing-cache {opts.output_timing_cache}: its directory does not exist; "
                          "create it first", usage=True)


def max_slots(build: BuildConfig) -> int:
    """KV pool rows the profile admits: every sequence of a full batch at max_seq_len, in whole blocks."""
    blocks_per_seq = -(-build.max_seq_len // build.tokens_per_block)
    return build.max_batch_size * blocks_per_seq * build.tokens_per_block


def dim_ranges(build: BuildConfig) -> dict[str, tuple[int, int, int]]:
    """(min, opt, max) of each symbolic dimension of the graph interface (core/engine_format.py).

    One profile, tuned (opt) for a decode step of a full batch, the steady state of serving; prefill shapes run
    on the same engine with kernels chosen for decode. S may be 0: a step of non-final prefill chunks samples
    nothing. A chunk holds at most max_num_tokens tokens of one sequence, never more than max_seq_len."""
    b, t, s = build.max_batch_size, build.max_num_tokens, build.max_seq_len
    return {
        "T": (1, min(b, t), t),
        "B": (1, b, b),
        "Qmax": (1, 1, min(t, s)),
        "Lmax": (1, min(build.max_input_len, s), s),
        "S": (0, b, b),
        "num_slots": (build.tokens_per_block, max_slots(build), max_slots(build)),
    }


def graph_input_dims(model: onnx.ModelProto) -> dict[str, tuple[int | str, ...]]:
    """Each graph input's dimensions: ints where static, the dim_param name where symbolic."""
    dims = {}
    for value in model.graph.input:
        shape = value.type.tensor_type.shape.dim
        dims[value.name] = tuple(d.dim_param if d.dim_param else d.dim_value for d in shape)
    return dims


def profile_shapes(input_dims: dict[str, tuple[int | str, ...]], build: BuildConfig) -> tuple[ShapeRange, ...]:
    """The optimization profile: min/opt/max shapes of every input, symbolic dims from `dim_ranges`."""
    ranges = dim_ranges(build)
    profile = []
    for name, dims in input_dims.items():
        unknown = [d for d in dims if isinstance(d, str) and d not in ranges]
        assert not unknown, f"graph input {name} has dimensions {unknown} the profile does not know"
        shapes = [tuple(ranges[d][k] if isinstance(d, str) else d for d in dims) for k in range(3)]
        profile.append(ShapeRange(name, *shapes))
    return tuple(profile)


def builder_settings(input_dims: dict[str, tuple[int | str, ...]], build: BuildConfig,
                     opts: TensorRTOptions) -> BuilderSettings:
    check_options(opts)
    return BuilderSettings(workspace_bytes=opts.workspace_size, profile=profile_shapes(input_dims, build),
                           input_timing_cache=opts.input_timing_cache, output_timing_cache=opts.output_timing_cache)


def tensorrt_plugins(plugins: PluginConfig) -> PluginConfig:
    """The TensorRT flavour of the graph (module docstring): reference lowerings for attention, RMSNorm, rotary and
    quantized matmuls; the gated-MLP switch as given."""
    return dataclasses.replace(plugins, gpt_attention_plugin=False, engine_kernels_plugin=False, rmsnorm_plugin=False,
                               rotary_plugin=False, weight_only_quant_matmul_plugin=False)


# ---- availability ---------------------------------------------------------------------------------------------

def tensorrt_unavailable() -> str | None:
    """Why TensorRT engines cannot be built here (None when they can): the package, its libraries, a CUDA GPU."""
    if importlib.util.find_spec("tensorrt") is None:
        return "the `tensorrt` package is not installed"
    try:  # the bindings load libnvinfer and libnvonnxparser here: a bindings-only install fails at this point
        importlib.import_module("tensorrt")
    except ImportError as e:
        return f"`import tensorrt` failed ({e})"
    import torch
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    return None


def choose_backend(name: str, why_not_tensorrt: str | None) -> str:
    """--backend after `auto`: tensorrt where it can build (why_not_tensorrt is None), else onnxruntime; an explicit
    tensorrt that cannot build is a usage error naming the reason, the extra and the GPU requirement."""
    known = ("auto", "onnxruntime", "tensorrt")
    if name not in known:
        raise EngineError(f"--backend {name!r} is unknown; use one of {', '.join(known)}", usage=True)
    if name == "auto":
        return "onnxruntime" if why_not_tensorrt else "tensorrt"
    if name == "tensorrt" and why_not_tensorrt:
        raise EngineError(f"--backend tensorrt: {why_not_tensorrt}. The TensorRT backend needs the `tensorrt` extra "
                          "(pip install 'engine[tensorrt]') and an NVIDIA GPU; use --backend onnxruntime", usage=True)
    return name


def resolve_backend(name: str, mode: str | None = None, kv_cache_dtype: str = "float32") -> str:
    """--backend after `auto`, which picks tensorrt only where it can build and TensorRT takes the --dtype `mode`
    (tensorrt_quant.TENSORRT_QUANT_MODES) and a float KV cache; an explicit tensorrt is checked by the build."""
    # Only probe TensorRT when it could be chosen: `import tensorrt` loads its CUDA libraries.
    backend = choose_backend(name, tensorrt_unavailable() if name in ("auto", "tensorrt") else None)
    if name == "auto" and backend == "tensorrt" and (mode not in TENSORRT_QUANT_MODES or kv_cache_dtype != "float32"):
        return "onnxruntime"
    return backend


# ---- the TensorRT call (never executed on this project's machines) --------------------------------------------

def network_flags(trt) -> int:
    """STRONGLY_TYPED on 10.x; 11.x networks are always strongly typed (the flag is accepted and ignored there)."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
    return 0 if flag is None else 1 << int(flag)


def build_serialized(trt, onnx_path: Path, settings: BuilderSettings, *, all_reduces: tuple[AllReduce, ...] = (),
                     num_ranks: int = 1, log: Callable[[str], None] | None = None) -> bytes:
    """ONNX file -> serialized engine with `trt` (the tensorrt module): parser, config, build, timing cache;
    `all_reduces` (mark_all_reduces) become DistCollective layers over `num_ranks` ranks."""
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(network_flags(trt))
    parser = trt.OnnxParser(network, logger)
    # parse_from_file, not parse(bytes): it resolves the external weight file relative to the model's directory.
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise EngineError(f"TensorRT's ONNX parser rejected {onnx_path.name}: {errors}. This graph flavour has not "
                          "been verified on a GPU yet: please report it, and use --backend onnxruntime meanwhile")
    insert_all_reduces(trt, network, all_reduces, num_ranks)
    config = builder.create_builder_config()
    # TensorRT runs FP32 layers in TF32 by default (BuilderFlag.TF32); a float32 engine means float32.
    tf32 = getattr(trt.BuilderFlag, "TF32", None)
    if tf32 is not None:
        config.clear_flag(tf32)
    if settings.workspace_bytes is not None:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, settings.workspace_bytes)
    profile = builder.create_optimization_profile()
    for r in settings.profile:
        profile.set_shape(r.name, r.min, r.opt, r.max)
    config.add_optimization_profile(profile)
    seed = Path(settings.input_timing_cache).read_bytes() if settings.input_timing_cache else b""
    cache = config.create_timing_cache(seed)
    config.set_timing_cache(cache, ignore_mismatch=False)
    if log:
        log(f"building {onnx_path.name} with TensorRT {trt.__version__}")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise EngineError(f"TensorRT failed to build {onnx_path.name} (its log above says why); a larger "
                          "--workspace-size or smaller --max-num-tokens / --max-seq-len may help")
    if settings.output_timing_cache:
        Path(settings.output_timing_cache).write_bytes(bytes(config.get_timing_cache().serialize()))
    return bytes(plan)


def build_rank_engine(raw_onnx: Path, out: Path, build: BuildConfig, opts: TensorRTOptions,
                      all_reduces: tuple[AllReduce, ...] = ()) -> None:
    """rank{N}.raw.onnx (+ .data) -> rank{N}.engine; the ONNX files are deleted once the engine is written."""
    trt = import_tensorrt()
    dims = graph_input_dims(onnx.load(str(raw_onnx), load_external_data=False))
    out.write_bytes(build_serialized(trt, raw_onnx, builder_settings(dims, build, opts), all_reduces=all_reduces,
                                     num_ranks=build.tp_size))
    raw_onnx.unlink()
    raw_onnx.with_name(f"{raw_onnx.name}.data").unlink(missing_ok=True)


def device_stamp(build: BuildConfig):
    """What this engine is tied to (config.json's backend_version and backend_device): the installed TensorRT and
    the GPU it is built on (the first visible one)."""
    from engine.runtime.trt_session import DeviceStamp, cuda_device
    trt = import_tensorrt()
    _, capability, name = cuda_device()
    return DeviceStamp(tensorrt_version=trt.__version__, compute_capability=capability, device_name=name,
                       max_slots=max_slots(build))

