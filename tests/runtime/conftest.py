"""Shared fixtures of the runtime tests: tokenizer directories (no model needed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runtime.tiny_engine import build_tiny_engine
from tests.tiny_models import make_tokenizer


@pytest.fixture(scope="session")
def tiny_tok_dir(tmp_path_factory) -> Path:
    """The tiny BPE tokenizer of tests/tiny_models.py, with its chat template."""
    d = tmp_path_factory.mktemp("tiny_tok")
    make_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def byte_tok_dir(tmp_path_factory) -> Path:
    """A byte-level tokenizer with no merges: every UTF-8 byte is its own token, so every multibyte character
    is split across tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    d = tmp_path_factory.mktemp("byte_tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + 2, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=alphabet)
    tok.train_from_iterator(["a"], trainer=trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return d


@pytest.fixture(scope="session")
def tiny_engine(tmp_path_factory) -> tuple[Path, Path]:
    """(hf_dir, engine_dir) of the tiny Llama, built with TINY_BUILD."""
    return build_tiny_engine(tmp_path_factory.mktemp("tiny_engine"))
