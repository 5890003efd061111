"""Where HF-named tensors come from: a Hugging Face model directory (safetensors, sharded safetensors with an
index, or pytorch_model*.bin as a fallback). Tensors are read one at a time from memory maps, so converting
never holds the whole source model in memory. A GGUF file is another source (gguf_source.py).
"""
from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Iterator, Protocol

import torch
from safetensors import SafetensorError, safe_open

from engine.core.artifacts import TOKENIZER_FILES
from engine.core.errors import EngineError
from engine.core.manifest import describe, digest_entries
from engine.core.serde import read_json


class TensorSource(Protocol):
    """HF config plus HF-named tensors, read lazily."""
    kind: str
    path: Path

    def hf_config(self) -> dict: ...
    def generation_config(self) -> dict: ...
    def names(self) -> list[str]: ...
    def get(self, name: str) -> torch.Tensor: ...
    def tokenizer_dir(self) -> Path | None: ...
    def digest(self) -> str: ...  # "sha256:<hex>" of what is converted (core/manifest.py)


class HFDirSource:
    kind = "hf"

    def __init__(self, model_dir: Path):
        self.path = Path(model_dir)
        if not self.path.is_dir():
            raise EngineError(f"--model-dir {self.path} is not a directory; pass a Hugging Face model directory",
                              usage=True)
        if not (self.path / "config.json").exists():
            raise EngineError(f"--model-dir {self.path} has no config.json; pass a Hugging Face model directory "
                              "(config.json with *.safetensors or pytorch_model*.bin)")
        self._config = read_json(self.path / "config.json")
        self._files = self._weight_files()
        self._where: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for f in self._files:
            for name in self._open(f).keys():
                if name in self._where:
                    raise EngineError(f"tensor {name} is in both {self._where[name].name} and {f.name}; keep one "
                                      "copy of the weights in the model directory (or add the "
                                      "model.safetensors.index.json that says which files belong to the model)")
                self._where[name] = f

    # ---- files ---------------------------------------------------------------------------------------------

    def _weight_files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise EngineError(f"{index} has no weight_map; the index is corrupt")
            files = sorted({self.path / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise EngineError(f"{index} names shards that are missing: {', '.join(missing)}; download the "
                                  "complete model")
            return files
        single = self.path / "model.safetensors"
        if single.is_file():
            return [single]
        shards = sorted(self.path.glob("*.safetensors"))
        if shards:
            return shards
        bins = sorted(self.path.glob("pytorch_model*.bin"))
        if bins:
            return bins
        raise EngineError(f"no weights in {self.path}: expected model.safetensors, sharded *.safetensors with "
                          "model.safetensors.index.json, or pytorch_model*.bin")

    def _open(self, f: Path):
        if f not in self._handles:
            self._handles[f] = _SafetensorsFile(f) if f.suffix == ".safetensors" else _TorchBinFile(f)
        return self._handles[f]

    # ---- TensorSource ----------------------------------------------------------------------------------------

    def hf_config(self) -> dict:
        return self._config

    def generation_config(self) -> dict:
        path = self.path / "generation_config.json"
        return read_json(path) if path.is_file() else {}

    def names(self) -> list[str]:
        return list(self._where)

    def get(self, name: str) -> torch.Tensor:
        return self._open(self._where[name]).get(name)

    def tokenizer_dir(self) -> Path | None:
        return self.path

    def files(self) -> list[Path]:
        """The files conversion reads: config.json, the weights (and their index), generation and tokenizer files."""
        names = ["config.json", "model.safetensors.index.json", "generation_config.json", *TOKENIZER_FILES]
        return sorted({*self._files, *(p for p in (self.path / n for n in names) if p.is_file())})

    def digest(self) -> str:
        """The sha256 of the canonical list of `files()` with their sizes and sha256s (core/manifest.py)."""
        return digest_entries(describe(self.path, self.files()))


class _SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        try:
            self._f = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError, json.JSONDecodeError) as e:
            raise EngineError(f"cannot read {path}: {e}; the file is truncated or corrupt — download it again") from None

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise EngineError(f"cannot read tensor {name} from {self.path}: {e}; the file is truncated or corrupt "
                              "— download it again") from None


class _TorchBinFile:
    """pytorch_model*.bin, loaded with weights_only=True (no code from the file runs) and memory-mapped."""

    def __init__(self, path: Path):
        self.path = path
        try:
            self._tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # torch raises several types for corrupt zip/pickle data
            # torch's messages span a page of advice; keep what names the problem
            refused = re.search(r"GLOBAL ([\w.]+)", str(e)) if isinstance(e, pickle.UnpicklingError) else None
            if refused:
                raise EngineError(f"{path} is not a weights-only PyTorch checkpoint (it refers to {refused.group(1)}); "
                                  "it is loaded with torch.load(weights_only=True) so that no code in it runs — "
                                  "convert it to safetensors where you trust it, or use the model's *.safetensors"
                                  ) from None
            first = (str(e).strip() or type(e).__name__).splitlines()[0].split(". ")[0]
            raise EngineError(f"cannot read {path}: {first}; the file is truncated or corrupt — download it "
                              "again") from None
        if not isinstance(self._tensors, dict) or not all(isinstance(t, torch.Tensor) for t in self._tensors.values()):
            raise EngineError(f"{path} does not hold a dict of tensors (a state_dict); save the model with "
                              "save_pretrained")

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def iter_tensors(source: TensorSource) -> Iterator[tuple[str, torch.Tensor]]:
    for name in source.names():
        yield name, source.get(name)
