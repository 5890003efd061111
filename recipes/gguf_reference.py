"""The Hugging Face checkpoint transformers makes of a GGUF file: the reference the tests and the benchmarks hold
the engine to, and the input of peers that read only Hugging Face checkpoints (onnxruntime-genai's model builder).

    GGUF file ──transformers (gguf_file=..., float32: every tensor dequantized)──▶ HF dir (safetensors,
                                                                                  config, tokenizer, chat template)

Every system fed from that directory has the file's weights, rounded to its grid, in float32. The directory is
made in a temporary sibling and renamed into place when complete (core/artifacts.atomic_output_dir), so an
interrupted run leaves no half-made checkpoint; an existing one is reused as it is.
This module knows transformers; it must not know the engine's canonical names.
"""
from __future__ import annotations

from pathlib import Path

from engine.core.artifacts import atomic_output_dir


def hf_checkpoint(gguf: Path, out_dir: Path) -> Path:
    """`out_dir`, a float32 HF checkpoint of `gguf` as transformers loads it, made on first use."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(gguf)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config  # the weights are dequantized: a plain float32 checkpoint
    model.hf_quantizer = None
    with atomic_output_dir(out_dir, force=True) as tmp:
        model.save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
    return out_dir
