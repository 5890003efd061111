"""Tiny models, checkpoints and engines for the quantization tests (tests/builder/engines.py), per session."""
from __future__ import annotations

import pytest

from tests.builder.engines import TinyEngines


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyEngines:
    return TinyEngines(tmp_path_factory.mktemp("tiny_quant_engines"))
