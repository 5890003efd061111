"""A llama.cpp GGUF file as a TensorSource: dequantized float32 tensors under Hugging Face names, the HF config
and the tokenizer (with its chat template) recovered from the file's metadata.

    GGUF file ──read_gguf_metadata (once, vocabulary skipped)──▶ metadata ──▶ HF config (architectures, float32)
              ──tensor table──▶ (offset, type, shape) ──read one tensor──▶ gguf.quants.dequantize ──▶
                 float32 ──undo q/k permutation (llama), 1 + w of norms (Gemma)──▶ HF tensor
                 (keep_quantized: a kept kind's blocks as they are, rows permuted as the processor would: GGUFTensor)
              ──the tokenizer class AutoTokenizer picks (gguf_file=...)──▶ tokenizer.json, tokenizer_config.json

What transformers makes from the same file is the reference, so each step is transformers' own: its metadata reader
and config tables, its tensor processor (llama's q/k un-permutation, Gemma's norm - 1), the tokenizer class and GGUF
tokenizer converter AutoTokenizer uses. Two shortcuts cut opening SmolLM2-135M (names and tokenizer) from ~25 s to
~1 s past the imports, and tests check both against transformers:
- for every architecture here, transformers 5.24-5.25 builds the config with its legacy loader
  (load_gguf_checkpoint), which decodes every metadata value through gguf.GGUFReader, a 49k-token vocabulary
  included (~12 s), to use a dozen numbers; gguf_tables.gguf_config_dict applies the same tables to metadata read
  once, string arrays skipped;
- AutoTokenizer runs that legacy loader again only to choose the tokenizer class; _write_tokenizer makes the same
  choice from the config class at hand, and the class reads just the vocabulary and merges it needs.

Hyperparameters a file states that transformers' GGUF config does not read (Gemma's attention scale and soft-caps,
Phi-3's rotary width, rope scaling) are refused unless they equal the config's: no correct model exists otherwise.
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
from .gguf_tables import GGUF_ARCHITECTURES, TENSOR_NAMES, UNREAD, gguf_config_dict


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
        self._refuse_unread_metadata()
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
        factors = [n for n in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
                   if n in self._tensors]   # llama 3.1's and Phi-3 longrope's per-dimension factors
        if scaling != "none" or factors:
            what = f"rope scaling {scaling!r}" if scaling != "none" else f"per-dimension rope factors ({factors[0]})"
            raise EngineError(f"{self.path} uses {what}, which cannot be recovered from GGUF metadata; convert the "
                              "original Hugging Face model with --model-dir instead")

    def _refuse_unread_metadata(self) -> None:
        """A key the file states that transformers' GGUF config does not read must equal the config's value (its
        class default): otherwise neither a match with transformers nor a correct model exists."""
        hf = {**self._config, "head_dim": self._config["hidden_size"] // self._config["num_attention_heads"]}
        for key, config_key in UNREAD.get(self.architecture, {}).items():
            value, config = self._metadata.get(f"{self.architecture}.{key}"), hf.get(config_key)
            if value is not None and (config is None or not np.isclose(float(value), float(config))):
                raise EngineError(f"{self.path} states {self.architecture}.{key} = {value}, but transformers' GGUF "
                                  f"config has {config_key} = {config} (it reads no GGUF key for it), so the model "
                                  "cannot be recovered from this file; convert the original Hugging Face model with "
                                  "--model-dir instead")

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

    def _map_names(self) -> dict[str, tuple[str, ...]]:
        """HF name -> its GGUF tensors: one, or the parts merged into it (an MoE's gate and up experts), in the
        table's order."""
        table = [(re.compile("^" + re.escape(g).replace(r"\{i\}", r"(\d+)") + "$"), hf)
                 for g, hf in TENSOR_NAMES[self.architecture].items()]
        parts: dict[str, list[tuple[int, str]]] = {}
        for name in self._tensors:
            for order, (pattern, hf) in enumerate(table):
                m = pattern.match(name)
                if m:
                    parts.setdefault(hf.replace("{i}", m.group(1)) if m.groups() else hf, []).append((order, name))
                    break
            else:
                if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)\.\d+\.weight", name):   # older llama.cpp Mixtral files
                    raise EngineError(f"{self.path} stores one tensor per expert ({name}), as llama.cpp's Mixtral "
                                      "files did before the experts were merged; convert the Hugging Face model with "
                                      "--model-dir, or use a GGUF with merged ffn_*_exps tensors")
                raise EngineError(f"tensor {name!r} of {self.path} is not part of a {self.architecture} model as this "
                                  "engine knows it; the file has modules the converter does not support")
        return {hf: tuple(name for _, name in sorted(found)) for hf, found in parts.items()}

    def names(self) -> list[str]:
        return list(self._hf_names)

    def get(self, name: str) -> torch.Tensor | GGUFTensor:
        """The tensor dequantized to float32, or with keep_quantized a kept kind's blocks as they are (GGUFTensor).
        Merged parts (an MoE's gate and up experts, [experts, inter, hidden] each) are concatenated on axis 1, as
        transformers' gate_up_proj holds them."""
        parts = [self._read(self._tensors[gguf_name]) for gguf_name in self._hf_names[name]]
        if len(parts) == 1:
            return parts[0]
        if not all(isinstance(p, torch.Tensor) and p.dim() == 3 for p in parts):
            raise EngineError(f"{self.path}: the parts {', '.join(self._hf_names[name])} of {name} are not all 3-D "
                              "expert tensors; the file is not an MoE model as llama.cpp writes it")
        return torch.cat(parts, dim=1)

    def _read(self, tensor: "_Tensor") -> torch.Tensor | GGUFTensor:
        """One GGUF tensor as get() gives it."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize
        # GGUFReader's layout for a tensor: its bytes as rows of the last dimension; dequantize reads F32/F16 as
        # views of them and unpacks quantized blocks row by row.
        # read, not memory-mapped: a map keeps every page read in the process's RSS until it is closed (a 1.1 GB
        # file converted: 2.46 GB peak), where a read's copy is freed with the tensor
        raw = np.fromfile(self.path, dtype=np.uint8, count=tensor.nbytes, offset=tensor.start)
        raw = raw.reshape(*tensor.shape[:-1], -1)
        kind = _kind_name(tensor.ggml_type)
        order = self._row_order(tensor) if self.keep_quantized and keeps(kind, tensor.shape) else None
        if order is not None:
            return GGUFTensor(kind, raw, tensor.shape[1]).rows(order)
        if self.keep_quantized and kind not in FLOAT_KINDS:
            self.dequantized[tensor.name] = kind
        try:
            qtype = GGMLQuantizationType(tensor.ggml_type)
            values = dequantize(raw, qtype)
        except (NotImplementedError, ValueError) as e:
            raise EngineError(f"cannot dequantize {tensor.name} (ggml type {tensor.ggml_type}) of {self.path}: {e}; "
                              "re-quantize the model with a type gguf can read (F32, F16, Q8_0, Q4_K, ...)") from None
        # transformers' processor: llama's q/k rows back from llama.cpp's rotary order, Gemma's norms less 1
        values = self._processor.process(weights=values, name=tensor.name).weights
        return torch.from_numpy(np.array(values, dtype=np.float32))

    def _row_order(self, tensor: "_Tensor") -> np.ndarray | None:
        """The rows the processor's transform moves a tensor's rows to (llama's q/k un-permutation), found on the
        row numbers so it applies to blocks; None when it changes values (Gemma's norm - 1), not only their order:
        such a tensor is dequantized instead of kept wrong."""
        rows = np.arange(tensor.shape[0])
        moved = np.asarray(self._processor.process(weights=rows[:, None].astype(np.float64), name=tensor.name).weights)
        ok = moved.shape == (len(rows), 1) and np.array_equal(np.sort(moved[:, 0]), rows)   # a permutation of rows
        return moved[:, 0].astype(np.int64) if ok else None

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
