"""The engine directory and the `engine build` / `engine inspect` commands: manifest round trip, version checks
with rebuild messages, --dry-run, --force, --tp resharding, flag validation (exit 2) and inspect's report."""
from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import pytest
from safetensors.numpy import load_file

from engine.core.engine_format import EngineConfig, allreduce_name, engine_file, segment_file
from engine.core.errors import EngineError
from engine.core.serde import from_json, read_json, to_json
from engine.plugins import native
from engine.runtime.engine_dir import load_engine_config
from tests.builder.engines import stored_float

LLAMA = "LlamaForCausalLM"
# a float32 layer with the engine's kernels: its projections QuantMatMul's float32 tiles, folded into the attention,
# norm and MLP nodes where the CPU runs them (plugins/quant_matmul.float_runs), else MatMul beside those nodes
FLOAT_LAYER_OPS = (("│ engine.QuantRotaryPagedAttention ", "│ engine.QuantMLPAddRMSNorm ") if native.has_int8_dot()
                   else ("│ engine.RotaryPagedAttention ", "│ engine.SwiGLU "))


def cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Run `engine ARGS` in this process through the CLI's error boundary; (exit code, stdout, stderr)."""
    from engine.cli.app import main
    monkeypatch.setattr(sys, "argv", ["engine", *args])
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_info:
        main()
        sys.exit(0)
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


def test_config_round_trips(tiny):
    engine_dir = tiny.engine(LLAMA)
    data = read_json(engine_dir / "config.json")
    config = from_json(EngineConfig, data, where="config.json")
    assert to_json(config) == data
    assert config == load_engine_config(engine_dir)
    assert config.memory.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4    # layers x K,V x kv heads x head_dim x fp32
    assert (engine_dir / "tokenizer.json").is_file() and (engine_dir / "rank0.onnx.data").is_file()
    assert not list(engine_dir.glob("*.raw.onnx*"))


@pytest.mark.parametrize("field, value, expected", [
    ("format_version", 99, "format_version 99"),
    ("backend_version", "1.0.0", "built with onnxruntime 1.0.0"),
    ("toolchain_version", "0.0.1", "built by engine 0.0.1"),
])
def test_mismatched_engine_is_refused_with_rebuild_message(tiny, tmp_path, field, value, expected):
    import shutil
    engine_dir = tmp_path / "engine"
    shutil.copytree(tiny.engine(LLAMA), engine_dir)
    data = read_json(engine_dir / "config.json")
    data[field] = value
    (engine_dir / "config.json").write_text(json.dumps(data))
    with pytest.raises(EngineError, match=expected) as info:
        load_engine_config(engine_dir)
    assert "engine build" in str(info.value) and "--force" in str(info.value)


def test_dry_run_writes_nothing(tiny, tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "engine"
    code, out, _ = cli(monkeypatch, capsys, "build", "--checkpoint-dir", str(tiny.checkpoint(LLAMA)),
                       "--output-dir", str(out_dir), "--dry-run", "--max-seq-len", "128")
    assert code == 0
    assert "weights, rank 0" in out and "KV cache per token" in out and "512 B" in out
    assert not out_dir.exists() and list(tmp_path.iterdir()) == []


def test_existing_output_dir_needs_force(tiny, tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "engine"
    out_dir.mkdir()
    (out_dir / "keep").write_text("x")
    args = ["build", "--checkpoint-dir", str(tiny.checkpoint(LLAMA)), "--output-dir", str(out_dir),
            "--max-seq-len", "64"]
    code, _, err = cli(monkeypatch, capsys, *args)
    assert code == 2 and "already exists" in err and "--force" in err
    assert (out_dir / "keep").exists()
    code, _, _ = cli(monkeypatch, capsys, *args, "--force")
    assert code == 0 and not (out_dir / "keep").exists() and (out_dir / "rank0.onnx").is_file()
    assert load_engine_config(out_dir).build.max_seq_len == 64


@pytest.mark.parametrize("flags, message", [
    (["--max-input-len", "200", "--max-seq-len", "128"], "--max-input-len 200 exceeds --max-seq-len 128"),
    (["--max-seq-len", "1000"], "--max-seq-len 1000 exceeds the model's max_position_embeddings 256"),
    (["--max-batch-size", "0"], "--max-batch-size 0 must be at least 1"),
    (["--tokens-per-block", "24"], "--tokens-per-block 24 is not a power of two"),
    (["--max-num-tokens", "4"], "--max-num-tokens 4 is below --max-batch-size 32"),
    (["--kv-cache-dtype", "fp16"], "--kv-cache-dtype 'fp16' is unknown; use float32, float16, int8, fp8"),
    (["--dtype", "w4a8_awq"], "--dtype w4a8_awq is not implemented yet"),
    (["--dtype", "int3_wo"], "--dtype 'int3_wo' is unknown"),
    (["--dtype", "int8_wo", "--group-size", "128"], "group size 128 does not divide the 64 input features"),
    (["--dtype", "int4_wo", "--group-size", "48"], "group size 48 is not supported"),
    (["--group-size", "32"], "apply to quantized builds"),
    (["--backend", "tensorrt"], "needs the `tensorrt` extra"),
    (["--backend", "tvm"], "--backend 'tvm' is unknown"),
    (["--rmsnorm-plugin", "on"], "--rmsnorm-plugin 'on' must be enable or disable"),
    (["--tp", "3"], "--tp 3 cannot split LlamaForCausalLM"),
    (["--workers", "0"], "--workers 0 must be at least 1"),
    (["--lm-head-dtype", "fp16"], "--lm-head-dtype 'fp16' is not one of auto, float32, bfloat16, int8"),
    (["--lm-head-dtype", "int8"], "--lm-head-dtype int8 is a weight-only lm_head and needs a weight-only --dtype"),
    (["--dtype", "int8_wo", "--quantize-lm-head", "--lm-head-dtype", "bfloat16"], "both set lm_head's precision"),
    (["--lm-head-dtype", "bfloat16", "--engine-kernels-plugin", "disable"], "needs --engine-kernels-plugin enable"),
])
def test_bad_flags_exit_2(tiny, tmp_path, monkeypatch, capsys, flags, message):
    code, _, err = cli(monkeypatch, capsys, "build", "--checkpoint-dir", str(tiny.checkpoint(LLAMA)),
                       "--output-dir", str(tmp_path / "engine"), *flags)
    assert code == 2, err
    assert message in " ".join(err.split())
    assert not (tmp_path / "engine").exists()


def test_tp2_build_of_tp1_checkpoint(tiny, tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / "engine"
    code, _, err = cli(monkeypatch, capsys, "build", "--checkpoint-dir", str(tiny.checkpoint(LLAMA)),
                       "--output-dir", str(out_dir), "--tp", "2", "--workers", "2", "--max-seq-len", "64")
    assert code == 0, err
    config = load_engine_config(out_dir)
    assert config.mapping.tp_size == 2 and config.mapping.world_size == 2
    assert config.build.opt_level == "all"   # each segment is ORT-optimized at build, like a tp=1 engine
    # Each rank is cut at its 2 all-reduce points per layer into 2 * 2 + 1 segments (core/engine_format.py).
    assert not (out_dir / engine_file(0)).exists()
    ranks = [[onnx.load(str(out_dir / segment_file(r, k))) for k in range(5)] for r in (0, 1)]
    for segments in ranks:
        assert not any(n.op_type == "AllReduce" for m in segments for n in m.graph.node)
        for k, m in enumerate(segments):
            inputs, outputs = {i.name for i in m.graph.input}, {o.name for o in m.graph.output}
            assert (allreduce_name(k) in outputs) == (k < 4) and (allreduce_name(k - 1) in inputs) == (k > 0)
        assert {"kcache.1", "vcache.1"} <= {i.name for i in segments[2].graph.input}
        assert "logits" in {o.name for o in segments[4].graph.output}
    # Each rank holds its shard: vocab-parallel lm_head, column-parallel gate_up.
    ckpt = load_file(str(tiny.checkpoint(LLAMA) / "rank0.safetensors"))
    weights = [{t.name: t for m in segments for t in m.graph.initializer} for segments in ranks]
    vocab = ckpt["lm_head.weight"].shape[0] // 2
    lm_head = np.concatenate([stored_float(w["lm_head.weight"], vocab, str(out_dir)) for w in weights])
    np.testing.assert_array_equal(lm_head, ckpt["lm_head.weight"])
    gate_up = ckpt["layers.1.mlp.gate_up.weight"]               # [gate 128; up 128] rows
    rank1 = stored_float(weights[1]["layers.1.mlp.gate_up.weight"], 128, str(out_dir))   # [gate 64; up 64] of rank 1
    np.testing.assert_array_equal(rank1, np.concatenate([gate_up[64:128], gate_up[192:256]]))


def test_inspect_reports_config_versions_plan_and_ops(tiny, monkeypatch, capsys):
    code, out, _ = cli(monkeypatch, capsys, "inspect", "--engine-dir", str(tiny.engine(LLAMA)))
    assert code == 0
    for text in ("LlamaForCausalLM", "max_seq_len", "gpt_attention_plugin", "onnxruntime 1.32",
                 "runs here", "KV cache per block (4 tokens)", "weights, rank 0", "rank0.onnx:",
                 *FLOAT_LAYER_OPS, "MatMul"):
        assert text in out, text
    # Op counts follow the plugin switches: the reference lowering of attention is MatMul + Softmax.
    code, out, _ = cli(monkeypatch, capsys, "inspect", "--engine-dir", str(tiny.engine(LLAMA, plugins=False)))
    assert code == 0 and "│ Softmax " in out and "│ Attention " not in out


def test_failed_build_leaves_nothing(tiny, tmp_path):
    import shutil

    from safetensors.numpy import save_file

    from engine.builder.build import build_engine
    from engine.core.artifacts import load_checkpoint_config, save_sealed
    from tests.builder.engines import ALL_PLUGINS, TEST_BUILD
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(tiny.checkpoint(LLAMA), ckpt_dir)
    tensors = load_file(str(ckpt_dir / "rank0.safetensors"))
    del tensors["layers.1.mlp.down.weight"]
    save_file(tensors, str(ckpt_dir / "rank0.safetensors"))
    with pytest.raises(EngineError, match="rank0.safetensors: size"):  # the manifest sees the edit first
        build_engine(ckpt_dir, tmp_path / "engine", TEST_BUILD, ALL_PLUGINS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    ckpt = load_checkpoint_config(ckpt_dir)  # a manifest that agrees: the build itself fails, and cleans up
    save_sealed(ckpt_dir, ckpt, source_digest=ckpt.manifest.source_digest)
    with pytest.raises(EngineError, match="rank0.safetensors holds 131392 weights"):
        build_engine(ckpt_dir, tmp_path / "engine", TEST_BUILD, ALL_PLUGINS)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_float16_request_is_computed_in_float32_and_says_so(tiny):
    from engine.runtime.session import EngineSession
    from engine.runtime.step_inputs import SeqChunk
    config = load_engine_config(tiny.engine(LLAMA, dtype="float16"))
    assert config.build.dtype == "float16"
    assert config.precision["weights"] == "float32" and "computed in float32" in config.precision["note"]
    chunk = [SeqChunk([5, 9, 33, 7], 0, [0], True)]
    half = EngineSession(tiny.engine(LLAMA, dtype="float16"), num_blocks=4).run(chunk)
    full = EngineSession(tiny.engine(LLAMA), num_blocks=4).run(chunk)
    np.testing.assert_array_equal(half, full)


def test_precision_names_the_quantized_projections_activations():
    """Weight-only at accuracy level 4: int8 activations in QuantMatMul (bfloat16 in steps of 64 tokens or more
    where this CPU has AMX-BF16), or in MatMulNBits without the engine's kernels."""
    import dataclasses
    from types import SimpleNamespace

    from engine.builder.build import precision_of
    from engine.core.model_config import QuantConfig
    from engine.plugins import quant_matmul
    from tests.builder.engines import ALL_PLUGINS, TEST_BUILD
    ckpt = SimpleNamespace(dtype="float32", model=SimpleNamespace(tie_word_embeddings=False))
    quant = QuantConfig(mode="int8_wo", group_size=32, accuracy_level=4)
    kernels = precision_of(ckpt, TEST_BUILD, quant, ALL_PLUGINS)["activations"]
    assert ("QuantMatMul" in kernels) == quant_matmul.runs(32, 4, plugin=True, kernel=True)
    assert ("bfloat16 in steps of 64 tokens or more" in kernels) == (
        "QuantMatMul" in kernels and quant_matmul.has_bf16_tiles())
    plain = precision_of(ckpt, TEST_BUILD, quant, dataclasses.replace(ALL_PLUGINS, engine_kernels_plugin=False))
    assert plain["activations"] == "float32; int8 per block inside MatMulNBits (accuracy_level 4)"
