"""Tiny HF models with random PEFT LoRA adapters and their LoRA engines, made once per test session (runtime and
server tests of LoRA: tests/runtime/test_lora.py, tests/server/test_lora_serving.py)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from engine.core import lora
from engine.core.engine_format import BuildConfig, PluginConfig
from engine.runtime.engine_dir import load_engine_config
from tests.tiny_models import make_tiny_model

BUILD = dict(max_batch_size=8, max_input_len=48, max_seq_len=64, max_num_tokens=64, tokens_per_block=8)
# PEFT's module names per family (Phi-3 stores q|k|v and gate|up fused, and so do its adapters)
TARGETS = {"Phi3ForCausalLM": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
SPLIT = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PEFT_PARENTS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class Models:
    """Tiny HF models, their LoRA engines and adapters, made once per test session."""

    def __init__(self, root: Path):
        self.root = root

    def hf(self, key: str) -> Path:
        d = self.root / key / "hf"
        if not d.exists():
            make_tiny_model(key, d)
        return d

    def engine(self, key: str, quant: str | None = None, targets=lora.MODULES, plugins: bool = True,
               lora_dtype: str = "float32") -> Path:
        from engine.builder.build import build_engine
        from engine.core.model_config import QuantConfig
        from engine.quantization.accuracy import AccuracyOptions
        from engine.recipes.convert import ConvertConfig, convert
        from engine.recipes.sources import HFDirSource
        d = self.root / key / f"engine_{quant}_{len(targets)}_{plugins}_{lora_dtype}"
        if not d.exists():
            ckpt = self.root / key / "ckpt"
            if not ckpt.exists():
                convert(HFDirSource(self.hf(key)), ConvertConfig(output_dir=ckpt))
            build_engine(ckpt, d, BuildConfig(**BUILD, lora_target_modules=tuple(targets), lora_dtype=lora_dtype),
                         PluginConfig() if plugins else PluginConfig(engine_kernels_plugin=False),
                         quant=QuantConfig(mode=quant) if quant else None, accuracy=AccuracyOptions(eval_tokens=0))
        return d

    def adapter(self, key: str, seed: int, r: int = 4, targets=None, **config) -> Path:
        """A random (non-zero B) PEFT adapter of the tiny model, saved with save_pretrained."""
        d = self.root / key / f"adapter_{seed}_{r}_{json.dumps(config, sort_keys=True)}_{targets}"
        if not d.exists():
            torch.manual_seed(seed)
            model = _peft().get_peft_model(self.base(key), _peft().LoraConfig(
                r=r, lora_alpha=2 * r, target_modules=targets or TARGETS.get(key, SPLIT), init_lora_weights=False,
                **config))
            with torch.no_grad():   # large enough to change greedy tokens of a random model
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.mul_(4.0)
            model.save_pretrained(d)
        return d

    def base(self, key: str):
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(self.hf(key), torch_dtype=torch.float32,
                                                    attn_implementation="eager").eval()

    def reference(self, key: str, adapter: Path | None):
        model = self.base(key)
        return _peft().PeftModel.from_pretrained(model, adapter).eval() if adapter else model


def _peft():
    import peft
    return peft


def write_random_adapter(out: Path, engine: Path, rank: int, seed: int, scale: float = 0.01) -> Path:
    """A PEFT adapter directory of rank `rank` on every projection of the engine's model (random weights, B's of
    standard deviation `scale`), written with safetensors: no HF model needed."""
    from safetensors.numpy import save_file
    if (out / "adapter_model.safetensors").is_file():
        return out
    model = load_engine_config(engine).model
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(model.num_layers):
        for module, parent in PEFT_PARENTS.items():
            k = lora.group_shape(model, lora.MODULE_GROUP[module])[0]
            c0, c1 = lora.module_columns(model, module)
            stem = f"base_model.model.model.layers.{i}.{parent}.{module}"
            tensors[f"{stem}.lora_A.weight"] = (rng.standard_normal((rank, k)) / np.sqrt(k)).astype(np.float32)
            tensors[f"{stem}.lora_B.weight"] = (rng.standard_normal((c1 - c0, rank)) * scale).astype(np.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                         "target_modules": list(PEFT_PARENTS)}))
    return out
