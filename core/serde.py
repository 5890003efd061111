"""Frozen dataclasses to and from JSON, without hand-written to_dict methods.

`to_json` is dataclasses.asdict with tuples as lists; `from_json` builds a dataclass from a dict, recursing
into nested dataclass fields, and refuses unknown or missing keys so a manifest written by another version is
never half-understood.
"""
from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from .errors import EngineError

T = TypeVar("T")


def to_json(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_json(x) for x in obj]
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    return obj


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass type inside `tp` (itself, or X in `X | None`)."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if dataclasses.is_dataclass(arg):
                return arg
    return None


def from_json(cls: type[T], data: dict, *, where: str) -> T:
    if not isinstance(data, dict):
        raise EngineError(f"{where}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise EngineError(f"{where}: unknown keys {unknown}; it was written by another version of engine — "
                          "convert or build it again with this version")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise EngineError(f"{where}: missing key {f.name!r}")
            continue
        value = data[f.name]
        inner = _dataclass_in(hints[f.name])
        if inner is not None and isinstance(value, dict):
            value = from_json(inner, value, where=f"{where}.{f.name}")
        elif isinstance(value, list):
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def write_json(path: Path, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(to_json(obj), f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_json(path: Path) -> dict:
    """The JSON object in `path`; anything else (missing, unreadable, not JSON, not an object) is an EngineError."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise EngineError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise EngineError(f"{path} is a directory, not a JSON file") from None
    except OSError as e:
        raise EngineError(f"cannot read {path}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise EngineError(f"{path} is not UTF-8 text; the file is corrupt") from None
    except json.JSONDecodeError as e:
        raise EngineError(f"{path} is not valid JSON ({e}); the file is corrupt or truncated") from None
    if not isinstance(data, dict):
        raise EngineError(f"{path} holds a JSON {type(data).__name__}, not an object; the file is corrupt")
    return data
