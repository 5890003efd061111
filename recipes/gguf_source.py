"""A llama.cpp GGUF file as a TensorSource: dequantized float32 tensors under Hugging Face names, the HF config
and the tokenizer (with its chat template) recovered from the file's metadata.

    GGUF file ──GGUFReader (memory map)──▶ one tensor ──gguf.quants.dequantize──▶ float32 ──undo q/k permutation──▶
    (metadata) ──transformers load_gguf_checkpoint──▶ config dict ──▶ HF config (architectures, dtype float32)
    (metadata) ──transformers AutoTokenizer(gguf_file=...)──▶ tokenizer.json, tokenizer_config.json, chat template

The config and the tokenizer come from transformers' GGUF integration and the q/k un-permutation from its tensor
processor, so a checkpoint converted from a GGUF equals one converted from the HF model transformers loads from the
same file. The tokenizer files live in a temporary directory this source owns: use it as a context manager or call
close(). This module knows GGUF and HF names; it must not know canonical names (the family recipes own those).
"""
from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import numpy as np
import torch

from engine.core.errors import EngineError

from . import RECIPES

# GGUF `general.architecture` -> the HF architecture llama.cpp's convert_hf_to_gguf.py made it from.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # Llama 1-3, SmolLM2, TinyLlama; Mistral 7B is written as llama too
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# GGUF tensor name -> HF tensor name; "{i}" stands for the layer index (llama.cpp's gguf-py tensor_mapping.py).
_LLAMA_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent when the embedding is tied
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",  # rows permuted by llama.cpp
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",  # rows permuted by llama.cpp
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
TENSOR_NAMES = {
    "llama": _LLAMA_TENSORS,
    "qwen2": {  # Qwen2 / Qwen2.5: bias on q, k, v
        **_LLAMA_TENSORS,
        "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
        "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
        "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    },
    "qwen3": {  # Qwen3: RMSNorm of q and k per head
        **_LLAMA_TENSORS,
        "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
        "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    },
}


def supported_architectures() -> list[str]:
    """GGUF architectures whose HF family has a registered recipe."""
    return sorted(g for g, hf in GGUF_ARCHITECTURES.items() if hf in RECIPES)


class GGUFSource:
    kind = "gguf"

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise EngineError(f"--gguf {self.path} is not a file; pass a llama.cpp .gguf file", usage=True)
        self._reader = _open_reader(self.path)
        self.architecture = _field(self._reader, "general.architecture")
        supported = supported_architectures()
        if self.architecture not in supported:
            raise EngineError(f"GGUF architecture {self.architecture!r} of {self.path} is not supported; supported: "
                              f"{', '.join(supported)}")
        self._refuse_rope_scaling()
        self._config, self._generation, processor_config = self._load_config()
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
        self._processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=processor_config)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self._hf_names = self._map_names()
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._tokenizer_dir: Path | None = None

    # ---- metadata ------------------------------------------------------------------------------------------

    def _refuse_rope_scaling(self) -> None:
        """transformers reads no rope scaling from a GGUF, so neither a match with it nor a correct model exists."""
        scaling = _field(self._reader, f"{self.architecture}.rope.scaling.type", "none")
        if scaling != "none" or "rope_freqs.weight" in {t.name for t in self._reader.tensors}:
            what = f"rope scaling {scaling!r}" if scaling != "none" else "per-dimension rope factors (rope_freqs)"
            raise EngineError(f"{self.path} uses {what}, which cannot be recovered from GGUF metadata; convert the "
                              "original Hugging Face model with --model-dir instead")

    def _load_config(self) -> tuple[dict, dict, dict]:
        """(HF config dict, generation config dict, the raw parsed config) as transformers makes them."""
        from transformers import CONFIG_MAPPING, GenerationConfig
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        try:
            parsed = dict(load_gguf_checkpoint(str(self.path), return_tensors=False)["config"])
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise EngineError(f"cannot read the model config from the metadata of {self.path}: {e}; the GGUF file is "
                              "incomplete or was not written by llama.cpp's converter") from None
        model_type = parsed.get("model_type")
        try:
            config = CONFIG_MAPPING[model_type].from_dict(dict(parsed))
        except (KeyError, ValueError, TypeError) as e:
            raise EngineError(f"the metadata of {self.path} does not make a valid {model_type} config: {e}") from None
        key_length = _field(self._reader, f"{self.architecture}.attention.key_length", None)
        if key_length is not None and "head_dim" not in parsed and getattr(config, "head_dim", None) is not None:
            # Qwen3 states head_dim only here; transformers' GGUF mapping skips it and falls back to the class
            # default (128), which is right for released Qwen3 models and fails to load any other.
            config.head_dim = parsed["head_dim"] = key_length
        hf_arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        if hf_arch not in RECIPES:
            raise EngineError(f"{self.path} holds a {model_type} model ({hf_arch}), which is not supported; supported "
                              f"architectures: {', '.join(sorted(RECIPES))}")
        # what save_pretrained of the dequantized float32 model writes
        config.architectures = [hf_arch]
        config.dtype = torch.float32
        hf = config.to_dict()
        hf["dtype"] = hf["torch_dtype"] = "float32"
        generation = GenerationConfig.from_model_config(config).to_diff_dict()
        generation.pop("transformers_version", None)
        return hf, generation, parsed

    # ---- tensors -------------------------------------------------------------------------------------------

    def _map_names(self) -> dict[str, str]:
        table = [(re.compile("^" + re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), hf)
                 for g, hf in TENSOR_NAMES[self.architecture].items()]
        hf_names: dict[str, str] = {}
        for name in self._tensors:
            for pattern, hf in table:
                m = pattern.match(name)
                if m:
                    hf_names[hf.replace("{i}", m.group(1)) if m.groups() else hf] = name
                    break
            else:
                raise EngineError(f"tensor {name!r} of {self.path} is not part of a {self.architecture} model as this "
                                  "engine knows it; the file has modules the converter does not support")
        return hf_names

    def names(self) -> list[str]:
        return list(self._hf_names)

    def get(self, name: str) -> torch.Tensor:
        from gguf.quants import dequantize
        tensor = self._tensors[self._hf_names[name]]
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except (NotImplementedError, ValueError) as e:
            raise EngineError(f"cannot dequantize {tensor.name} ({tensor.tensor_type.name}) of {self.path}: {e}; "
                              "re-quantize the model with a type gguf can read (F32, F16, Q8_0, Q4_K, ...)") from None
        # transformers' processor for this architecture: for llama it undoes the q/k row permutation that
        # llama.cpp applies for its rotary layout; for the rest it passes through.
        values = self._processor.process(weights=values, name=tensor.name).weights
        return torch.from_numpy(np.array(values, dtype=np.float32))

    # ---- TensorSource ----------------------------------------------------------------------------------------

    def hf_config(self) -> dict:
        return self._config

    def generation_config(self) -> dict:
        return self._generation

    def tokenizer_dir(self) -> Path:
        """tokenizer.json, tokenizer_config.json (with the chat template), chat_template.jinja, generation_config.json."""
        if self._tokenizer_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="engine-gguf-")  # removed by close() or at exit
            self._tokenizer_dir = _write_tokenizer(self.path, Path(self._tmp.name), self._generation)
        return self._tokenizer_dir

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp, self._tokenizer_dir = None, None

    def __enter__(self) -> "GGUFSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _write_tokenizer(gguf_path: Path, tmp: Path, generation: dict) -> Path:
    from transformers import AutoTokenizer

    # transformers reads tokenizer files from the directory it is given before looking at the GGUF, so it gets a
    # directory of its own that holds only a link to the file.
    view = tmp / "gguf"
    view.mkdir()
    (view / gguf_path.name).symlink_to(gguf_path.absolute())
    out = tmp / "tokenizer"
    try:
        tok = AutoTokenizer.from_pretrained(str(view), gguf_file=gguf_path.name, local_files_only=True)
    except (ValueError, KeyError, OSError) as e:
        raise EngineError(f"cannot build the tokenizer from the metadata of {gguf_path}: {e}") from None
    tok.save_pretrained(str(out))
    # transformers 5 writes the template to chat_template.jinja only; tokenizer_config.json gets it too, for
    # readers that look there (older transformers, plain JSON readers).
    if isinstance(tok.chat_template, str):
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = tok.chat_template
        config.pop("local_files_only", None)  # how we loaded it, not a property of the tokenizer
        config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def _open_reader(path: Path):
    from gguf import GGUFReader
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise EngineError(f"cannot read {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise EngineError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'; pass a llama.cpp .gguf "
                          "file (or download it again if it is one)")
    try:
        reader = GGUFReader(str(path), "r")
        _field(reader, "general.architecture")
    except EngineError:
        raise
    except Exception as e:  # gguf's parser raises whatever numpy/struct raise on bad bytes
        raise EngineError(f"cannot read {path} as a GGUF file ({type(e).__name__}: {e}); the file is truncated or "
                          "corrupt — download it again") from None
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise EngineError(f"{path} is truncated: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} of a "
                              f"{size}-byte file — download it again")
    return reader


_MISSING = object()


def _field(reader, key: str, default=_MISSING):
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise EngineError(f"GGUF metadata lacks {key!r}; the file was not written by llama.cpp's converter")
        return default
    return field.contents()
