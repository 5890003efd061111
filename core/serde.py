"""Frozen dataclasses to and from JSON, without hand-written to_dict methods.

`to_json` is dataclasses.asdict with tuples as lists; `from_json` builds a dataclass from a dict, recursing
into nested dataclass fields and `tuple[X, ...]` of dataclasses, and refuses unknown or missing keys so a
manifest written by another version is never half-understood. Every value is checked against its field's type
(an integer field holding "2" or 2.5 is a corrupt file, refused naming the key, not a TypeError deep in a
builder), and the dataclass's own checks (__post_init__) are reported with the file's name.
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


def _item_dataclass(tp: Any) -> type | None:
    """The dataclass X of a `tuple[X, ...]` field (a list of records in JSON), else None."""
    if typing.get_origin(tp) is tuple:
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if len(args) == 1 and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _fits(value: Any, tp: Any) -> bool:
    """Whether `value` (as from_json converts it: lists are tuples) fits the field type `tp`; types this module
    does not know pass."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, a) for a in typing.get_args(tp))
    if origin is typing.Literal:
        return value in typing.get_args(tp)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return isinstance(value, tuple) and (len(args) != 1 or all(_fits(v, args[0]) for v in value))
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if dataclasses.is_dataclass(tp):
        return isinstance(value, tp)
    return True


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if origin in (tuple, list):
        return "a list"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "an object",
             type(None): "null"}
    return names.get(tp, "an object" if dataclasses.is_dataclass(tp) else getattr(tp, "__name__", str(tp)))


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
            item = _item_dataclass(hints[f.name])
            value = tuple(from_json(item, v, where=f"{where}.{f.name}[{i}]") if item is not None else v
                          for i, v in enumerate(value))
        if not _fits(value, hints[f.name]):
            raise EngineError(f"{where}: {f.name} must be {_describe(hints[f.name])}, not "
                              f"{json.dumps(data[f.name])[:80]}; the file is corrupt or was written by another "
                              "version of engine — convert or build it again with this version")
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except EngineError as e:  # the dataclass's own checks: say which file holds the bad value
        raise EngineError(f"{where}: {e}; the file is corrupt — convert or build it again") from None


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
