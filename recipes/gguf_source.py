"""A llama.cpp GGUF file as a TensorSource: dequantized float32 tensors under Hugging Face names, the HF config
and the tokenizer (with its chat template) recovered from the file's metadata.

    GGUF file ──read_gguf_metadata (once, vocabulary skipped)──▶ metadata ──▶ HF config (architectures, float32)
              ──tensor table──▶ (offset, type, shape) ──memory map, one tensor──▶ gguf.quants.dequantize ──▶
                 float32 ──undo q/k permutation──▶ HF tensor
              ──the tokenizer class AutoTokenizer picks (gguf_file=...)──▶ tokenizer.json, tokenizer_config.json

What transformers makes from the same file is the reference, so each step is transformers' own: its metadata reader
and config tables, its tensor processor (the q/k un-permutation), the tokenizer class and GGUF tokenizer converter
AutoTokenizer uses. Two shortcuts cut opening SmolLM2-135M (names and tokenizer) from ~25 s to ~1 s past the imports,
and tests check both against transformers:
- for llama/qwen2/qwen3, transformers 5.24 builds the config with its legacy loader (load_gguf_checkpoint), which
  decodes every metadata value through gguf.GGUFReader, a 49k-token vocabulary included (~12 s), to use a dozen
  numbers; gguf_config_dict applies the same tables to metadata read once, string arrays skipped;
- AutoTokenizer runs that legacy loader again only to choose the tokenizer class; _write_tokenizer makes the same
  choice from the config class at hand, and the class reads just the vocabulary and merges it needs.

The tokenizer files live in a temporary directory this source owns: use it as a context manager or call close().
This module knows GGUF and HF names; it must not know canonical names (the family recipes own those).
"""
from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from engine.core.errors import EngineError
from engine.core.manifest import digest_file
from engine.quantization.gguf_tensor import GGUFTensor, keeps

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
        self._metadata = _read_metadata(self.path)
        self.architecture = self._metadata["general.architecture"]
        supported = supported_architectures()
        if self.architecture not in supported:
            raise EngineError(f"GGUF architecture {self.architecture!r} of {self.path} is not supported; supported: "
                              f"{', '.join(supported)}")
        self._tensors = {t.name: t for t in _tensor_table(self.path)}
        self._refuse_rope_scaling()
        self._config, self._generation, processor_config, self._config_class = self._load_config()
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor
        self._processor = TENSOR_PROCESSORS.get(self.architecture, TensorProcessor)(config=processor_config)
        self._hf_names = self._map_names()
        # get() gives the kept kinds' blocks as they are (quantization/gguf_tensor.py); convert sets it for
        # checkpoints that keep them
        self.keep_quantized = False
        self.dequantized: dict[str, str] = {}   # with keep_quantized: GGUF tensor -> its quantized kind not kept
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._tokenizer_dir: Path | None = None

    # ---- metadata ------------------------------------------------------------------------------------------

    def _refuse_rope_scaling(self) -> None:
        """transformers reads no rope scaling from a GGUF, so neither a match with it nor a correct model exists."""
        scaling = self._metadata.get(f"{self.architecture}.rope.scaling.type", "none")
        if scaling != "none" or "rope_freqs.weight" in self._tensors:
            what = f"rope scaling {scaling!r}" if scaling != "none" else "per-dimension rope factors (rope_freqs)"
            raise EngineError(f"{self.path} uses {what}, which cannot be recovered from GGUF metadata; convert the "
                              "original Hugging Face model with --model-dir instead")

    def _load_config(self) -> tuple[dict, dict, dict, type]:
        """(HF config dict, generation config dict, the raw parsed config, the config class) as transformers makes
        them."""
        from transformers import CONFIG_MAPPING, GenerationConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        parsed = gguf_config_dict(self._metadata, tuple(self._tensors))
        model_type = parsed.get("model_type")
        try:
            config = CONFIG_MAPPING[model_type].from_dict(dict(parsed))
        except (KeyError, ValueError, TypeError) as e:
            raise EngineError(f"the metadata of {self.path} does not make a valid {model_type} config: {e}") from None
        key_length = self._metadata.get(f"{self.architecture}.attention.key_length")
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
        return hf, generation, parsed, type(config)

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

    def get(self, name: str) -> torch.Tensor | GGUFTensor:
        """The tensor dequantized to float32, or with keep_quantized a kept kind's blocks as they are (GGUFTensor)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        tensor = self._tensors[self._hf_names[name]]
        # GGUFReader's layout for a tensor: its bytes as rows of the last dimension; dequantize reads F32/F16 as
        # views of them and unpacks quantized blocks row by row.
        # read, not memory-mapped: a map keeps every page read in the process's RSS until it is closed (a 1.1 GB
        # file converted: 2.46 GB peak), where a read's copy is freed with the tensor
        raw = np.fromfile(self.path, dtype=np.uint8, count=tensor.nbytes, offset=tensor.start)
        raw = raw.reshape(*tensor.shape[:-1], -1)
        kind = _kind_name(tensor.ggml_type)
        if self.keep_quantized and keeps(kind, tensor.shape):
            # the processor's q/k un-permutation moves whole rows: found on the row numbers, applied to the blocks
            order = self._processor.process(weights=np.arange(tensor.shape[0], dtype=np.float64)[:, None],
                                            name=tensor.name).weights[:, 0].astype(np.int64)
            return GGUFTensor(kind, raw, tensor.shape[1]).rows(order)
        if self.keep_quantized and kind not in FLOAT_KINDS:
            self.dequantized[tensor.name] = kind
        try:
            qtype = GGMLQuantizationType(tensor.ggml_type)
            values = dequantize(raw, qtype)
        except (NotImplementedError, ValueError) as e:
            raise EngineError(f"cannot dequantize {tensor.name} (ggml type {tensor.ggml_type}) of {self.path}: {e}; "
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

    def digest(self) -> str:
        """The sha256 of the GGUF file: everything converted comes from it (the hash a model hub publishes)."""
        return digest_file(self.path)

    def tokenizer_dir(self) -> Path:
        """tokenizer.json, tokenizer_config.json (with the chat template), chat_template.jinja, generation_config.json."""
        if self._tokenizer_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="engine-gguf-")  # removed by close() or at exit
            self._tokenizer_dir = _write_tokenizer(self.path, Path(self._tmp.name), self._config_class,
                                                   self._generation)
        return self._tokenizer_dir

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp, self._tokenizer_dir = None, None

    def __enter__(self) -> "GGUFSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def gguf_config_dict(metadata: dict, tensor_names: tuple[str, ...]) -> dict:
    """transformers' load_gguf_checkpoint(path, return_tensors=False)["config"] for a GGUF_ARCHITECTURES file, from
    its metadata (as read_gguf_metadata returns it) and tensor names.

    The same steps with the same tables: tied embeddings when there is no output.weight, the architecture's defaults,
    then every key the config table names, renamed (a one-element array counts as its element), and the vocabulary
    size from the token list when no key states it. llama written for a model named exactly "mistral" is mistral,
    as there. The other branches of load_gguf_checkpoint (t5, stablelm, gemma, lfm2, gpt-oss, ...) are for
    architectures this source refuses.
    """
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    architecture = metadata["general.architecture"]
    updated = "mistral" if "llama" in architecture and metadata.get("general.name") == "mistral" else architecture
    config: dict = {"tie_word_embeddings": "output.weight" not in tensor_names}
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(architecture) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, config_key = key.replace(architecture, updated).partition(".")
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str):
            value = value.replace(architecture, updated)
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(config_key)
        if renamed is not None and renamed != -1:
            config[renamed] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        tokens = metadata["tokenizer.ggml.tokens"]  # the reader gives a string array's length unless asked for it
        config["vocab_size"] = tokens if isinstance(tokens, int) else len(tokens)
    return config


def _write_tokenizer(gguf_path: Path, tmp: Path, config_class: type, generation: dict) -> Path:
    from transformers import TokenizersBackend
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    # transformers reads tokenizer files from the directory it is given before looking at the GGUF, so it gets a
    # directory of its own that holds only a link to the file.
    view = tmp / "gguf"
    view.mkdir()
    (view / gguf_path.name).symlink_to(gguf_path.absolute())
    out = tmp / "tokenizer"
    # AutoTokenizer.from_pretrained(gguf_file=...) ends, for a GGUF (no tokenizer files, no tokenizer_class in its
    # config), in its last branch: the class registered for the config class, TokenizersBackend when none is or when
    # that is MistralCommonBackend (a GGUF is not in Mistral's own format). Choosing it here saves AutoTokenizer's
    # second legacy read of the whole file; the class then reads only the vocabulary and merges it needs.
    tokenizer_class = TOKENIZER_MAPPING.get(config_class, TokenizersBackend)
    if tokenizer_class is None or tokenizer_class.__name__ == "MistralCommonBackend":
        tokenizer_class = TokenizersBackend
    try:
        tok = tokenizer_class.from_pretrained(str(view), gguf_file=gguf_path.name, local_files_only=True,
                                              _from_auto=True)
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


FLOAT_KINDS = ("F32", "F16", "BF16", "F64")   # ggml types that are floats, not quantized blocks


def _kind_name(ggml_type: int) -> str:
    """gguf's name of a ggml type ("Q4_K"), or the number of one gguf does not know."""
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return str(ggml_type)


class _Tensor(NamedTuple):
    """Where one tensor's bytes are in the file and how to read them."""
    name: str
    ggml_type: int
    shape: tuple[int, ...]  # torch order
    start: int  # from the start of the file
    nbytes: int


def _read_metadata(path: Path) -> dict:
    """The file's metadata, read once; string arrays (the vocabulary, the merges) are left as their lengths."""
    try:
        from transformers.integrations.gguf import read_gguf_metadata
    except ImportError:  # an older transformers (e.g. one pinned by another package) has only the legacy loader
        import transformers
        raise EngineError(f"transformers {transformers.__version__} has no fast GGUF reader "
                          "(transformers.integrations.gguf), which --gguf needs; install a newer transformers (5.24 "
                          "is tested)") from None
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise EngineError(f"cannot read {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise EngineError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'; pass a llama.cpp .gguf "
                          "file (or download it again if it is one)")
    try:
        metadata, _ = read_gguf_metadata(str(path))
    except Exception as e:  # the parser raises whatever struct/numpy/utf-8 decoding raise on bad bytes
        raise EngineError(f"cannot read {path} as a GGUF file ({type(e).__name__}: {e}); the file is truncated or "
                          "corrupt — download it again") from None
    return metadata


def _tensor_table(path: Path) -> list[_Tensor]:
    """Every tensor's place in the file, checked against the file's size."""
    from transformers.integrations.gguf import GgufHeader
    try:
        header = GgufHeader.from_file(str(path))
        tensors = [_Tensor(t.name, t.ggml_type, t.shape, header.data_start + t.offset, t.nbytes)
                   for t in header.tensors]
    except ValueError:
        # transformers' fast reader sizes only the types its own kernels dequantize; its legacy loader, the
        # reference for these architectures, reads every type gguf does (Q5_0, Q5_1, BF16, ...) through GGUFReader.
        tensors = _tensor_table_gguf(path)
    except Exception as e:
        raise EngineError(f"cannot read the tensor table of {path} ({type(e).__name__}: {e}); the file is truncated "
                          "or corrupt — download it again") from None
    size = path.stat().st_size
    names = set()
    for t in tensors:
        if t.start + t.nbytes > size:
            raise EngineError(f"{path} is truncated: tensor {t.name} ends at byte {t.start + t.nbytes} of a "
                              f"{size}-byte file — download it again")
        if t.name in names:
            raise EngineError(f"{path} holds two tensors named {t.name!r}; the file is corrupt — download it again")
        names.add(t.name)
    return tensors


def _tensor_table_gguf(path: Path) -> list[_Tensor]:
    from gguf import GGUFReader
    try:
        reader = GGUFReader(str(path), "r")
    except Exception as e:
        raise EngineError(f"cannot read {path} as a GGUF file ({type(e).__name__}: {e}); the file is truncated or "
                          "corrupt — download it again") from None
    return [_Tensor(t.name, int(t.tensor_type), tuple(int(d) for d in reversed(t.shape)), t.data_offset, t.n_bytes)
            for t in reader.tensors]
