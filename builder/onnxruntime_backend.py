"""The ONNX Runtime backend: serialize one rank's graph, optimize it once with ORT, save the optimized model.

    Graph ──onnx.save (external data)──▶ rank0.raw.onnx (+ .data)      temporary, inside the build directory
          ──InferenceSession(optimized_model_filepath=rank0.onnx,
                             level=opt_level)──▶ rank0.onnx + rank0.onnx.data   kept; the raw model is deleted

ORT writes the optimized graph with every initializer of at least 1 KiB into rank{N}.onnx.data
("session.optimized_model_external_initializers_file_name"); it aligns large initializers in that file so that
loading memory-maps them instead of reading them into the heap. Measured here (ORT 1.32, SmolLM2-135M fp32,
539 MB of weights, a busy machine): the optimized engine loads in ~1 s, RSS 698 MB of which only 55 MB is
anonymous — the weights stay file-backed pages shared with the page cache. The runtime loads rank{N}.onnx with
optimizations disabled since they already ran (re-running them measured no slower on this graph, but buys
nothing), except for engines that store weights narrower than they run them: float16 block scales, which ORT's
constant folding widens at load (basic level; +0.05 s for SmolLM2's int4, which stores 6.6 MB less). The raw
model is optimized with prepacking disabled: no kernel runs in that session.

ORT's optimized models may hold hardware-specific layouts (NCHWc), so an engine is built on the kind of
machine that runs it, like a TensorRT engine.
"""
from __future__ import annotations

from pathlib import Path

import onnx

from engine.plugins import native
from engine.plugins.graph import ENGINE_DOMAIN

OPT_LEVELS = ("disable", "basic", "extended", "all")
MIN_EXTERNAL_BYTES = 1024
# the two ORT transformers that would store a Cast of a float16 initializer as a float32 initializer
KEEP_NARROW = ["ConstantFolding", "FuseFp16InitializerToFp32NodeTransformer"]


def save_raw(model: onnx.ModelProto, path: Path) -> None:
    """Write `model` with its weights in one external file next to it (no 2 GB protobuf limit)."""
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=f"{path.name}.data", size_threshold=MIN_EXTERNAL_BYTES)


def optimize(raw: Path, out: Path, *, opt_level: str, fold_at_load: bool = False, kernels: bool = False) -> None:
    """Optimize `raw` with ORT at `opt_level` and save the result as `out` + `out`.data; deletes `raw`.
    `fold_at_load`: the graph widens weights stored as float16 (Cast of an initializer, plugins/linear.py); constant
    folding would store them widened, so it is left to the session that loads the engine
    (runtime/session.engine_session_options). `kernels`: the graph uses the engine's own ops (plugins/native.py)."""
    import onnxruntime as ort

    levels = {"disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
              "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    so = ort.SessionOptions()
    so.graph_optimization_level = levels[opt_level]
    so.optimized_model_filepath = str(out)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name", f"{out.name}.data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                str(MIN_EXTERNAL_BYTES))
    # Nothing runs in this session: prepacking the weights would only double the build's peak memory.
    so.add_session_config_entry("session.disable_prepacking", "1")
    if kernels:
        native.register(so)
    so.log_severity_level = 3  # ORT warns that an ENABLE_ALL model is hardware specific; the docstring says so
    session = ort.InferenceSession(str(raw), so, providers=["CPUExecutionProvider"],
                                   disabled_optimizers=KEEP_NARROW if fold_at_load else None)
    del session
    raw.unlink()
    raw.with_name(f"{raw.name}.data").unlink(missing_ok=True)


# The ONNX Runtime ops a graph of the engine's kernels still holds (the embedding Gather, a final norm, a residual
# Add): at most tokens x hidden elements each, so on one thread they cost microseconds a step.
SERIAL_OPS = frozenset({"Gather", "Add", "RMSNormalization"})


def thread_pool(path: Path) -> str:
    """EngineConfig.thread_pool of the saved graph `path`: "engine" when every node is one of the engine's kernels
    or in SERIAL_OPS, else "onnxruntime"."""
    ours = all(op.startswith(f"{ENGINE_DOMAIN}.") or op in SERIAL_OPS for op in op_counts(path))
    return "engine" if ours else "onnxruntime"


def op_counts(path: Path) -> dict[str, int]:
    """Node count by op type (domain-qualified for contrib ops) of a saved model, without loading its weights."""
    model = onnx.load(str(path), load_external_data=False)
    counts: dict[str, int] = {}
    for node in model.graph.node:
        key = f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
        counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
