"""JSON encoding of domain dataclasses for storage.

One generic, type-hint-driven codec instead of a hand-written ``to_dict``/``from_dict`` per class: a new
field on a domain class is stored and loaded without touching this module. Unknown keys are ignored on
load so that an older reader tolerates records written by a newer writer.

Speed: a scheduling round encodes and decodes thousands of records, so the reflection (``fields()``,
``get_type_hints``, ``get_origin``) is done once per type: one encoder and one decoder closure is compiled
per dataclass from its type hints. The output is the same as a plain reflective walk over the values
(``tests/unit/test_domain.py`` checks it against one).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import operator
import types
import typing
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

_SCALARS = (str, int, float, bool, type(None))


def to_jsonable(value: Any) -> Any:
    """Turn a domain value (dataclass, enum, tuple...) into JSON-compatible data."""
    cls = type(value)
    if cls in _SCALARS:
        return value
    if dataclasses.is_dataclass(cls):
        return _encoder(cls)(value)
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [to_jsonable(v) for v in value]
    return value


def _enum_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else to_jsonable(value)


@functools.cache
def _field_encoder(tp: Any) -> Callable[[Any], Any] | None:
    """The encoder of a field annotated ``tp``; None = the value is stored as it is (str, int, float, bool)."""
    if tp in _SCALARS:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args: Sequence[Any] = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) != 1:
            return to_jsonable
        inner = _field_encoder(args[0])
        return None if inner is None else (lambda v: None if v is None else inner(v))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            item = _field_encoder(args[0])
            return list if item is None else (lambda v: [item(x) for x in v])
        items = tuple(_field_encoder(a) for a in args)
        if all(i is None for i in items):
            return list
        return to_jsonable
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return to_jsonable  # the value may be a subclass: dispatch on its own type
    return to_jsonable


@functools.cache
def _encoder(cls: type) -> Callable[[Any], dict[str, Any]]:
    """Dataclass -> dict of JSON-compatible values, compiled once per class from its type hints."""
    hints = _hints(cls)
    names = tuple(f.name for f in dataclasses.fields(cls))
    convs = tuple(_field_encoder(hints[n]) for n in names)
    if not names:
        return lambda value: {}
    get = operator.attrgetter(*names)
    if len(names) == 1:
        (name,), (conv,) = names, convs
        return lambda value: {name: get(value) if conv is None else conv(get(value))}
    pairs = tuple(zip(names, convs, strict=True))

    def encode(value: Any) -> dict[str, Any]:
        return {n: v if c is None else c(v) for (n, c), v in zip(pairs, get(value))}

    return encode


_ENCODER = json.JSONEncoder(separators=(",", ":"), sort_keys=True, allow_nan=False)


def dumps(value: Any) -> str:
    """Compact, key-sorted JSON of a domain value (stable bytes for equal values)."""
    return _ENCODER.encode(to_jsonable(value))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _identity(data: Any) -> Any:
    return data


def _to_float(data: Any) -> Any:
    return float(data) if isinstance(data, int) else data


@functools.cache
def _decoder(tp: Any) -> Callable[[Any], Any]:
    """A function rebuilding a value of annotation ``tp`` from JSON data (compiled once per annotation)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(tp) if a is not type(None)]
        dec = _decoder(inner)
        return lambda data: None if data is None else dec(data)
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            item = _decoder(args[0])
            if item is _identity:
                return tuple
            return lambda data: tuple([item(v) for v in data])
        decs = tuple(_decoder(a) for a in args)
        return lambda data: tuple([d(v) for d, v in zip(decs, data, strict=True)])
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = _hints(tp)
        fields = tuple((f.name, _decoder(hints[f.name])) for f in dataclasses.fields(tp))

        def dataclass_decoder(data: Any) -> Any:
            return tp(**{name: dec(data[name]) for name, dec in fields if name in data})

        return dataclass_decoder
    if tp is float:
        return _to_float
    return _identity


def from_jsonable(tp: Any, data: Any) -> Any:
    """Rebuild a value of type ``tp`` from JSON-compatible ``data``."""
    return _decoder(tp)(data)


_json_loads = json.loads


def loads(cls: type[T], text: str | bytes) -> T:
    """Parse JSON written by ``dumps`` into an instance of ``cls``."""
    return _decoder(typing.cast(Hashable, cls))(_json_loads(text))
