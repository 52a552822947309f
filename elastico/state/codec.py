"""JSON encoding of domain dataclasses for storage.

One generic, type-hint-driven codec instead of a hand-written ``to_dict``/``from_dict`` per class: a new
field on a domain class is stored and loaded without touching this module. Unknown keys are ignored on
load so that an older reader tolerates records written by a newer writer.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def to_jsonable(value: Any) -> Any:
    """Turn a domain value (dataclass, enum, tuple...) into JSON-compatible data."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [to_jsonable(v) for v in value]
    return value


def dumps(value: Any) -> str:
    """Compact, key-sorted JSON of a domain value (stable bytes for equal values)."""
    return json.dumps(to_jsonable(value), separators=(",", ":"), sort_keys=True, allow_nan=False)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_jsonable(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` from JSON-compatible ``data``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        return from_jsonable(inner, data)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(from_jsonable(args[0], v) for v in data)
        return tuple(from_jsonable(a, v) for a, v in zip(args, data, strict=True))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(data)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        kwargs = {f.name: from_jsonable(hints[f.name], data[f.name]) for f in dataclasses.fields(tp) if f.name in data}
        return tp(**kwargs)
    if tp is float and isinstance(data, int):
        return float(data)
    return data


def loads(cls: type[T], text: str | bytes) -> T:
    """Parse JSON written by ``dumps`` into an instance of ``cls``."""
    return from_jsonable(cls, json.loads(text))
