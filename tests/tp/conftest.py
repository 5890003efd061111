"""The session's tiny engines (tests/builder/engines.py) for the tensor-parallel tests."""
from __future__ import annotations

import pytest

from tests.builder.engines import TinyEngines


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyEngines:
    return TinyEngines(tmp_path_factory.mktemp("tp_tiny_engines"))
