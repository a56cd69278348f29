"""Quantities written on command lines and in files: rates, durations and sizes, each parsed
in one place into one unit, with an error that names the option and shows what it takes.

- rates -> bytes per second: ``100mbit``, ``25gbit``, ``800kbit``, ``64bit`` (bits per second,
  as ``tc`` writes them) or ``12GB/s``, ``900MB/s``, ``5kB/s``, ``80B/s`` (bytes per second).
  ``tc_units=True`` takes only ``gbit``, ``mbit`` and ``kbit``: the emulated cluster hands the
  text to ``tc`` as it is.
- durations -> seconds: ``20us``, ``1.5ms``, ``2s``, ``100ns``.
- sizes -> bytes: ``512m``, ``4g``, ``123456`` (binary multiples: ``k`` is 1024).
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_duration", "parse_rate", "parse_size", "rate_text"]

_NUMBER = r"([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)"
_RATE = re.compile(rf"^\s*{_NUMBER}\s*(gbit|mbit|kbit|bit|gb/s|mb/s|kb/s|b/s)\s*$")
_RATE_UNITS = {  # bytes per second per unit
    "gbit": 1e9 / 8, "mbit": 1e6 / 8, "kbit": 1e3 / 8, "bit": 1 / 8,
    "gb/s": 1e9, "mb/s": 1e6, "kb/s": 1e3, "b/s": 1.0,
}  # fmt: skip
_TC_UNITS = ("gbit", "mbit", "kbit")
_DURATION = re.compile(rf"^\s*{_NUMBER}\s*(ns|us|ms|s)\s*$")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_rate(text: str, option: str, *, tc_units: bool = False) -> float:
    """A rate -> bytes per second (see the module); ``ValueError`` naming ``option`` for anything
    else, zero and negative rates included."""
    m = _RATE.match(text.lower()) if isinstance(text, str) else None
    if not m or float(m.group(1)) <= 0 or (tc_units and m.group(2) not in _TC_UNITS):
        like = "100mbit or 1gbit (gbit, mbit or kbit)" if tc_units else "25gbit, 100mbit or 12GB/s"
        raise ValueError(f"{option} must be a positive rate like {like}, got {text!r}")
    return float(m.group(1)) * _RATE_UNITS[m.group(2)]


def parse_duration(text: str, option: str) -> float:
    """A duration -> seconds; ``ValueError`` naming ``option`` for anything else."""
    m = _DURATION.match(text.lower()) if isinstance(text, str) else None
    if not m:
        raise ValueError(f"{option} must be a duration like 20us, 1.5ms or 0s, got {text!r}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_size(text: str, option: str, words: tuple[str, ...] = ()) -> int | str:
    """A byte count such as ``512m``, ``4g`` or ``123456`` -> bytes, or one of ``words`` as it is;
    ``ValueError`` naming ``option`` for anything else."""
    raw = str(text).strip().lower()
    if raw in words:
        return raw
    unit = raw[-1:] if raw[-1:] in _SIZE_UNITS else ""
    try:
        value = float(raw[: len(raw) - len(unit)])
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0) or int(value * _SIZE_UNITS[unit]) < 1:
        alternatives = f", or {' or '.join(words)}" if words else ""
        raise ValueError(
            f"{option} must be a size such as 512m, 4g or a number of bytes{alternatives}; got {text!r}"
        )
    return int(value * _SIZE_UNITS[unit])


def rate_text(bytes_per_s: float) -> str:
    """12.5e6 -> ``100mbit``; 3.125e9 -> ``25gbit`` (for tables and plots)."""
    bits = bytes_per_s * 8
    for unit, mult in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= mult:
            return f"{bits / mult:g}{unit}"
    return f"{bits:g}bit"
