"""Readers of the profile document's JSON fields, and the dtype spelling profiles use.

Each reader checks one field's type and, when it is wrong, raises ``ValueError`` naming the field
by its path in the document (``parameters[3].ready.median``). :mod:`gradsync.observe.profile_format`
uses them to parse and validate a profile.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

# --------------------------------------------------------------------------- JSON field helpers


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def read_mapping(d: Any, where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"profile field {where!r}: expected an object, got {type(d).__name__}")
    return d


def read_field(d: dict[str, Any], key: str, where: str) -> Any:
    name = f"{where}.{key}" if where else key
    if key not in d:
        raise ValueError(f"profile field {name!r} is missing")
    return d[key]


def no_extra_keys(d: dict[str, Any], known: Iterable[str], where: str) -> None:
    extra = sorted(set(d) - set(known))
    if extra:
        raise ValueError(
            f"profile field {where!r}: unknown field(s) {', '.join(extra)} (written by a newer format?)"
        )


def read_number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"profile field {where!r}: expected a finite number, got {v!r}")
    return float(v)


def read_count(v: Any, where: str) -> int:
    if not is_int(v) or v < 0:
        raise ValueError(f"profile field {where!r}: expected an integer >= 0, got {v!r}")
    return int(v)


def read_string(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"profile field {where!r}: expected a string, got {v!r}")
    return v


def read_boolean(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"profile field {where!r}: expected true or false, got {v!r}")
    return v


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, the spelling profiles use."""
    return str(dtype).removeprefix("torch.")


def itemsize_of(name: str, where: str) -> int:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"profile field {where!r}: unknown dtype {name!r}")
    return dtype.itemsize
