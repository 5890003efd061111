"""The inference-state file (runtime/server/state_file.py): round trip, atomic replacement, and refusals of files it
must not trust (another version, another model, damaged JSON or values)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from engine.core.errors import EngineError
from engine.runtime import SamplingParams
from engine.runtime.sequence_state import SequenceState
from engine.runtime.server.state_file import (ChoiceState, FinishedChoice, ResponseState, read_state, state_path,
                                              write_state)


def responses() -> list[ResponseState]:
    rng = np.random.default_rng(5)
    rng.random(3)
    running = SequenceState("cmpl-a-0", [5, 6, 7], [8, 9], 20, 0,
                            SamplingParams(temperature=0.7, seed=5, stop=["\n\n"], max_tokens=20),
                            rng.bit_generator.state)
    return [
        ResponseState("cmpl-a", "completion", 1700000000, True, 3,
                      [ChoiceState(0, "cmpl-a-0", "echoed é", sequence=running),
                       ChoiceState(1, "cmpl-a-1", "echoed é", result=FinishedChoice("done ✓", [4, 2], "stop", "\n"))]),
        ResponseState("chatcmpl-b", "chat", 1700000001, False, 9,
                      [ChoiceState(0, "chatcmpl-b-0", None, result=FinishedChoice("x", [1], "length", None))],
                      finished_at=1700000005.5),
    ]


def test_round_trip(tmp_path):
    saved = responses()
    path = write_state(tmp_path, "tiny", saved)
    assert path == state_path(tmp_path)
    assert read_state(tmp_path, "tiny") == saved
    doc = json.loads(path.read_text())
    assert doc["format"] == "engine.inference_state" and doc["format_version"] == 1
    # the generator state survives JSON exactly (128-bit integers)
    restored = np.random.default_rng()
    restored.bit_generator.state = read_state(tmp_path, "tiny")[0].choices[0].sequence.rng_state
    expected = np.random.default_rng(5)
    expected.random(3)
    assert restored.random() == expected.random()


def test_replace_is_atomic_and_leaves_no_temporaries(tmp_path):
    write_state(tmp_path, "tiny", responses())
    write_state(tmp_path, "tiny", [])
    assert read_state(tmp_path, "tiny") == []
    assert [p.name for p in tmp_path.iterdir()] == ["inference-state.json"]


def test_missing_file_is_no_state(tmp_path):
    assert read_state(tmp_path, "tiny") == []


@pytest.mark.parametrize("damage, message", [
    (lambda d: "{not json", "cannot be read"),
    (lambda d: json.dumps({**d, "format": "pickle"}), "not an inference-state file"),
    (lambda d: json.dumps({**d, "format_version": 2}), "format_version 2"),
    (lambda d: json.dumps({**d, "model": "other"}), "model 'other'"),
    (lambda d: json.dumps({**d, "responses": [{"id": "x"}]}), "damaged"),
    (lambda d: json.dumps({**d, "responses": [{**d["responses"][0], "kind": "embedding"}]}), "kind 'embedding'"),
])
def test_refuses_untrusted_files(tmp_path, damage, message):
    write_state(tmp_path, "tiny", responses())
    doc = json.loads(state_path(tmp_path).read_text())
    state_path(tmp_path).write_text(damage(doc))
    with pytest.raises(EngineError, match=message) as e:
        read_state(tmp_path, "tiny")
    assert "move" in str(e.value)           # says how to start anyway
