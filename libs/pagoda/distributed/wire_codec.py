"""A typed codec for what the ranks of a worker group send each other - never pickle.

A rank's control socket is reachable by whoever reaches its host, and unpickling
runs any code a payload names. So a message is JSON text whose shape is dictated
by the *receiver's* declared type: `decode(data, SchedulerOutput)` builds a
SchedulerOutput from the fields that class declares and nothing else, and refuses
(`WireError`) anything that does not fit. The types a message may contain:

    None, bool, int, float (NaN and +-inf kept), str, bytes (base64)
    enum.Enum members (by value)
    list[T], set[T], frozenset[T], tuple[T, ...], tuple[A, B, ...], dict[K, V] (as pairs)
    dataclasses (by field name; field types from their annotations, so a new field of a
        supported type needs no code here)
    numpy arrays (dtype from a fixed list, shape, raw bytes)
    A | None, and other unions (tagged with the member's position)
    bare `dict` / `list` / `Any`: plain JSON values only (str keys, no objects)

Invariant: `decode(encode(v, T), T) == v` for every value of a supported type, and
`decode` of anything else raises WireError without constructing an object of a type
`T` does not name.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import math
import types
import typing
from typing import Any

import numpy as np

# Arrays a plan carries (the grammar bitmask) and nothing wider: no object arrays.
_DTYPES = frozenset({"bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32",
                     "float64"})
_HINTS: dict[type, dict[str, Any]] = {}


class WireError(ValueError):
    """A message that does not have the shape its type declares."""


def encode(value: Any, tp: Any) -> bytes:
    return dump(to_json(value, tp))


def decode(data: bytes, tp: Any) -> Any:
    return from_json(load(data), tp)


def dump(raw: Any) -> bytes:
    """JSON text of an encoded value (or of a structure of them)."""
    return json.dumps(raw, separators=(",", ":")).encode()


def load(data: bytes) -> Any:
    """The JSON structure in `data`; WireError if it is not JSON."""
    try:
        return json.loads(data.decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise WireError(f"not a message: {exc}") from None


def to_json(value: Any, tp: Any) -> Any:
    """`value`, a `tp`, as a JSON structure."""
    return _to_json(value, tp)


def from_json(raw: Any, tp: Any) -> Any:
    """The `tp` that `raw` encodes; WireError if it encodes none."""
    return _from_json(raw, tp)


# ---------------------------------------------------------------- encode
def _to_json(value: Any, tp: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp in (dict, list):
        return _plain_json(value)
    if _is_union(tp):
        members = [a for a in args if a is not type(None)]
        if value is None:
            return None
        if len(members) == 1:
            return _to_json(value, members[0])
        for i, member in enumerate(members):
            if _instance_of(value, member):
                return [i, _to_json(value, member)]
        raise WireError(f"{type(value).__name__} is none of {tp}")
    if value is None:
        raise WireError(f"None where {tp} is declared")
    if tp in (bool, int, str):
        if type(value) is not tp and not (tp is int and isinstance(value, np.integer)):
            raise WireError(f"{type(value).__name__} where {tp.__name__} is declared")
        return tp(value)
    if tp is float:
        return _float_to_json(value)
    if tp is bytes:
        return base64.b64encode(bytes(value)).decode()
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _to_json(tp(value).value, type(tp(value).value))
    if tp is np.ndarray:
        array = np.ascontiguousarray(value)
        return {"dtype": str(array.dtype), "shape": list(array.shape),
                "data": base64.b64encode(array.tobytes()).decode()}
    if origin in (list, set, frozenset):
        return [_to_json(v, args[0]) for v in value]
    if origin is tuple:
        return [_to_json(v, t) for v, t in zip(value, _tuple_types(args, len(value)), strict=True)]
    if origin is dict:
        return [[_to_json(k, args[0]), _to_json(v, args[1])] for k, v in value.items()]
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, tp):
            raise WireError(f"{type(value).__name__} where {tp.__name__} is declared")
        hints = _hints(tp)
        return {f.name: _to_json(getattr(value, f.name), hints[f.name])
                for f in dataclasses.fields(tp)}
    raise WireError(f"type {tp!r} cannot travel")


def _float_to_json(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
        raise WireError(f"{type(value).__name__} where float is declared")
    value = float(value)
    return value if math.isfinite(value) else {"nan": "nan", "inf": "inf",
                                                "-inf": "-inf"}[str(value)]


def _plain_json(value: Any) -> Any:
    if value is None or type(value) in (bool, int, str):
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise WireError("a JSON value cannot be NaN or infinite")
        return value
    if isinstance(value, (list, tuple)):
        return [_plain_json(v) for v in value]
    if isinstance(value, dict) and all(type(k) is str for k in value):
        return {k: _plain_json(v) for k, v in value.items()}
    raise WireError(f"{type(value).__name__} is not a JSON value")


# ---------------------------------------------------------------- decode
def _from_json(raw: Any, tp: Any) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp in (dict, list):
        if tp in (dict, list) and not isinstance(raw, tp):
            raise WireError(f"{type(raw).__name__} where a JSON {tp.__name__} is declared")
        return _plain_json(raw)
    if _is_union(tp):
        members = [a for a in args if a is not type(None)]
        if raw is None:
            if type(None) not in args:
                raise WireError(f"null where {tp} is declared")
            return None
        if len(members) == 1:
            return _from_json(raw, members[0])
        if not (isinstance(raw, list) and len(raw) == 2 and type(raw[0]) is int
                and 0 <= raw[0] < len(members)):
            raise WireError(f"an untagged value where {tp} is declared")
        return _from_json(raw[1], members[raw[0]])
    if tp in (bool, int, str):
        if type(raw) is not tp:
            raise WireError(f"{type(raw).__name__} where {tp.__name__} is declared")
        return raw
    if tp is float:
        if isinstance(raw, str) and raw in ("nan", "inf", "-inf"):
            return float(raw)
        if isinstance(raw, bool) or not isinstance(raw, (int, float)):
            raise WireError(f"{type(raw).__name__} where float is declared")
        return float(raw)
    if tp is bytes:
        return _b64(raw)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(raw)
        except ValueError:
            raise WireError(f"{raw!r} is no {tp.__name__}") from None
    if tp is np.ndarray:
        return _array(raw)
    if origin in (list, set, frozenset, tuple, dict) and not isinstance(raw, list):
        raise WireError(f"{type(raw).__name__} where {tp} is declared")
    if origin in (list, set, frozenset):
        return origin(_from_json(v, args[0]) for v in raw)
    if origin is tuple:
        return tuple(_from_json(v, t) for v, t in zip(raw, _tuple_types(args, len(raw))))
    if origin is dict:
        if not all(isinstance(p, list) and len(p) == 2 for p in raw):
            raise WireError(f"a dict of {tp} must be key-value pairs")
        return {_from_json(k, args[0]): _from_json(v, args[1]) for k, v in raw}
    if dataclasses.is_dataclass(tp):
        return _dataclass(raw, tp)
    raise WireError(f"type {tp!r} cannot travel")


def _dataclass(raw: Any, tp: type) -> Any:
    fields = {f.name: f for f in dataclasses.fields(tp)}
    if not isinstance(raw, dict) or set(raw) != set(fields):
        raise WireError(f"{tp.__name__} needs exactly the fields {sorted(fields)}")
    hints = _hints(tp)
    values = {name: _from_json(raw[name], hints[name]) for name in fields}
    init = {n: v for n, v in values.items() if fields[n].init}
    try:
        obj = tp(**init)
    except (TypeError, ValueError) as exc:
        raise WireError(f"{tp.__name__}: {exc}") from None
    for name, value in values.items():
        if not fields[name].init:
            object.__setattr__(obj, name, value)
    return obj


def _array(raw: Any) -> np.ndarray:
    if not (isinstance(raw, dict) and set(raw) == {"dtype", "shape", "data"}
            and raw["dtype"] in _DTYPES and isinstance(raw["shape"], list)
            and all(type(d) is int and d >= 0 for d in raw["shape"])):
        raise WireError("an array needs a known dtype, a shape and its data")
    data = _b64(raw["data"])
    dtype = np.dtype(raw["dtype"])
    if len(data) != dtype.itemsize * math.prod(raw["shape"]):
        raise WireError("an array's data does not match its shape")
    return np.frombuffer(data, dtype=dtype).reshape(raw["shape"]).copy()


def _b64(raw: Any) -> bytes:
    if not isinstance(raw, str):
        raise WireError("bytes travel as base64 text")
    try:
        return base64.b64decode(raw, validate=True)
    except ValueError:
        raise WireError("bytes travel as base64 text") from None


# ---------------------------------------------------------------- types
def _hints(tp: type) -> dict[str, Any]:
    """A dataclass's field types (names only imported for type checking resolve too)."""
    if tp not in _HINTS:
        _HINTS[tp] = typing.get_type_hints(tp, localns={"np": np, "numpy": np})
    return _HINTS[tp]


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _tuple_types(args: tuple, n: int) -> tuple:
    if len(args) == 2 and args[1] is Ellipsis:
        return (args[0],) * n
    if len(args) != n:
        raise WireError(f"a tuple of {len(args)} items has {n}")
    return args


def _instance_of(value: Any, tp: Any) -> bool:
    """Whether `value` is a `tp` (for picking a union's member while encoding)."""
    origin = typing.get_origin(tp) or tp
    if tp is Any:
        return True
    if tp is bool:
        return type(value) is bool
    if tp is int:
        return type(value) is int or isinstance(value, np.integer)
    if tp is float:
        return isinstance(value, (int, float, np.floating)) and not isinstance(value, bool)
    return isinstance(origin, type) and isinstance(value, origin)
