"""`engine convert` streams: its peak memory is about one output rank plus the tensor in flight, not the model.

What is measured, and why that is honest: the growth of the converting process's *anonymous* resident memory
(RssAnon in /proc/PID/status) over its value just before the conversion starts, sampled from outside every
millisecond or so. The source safetensors file is memory-mapped; the pages of it that the converter touches show
up as file-backed RSS (RssFile), which is page cache the kernel can drop and re-read at any time, shared with
every other reader of the file, and not memory the converter holds: counting it would charge the converter for
the file's size however little it keeps. What the converter itself allocates (the sliced, cast and packed
tensors of the rank it is building, temporaries) is anonymous memory, and that is what must stay small.
Sampling can miss a peak shorter than the interval, so the number is a lower bound of the true peak; the bounds
below leave a wide margin, and the test also checks that the sampler saw the rank being built.

The same model, whose conversion lasts long enough to be interrupted, also checks that Ctrl-C leaves nothing.

The model: a random Llama of ~350 MB fp32 (3 wide layers, hidden 1536, intermediate 4096, vocab 4096),
written directly with safetensors under LlamaForCausalLM's names (importing and initializing transformers would
take longer than the conversion).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.core.artifacts import load_checkpoint_config, rank_file

TP = 4
DRIVER = r"""
import sys
from pathlib import Path
import engine.recipes.convert, engine.recipes.sources  # torch and safetensors: imported before the baseline
from engine.cli.app import main
print("ready", flush=True)
sys.stdin.readline()
main(["convert", "--model-dir", sys.argv[1], "--output-dir", sys.argv[2], "--tp", sys.argv[3]])
"""


def rss_anon(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # the process has exited
        return None
    return None


def llama_shapes(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int) -> dict:
    """HF tensor names and shapes of a LlamaForCausalLM (as tests/tiny_models.py's save_pretrained writes them)."""
    hd = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (heads * hd, hidden), p + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * hd, hidden), p + "self_attn.o_proj.weight": (hidden, heads * hd),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter)})
    return shapes


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory) -> tuple[Path, int, int]:
    """(model dir, bytes of weights, bytes of the largest tensor)."""
    dims = dict(vocab=4096, hidden=1536, inter=4096, layers=3, heads=12, kv_heads=4)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": dims["vocab"],
              "hidden_size": dims["hidden"], "intermediate_size": dims["inter"], "num_hidden_layers": dims["layers"],
              "num_attention_heads": dims["heads"], "num_key_value_heads": dims["kv_heads"], "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "dtype": "float32"}
    gen = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(shape, generator=gen) * 0.02 for name, shape in llama_shapes(**dims).items()}
    model_dir = tmp_path_factory.mktemp("wide") / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config, indent=1))
    save_file(tensors, model_dir / "model.safetensors", metadata={"format": "pt"})
    sizes = [t.numel() * t.element_size() for t in tensors.values()]
    return model_dir, sum(sizes), max(sizes)


def test_convert_peak_anonymous_memory_is_well_under_the_model(wide_llama, tmp_path):
    model_dir, model_bytes, largest_tensor = wide_llama
    assert 300e6 < model_bytes < 400e6
    out = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(model_dir), str(out), str(TP)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        baseline = rss_anon(proc.pid)
        peak = baseline
        proc.stdin.write("go\n")
        proc.stdin.flush()
        while proc.poll() is None:
            now = rss_anon(proc.pid)
            if now is not None:
                peak = max(peak, now)
            time.sleep(0.001)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "converted LlamaForCausalLM" in stdout

    growth = peak - baseline
    rank_bytes = (out / rank_file(0)).stat().st_size
    assert load_checkpoint_config(out).mapping.tp_size == TP
    print(f"model {model_bytes / 1e6:.0f} MB, rank file {rank_bytes / 1e6:.0f} MB, largest tensor "
          f"{largest_tensor / 1e6:.0f} MB, peak anonymous growth {growth / 1e6:.0f} MB "
          f"({growth / model_bytes:.2f}x the model)")
    # the sampler saw the rank being built (a converter that allocated nothing would be suspicious, and a broken
    # sampler would pass any upper bound)
    assert growth > rank_bytes / 4
    # streaming: one rank (+ the tensor being converted and its slice), never the model
    assert growth < 0.6 * model_bytes
    assert growth < rank_bytes + 2 * largest_tensor


def default_sigint():
    """The child's SIGINT back to its default action, so that Python installs its handler there: a shell's
    background job (pytest run with `&`) starts with SIGINT ignored, and a child inherits that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_interrupt_leaves_nothing(wide_llama, tmp_path):
    """Ctrl-C in the middle of a conversion (rank 0 written, ranks 1-3 to come) removes the temporary directory
    and exits 130 with one line; the big model is what makes the conversion last long enough to interrupt."""
    model_dir, _, _ = wide_llama
    out = tmp_path / "ckpt"
    proc = subprocess.Popen([str(Path(sys.executable).with_name("engine")), "convert", "--model-dir", str(model_dir),
                             "--output-dir", str(out), "--tp", str(TP)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(f".{out.name}.tmp-*/{rank_file(0)}")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert stdout == "" and stderr.strip() == "error: interrupted"
    assert sorted(p.name for p in tmp_path.iterdir()) == []
