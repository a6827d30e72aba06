"""Strict loading shared by every config dataclass of the package: field checks and overlays.

:func:`require` states a constraint in a dataclass's ``__post_init__``; :func:`overlay` applies a
mapping to a dataclass strictly (unknown keys and mistyped values raise ``ValueError`` naming
the dotted path, with a did-you-mean). The YAML key of a field whose Python name ends in ``_``
drops the underscore (``metadata={"key": ...}``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import reprlib
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

__all__ = ["require", "overlay", "to_dict", "check_layers", "show", "MAX_SHOWN"]

MAX_SHOWN = 120
"""Most characters of a value (or key) quoted in an error message."""

_REPR = reprlib.Repr()  # Python 3.11's Repr takes no keyword arguments
for _name, _limit in (("maxlevel", 3), ("maxdict", 4), ("maxlist", 6), ("maxtuple", 6),
                      ("maxset", 6), ("maxstring", 60), ("maxother", 60), ("maxlong", 40)):
    setattr(_REPR, _name, _limit)



MOVED = {"mechmon.fp8.attn_logits": "mechmon.qk.max_logit (the max logits are attention signals)"}
"""Keys a release moved: the error names the new place instead of a close match."""

def show(value: Any) -> str:
    """``repr(value)`` cut to at most :data:`MAX_SHOWN` characters (nested containers, long
    strings and huge integers abridged with ``...``), so that no message grows with its input:
    a YAML alias bomb would otherwise repr to megabytes."""
    try:
        text = _REPR.repr(value)
    except (ValueError, RecursionError):  # an int beyond str()'s digit limit
        text = f"<{type(value).__name__}>"
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


class _FieldError(ValueError):
    """A constraint on one field (path relative to the dataclass that raised it) failed."""

    def __init__(self, field_path: str, value: Any, allowed: str) -> None:
        super().__init__(f"{field_path}: invalid value {show(value)}; allowed: {allowed}")
        self.field_path = field_path
        self.value = value
        self.allowed = allowed


def require(ok: bool, field_path: str, value: Any, allowed: str) -> None:
    """Raise ``ValueError("<field_path>: invalid value <value>; allowed: <allowed>")`` unless ok.

    For ``__post_init__`` checks of any strict config dataclass (trainer, faults, mechmon).
    """
    if not ok:
        raise _FieldError(field_path, value, allowed)


def check_layers(layers: str | list[int]) -> None:
    """``layers`` is ``'all'`` or a list of global 1-based layer numbers."""
    require(
        layers == "all" or (isinstance(layers, list) and all(v >= 1 for v in layers)),
        "layers",
        layers,
        "'all' or a list of global 1-based layer numbers (>= 1)",
    )



def _key_text(key: Any) -> str:
    """A mapping key as it appears in a dotted path (cut like :func:`show`)."""
    text = key if isinstance(key, str) else show(key)
    return text if len(text) <= MAX_SHOWN else text[:MAX_SHOWN - 3] + "..."


def _key(f: dataclasses.Field) -> str:
    return f.metadata.get("key", f.name)


def to_dict(obj: Any) -> Any:
    """Plain nested dicts/lists of a dataclass, with YAML keys."""
    if dataclasses.is_dataclass(obj):
        return {_key(f): to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if origin is list:
        return f"a list of ({_describe(args[0])})"
    if origin is dict:
        return f"a mapping of string to ({_describe(args[1])})"
    names = {bool: "a boolean", int: "an integer", float: "a finite number", str: "a string"}
    return names.get(tp, "null" if tp is type(None) else "a mapping")


def _convert(tp: Any, value: Any, default: Any, path: str) -> Any:
    """Check ``value`` against type ``tp``; nested dataclasses overlay on ``default``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in (a for a in args if a is not type(None)):
            try:
                return _convert(arg, value, default, path)
            except _Mismatch:
                continue
        raise _Mismatch(path, value, _describe(tp))
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
    elif origin is list:
        if isinstance(value, list):
            return [_convert(args[0], v, None, f"{path}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
            return {k: _convert(args[1], v, None, f"{path}.{_key_text(k)}")
                    for k, v in value.items()}
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, Mapping):
            return overlay(default if default is not None else tp(), value, path)
    elif tp is float:
        # NaN and +-inf are refused everywhere: a comparison with NaN is false, so a NaN
        # threshold or bound silently switches its rule off, and so does an infinite one.
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value) if abs(value) < 1e308 else math.inf
        elif isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and math.isfinite(number):
            return number
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise _Mismatch(path, value, _describe(tp))


class _Mismatch(ValueError):
    def __init__(self, path: str, value: Any, allowed: str) -> None:
        super().__init__(f"{path}: invalid value {show(value)}; allowed: {allowed}")


def overlay(base: Any, data: Any, path: str) -> Any:
    """A copy of dataclass ``base`` with the entries of mapping ``data`` applied, strictly.

    Unknown keys raise with the dotted path under ``path`` and a close-match suggestion; values
    are checked against the field types. Shared by every strict config of the package.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: invalid value {show(data)}; allowed: a mapping")
    fields = {_key(f): f for f in dataclasses.fields(base)}
    hints = typing.get_type_hints(type(base))
    changes = {}
    for key, value in data.items():
        f = fields.get(key)
        if f is None:
            name = _key_text(key)
            close = difflib.get_close_matches(name, list(fields), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known keys: {', '.join(fields)}"
            moved = MOVED.get(f"{path}.{name}")
            raise ValueError(f"{path}.{name}: unknown key; "
                             f"{f'it moved to {moved}' if moved else hint}")
        changes[f.name] = _convert(hints[f.name], value, getattr(base, f.name), f"{path}.{key}")
    try:
        return dataclasses.replace(base, **changes)
    except _FieldError as err:
        raise ValueError(f"{path}.{err}") from None

