"""Strict parsing of plain data (JSON/TOML) into frozen config dataclasses.

An unknown key is an error with a did-you-mean; a value of the wrong type or outside its
allowed set is an error naming the key, the value and what is allowed. Only ValueError
ever escapes, whatever the input.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin


def parse_dataclass(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        if not prefix:
            raise ValueError(
                f"a config must be a table/object of keys (JSON object, TOML table, dict); "
                f"got {data!r}"
            )
        where = prefix.rstrip(".")
        raise ValueError(f"config key '{where}' must be a table/object; got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = (
                f"; did you mean '{prefix}{close[0]}'?"
                if close
                else (f"; known keys here: {', '.join(names)}")
            )
            raise ValueError(f"unknown config key '{prefix}{key}'{hint}")
        kwargs[key] = _parse_value(hints[key], value, f"{prefix}{key}")
    return cls(**kwargs)


def _parse_value(tp: Any, value: Any, key: str) -> Any:
    origin = get_origin(tp)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return parse_dataclass(tp, value, key + ".")
    if origin is Literal:
        allowed = get_args(tp)
        # bool is an int subclass: True must not pass as stage 1.
        if value in allowed and type(value) is type(allowed[allowed.index(value)]):
            return value
        raise ValueError(
            f"config key '{key}' must be one of {', '.join(map(repr, allowed))}; got {value!r}"
        )
    if origin in (Union, types.UnionType):
        options = [a for a in get_args(tp) if a is not type(None)]
        if value is None:
            return None
        return _parse_value(options[0], value, key)
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"config key '{key}' must be a list; got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_parse_value(args[0], v, key) for v in value)
        if len(value) != len(args):
            raise ValueError(f"config key '{key}' must have {len(args)} items; got {value!r}")
        return tuple(_parse_value(a, v, key) for a, v in zip(args, value, strict=True))
    if origin is dict:
        key_tp, value_tp = get_args(tp)
        if not isinstance(value, dict):
            raise ValueError(f"config key '{key}' must be a table/object; got {value!r}")
        return {
            _parse_value(key_tp, k, key): _parse_value(value_tp, v, f"{key}.{k}")
            for k, v in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValueError(f"config key '{key}' must be true or false; got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError(f"config key '{key}' must be an integer; got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int too large for a float
                number = math.inf
            if math.isfinite(number):
                return number
            raise ValueError(f"config key '{key}' must be a finite number; got {value!r}")
        raise ValueError(f"config key '{key}' must be a number; got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError(f"config key '{key}' must be a string; got {value!r}")
    raise AssertionError(f"unhandled config type {tp!r} for '{key}'")
