"""A tiny engine for runtime and CLI tests: tiny HF Llama -> `engine convert` -> `engine build` (Python API)."""
from __future__ import annotations

from pathlib import Path

# The tiny engine's build limits: small enough that tests can hit every limit and force preemption.
TINY_BUILD = dict(max_batch_size=8, max_input_len=48, max_seq_len=64, max_num_tokens=40, tokens_per_block=8)


def build_tiny_engine(root: Path, key: str = "LlamaForCausalLM", quant: str | None = None,
                      **build) -> tuple[Path, Path]:
    """HF tiny model -> checkpoint -> engine under `root`, with weights quantized by mode `quant` if given (no
    accuracy report); returns (hf_dir, engine_dir)."""
    from engine.builder.build import build_engine
    from engine.core.engine_format import BuildConfig, PluginConfig
    from engine.core.model_config import QuantConfig
    from engine.quantization.accuracy import AccuracyOptions
    from engine.recipes.convert import ConvertConfig, convert
    from engine.recipes.sources import HFDirSource
    from tests.tiny_models import make_tiny_model
    hf = make_tiny_model(key, root / "hf")
    convert(HFDirSource(hf), ConvertConfig(output_dir=root / "ckpt"))
    build_engine(root / "ckpt", root / "engine", BuildConfig(**{**TINY_BUILD, **build}), PluginConfig(),
                 quant=QuantConfig(mode=quant) if quant else None, accuracy=AccuracyOptions(eval_tokens=0))
    return hf, root / "engine"
