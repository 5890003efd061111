"""The server's inference-state file: the responses in flight (and recently finished resumed ones), as versioned
JSON in `--state-dir`, replaced atomically.

    <state-dir>/inference-state.json
    {"format": "engine.inference_state", "format_version": 1, "written_at": 1767225600.0, "model": "smollm2",
     "responses": [{"id": "cmpl-...", "kind": "completion" | "chat", "created": 1767225590,
                    "include_usage": false, "prompt_tokens": 12, "finished_at": null,
                    "choices": [{"index": 0, "request_id": "cmpl-...-0", "echo": null,
                                 "sequence": {<sequence_state.SequenceState.to_json()>} | null,
                                 "result": {"text", "token_ids", "finish_reason", "stop_reason"} | null}]}]}

A choice has `sequence` while it runs (prompt ids, generated ids, sampling params, generator state) and `result`
once finished. The file is written to a temporary sibling, fsynced and renamed over the old one (os.replace),
so a crash at any moment leaves the previous complete file or the new one, never a torn one. JSON, never
pickle: the file is read back by a server, and pickle would run whatever code a damaged file names. A file of
another format_version, another model or damaged JSON is refused with a message saying what to do.

It owns the file format only: one sequence's state is runtime/sequence_state.py, and when to write and what to
do with what is read is resume.py. It knows nothing of HTTP or of the engine.
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from engine.core.errors import EngineError

from ..sequence_state import SequenceState

FORMAT = "engine.inference_state"
FORMAT_VERSION = 1
STATE_FILE = "inference-state.json"


@dataclass(frozen=True)
class FinishedChoice:
    text: str
    token_ids: list[int]
    finish_reason: str
    stop_reason: str | int | None


@dataclass(frozen=True)
class ChoiceState:
    index: int
    request_id: str
    echo: str | None                      # completions with echo: the prompt text the choice's text follows
    sequence: SequenceState | None = None  # while it runs
    result: FinishedChoice | None = None  # once finished

    def __post_init__(self):
        assert (self.sequence is None) != (self.result is None), "a choice either runs or is finished"


@dataclass(frozen=True)
class ResponseState:
    id: str
    kind: str                             # "completion" | "chat"
    created: int
    include_usage: bool
    prompt_tokens: int
    choices: list[ChoiceState]
    finished_at: float | None = None      # wall-clock time when its last choice finished

    def __post_init__(self):
        if self.kind not in ("completion", "chat"):
            raise EngineError(f"response {self.id}: kind {self.kind!r} is not 'completion' or 'chat'")


def state_path(state_dir: Path) -> Path:
    return Path(state_dir) / STATE_FILE


def write_state(state_dir: Path, model: str, responses: list[ResponseState]) -> Path:
    """Atomically replace the state file with these responses."""
    state_dir = Path(state_dir)
    doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "written_at": time.time(), "model": model,
           "responses": [response_to_json(r) for r in responses]}
    data = json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{STATE_FILE}.", suffix=".tmp", dir=state_dir)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, state_path(state_dir))
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(state_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)            # the rename itself survives a power cut
    finally:
        os.close(dir_fd)
    return state_path(state_dir)


def read_state(state_dir: Path, model: str) -> list[ResponseState]:
    """The responses saved in `state_dir` ([] when it holds no state file yet)."""
    path = state_path(state_dir)
    if not path.exists():
        return []
    fix = f"move {path} away to start without the saved requests"
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise EngineError(f"the inference state {path} cannot be read ({e}); {fix}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise EngineError(f"{path} is not an inference-state file (format {FORMAT!r}); {fix}")
    if doc.get("format_version") != FORMAT_VERSION:
        raise EngineError(f"{path} has format_version {doc.get('format_version')!r}, this server reads "
                          f"{FORMAT_VERSION}; resume with the version that wrote it, or {fix}")
    if doc.get("model") != model:
        raise EngineError(f"{path} holds requests for model {doc.get('model')!r}, but this server serves "
                          f"{model!r}; serve that model with this --state-dir, or {fix}")
    try:
        return [response_from_json(r) for r in doc["responses"]]
    except EngineError as e:
        raise EngineError(f"{path}: {e}; {fix}") from None
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        raise EngineError(f"{path} is damaged ({type(e).__name__}: {e}); {fix}") from None


def response_to_json(r: ResponseState) -> dict:
    return {"id": r.id, "kind": r.kind, "created": r.created, "include_usage": r.include_usage,
            "prompt_tokens": r.prompt_tokens, "finished_at": r.finished_at,
            "choices": [{"index": c.index, "request_id": c.request_id, "echo": c.echo,
                         "sequence": c.sequence.to_json() if c.sequence else None,
                         "result": c.result.__dict__ if c.result else None} for c in r.choices]}


def response_from_json(d: dict) -> ResponseState:
    choices = []
    for c in d["choices"]:
        res = c["result"]
        choices.append(ChoiceState(
            index=int(c["index"]), request_id=str(c["request_id"]), echo=c["echo"],
            sequence=SequenceState.from_json(c["sequence"]) if c["sequence"] is not None else None,
            result=FinishedChoice(str(res["text"]), [int(t) for t in res["token_ids"]], str(res["finish_reason"]),
                                  res["stop_reason"]) if res is not None else None))
    return ResponseState(id=str(d["id"]), kind=d["kind"], created=int(d["created"]),
                         include_usage=bool(d["include_usage"]), prompt_tokens=int(d["prompt_tokens"]),
                         choices=choices, finished_at=d["finished_at"])
