"""The session's tiny engines (tests/builder/engines.py), shared by every test of this folder."""
from __future__ import annotations

import pytest

from tests.builder.engines import TinyEngines


@pytest.fixture(scope="session")
def tiny(tmp_path_factory) -> TinyEngines:
    return TinyEngines(tmp_path_factory.mktemp("tiny_engines"))
