"""Casting to 16-bit float formats with range checks in the same pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsync.codecs.ops import native

FORMAT_MAX = {torch.float16: 65504.0, torch.bfloat16: 3.3895313892515355e38}


@dataclass(frozen=True)
class CastStats:
    """What a checked cast saw: the largest input magnitude, whether any input was inf/NaN, and
    whether any finite input overflowed the format (each flag is 0 or 1; ``overflow`` is only
    reported for inputs without inf/NaN, which are flagged as such anyway)."""

    max_abs: float
    nonfinite: int
    overflow: int


def cast_checked(x: torch.Tensor, dtype: torch.dtype, scale: float, out: torch.Tensor) -> CastStats:
    """``out = dtype(x * scale)`` (round to nearest even) and the statistics of the cast.

    ``out`` is a 16-bit tensor (any 2-byte dtype; its bits are written). ``overflow`` says that a
    finite input became inf, so a caller never ships a silent inf.
    """
    if dtype not in FORMAT_MAX:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    n = x.numel()
    if native.usable(x):
        return CastStats(
            *native.ext().to_half(native.ptr(x), n, scale, native.ptr(out), dtype == torch.bfloat16)
        )
    xf = x.float()
    y = (xf * scale).to(dtype)
    out.view(dtype).copy_(y)
    finite = torch.isfinite(xf)
    a = xf.abs()
    max_abs = float(torch.where(torch.isnan(a), 0.0, a).max()) if n else 0.0
    nonfinite = int(not bool(finite.all()))
    overflow = int(not nonfinite and bool(torch.isinf(y).any()))
    return CastStats(max_abs, nonfinite, overflow)


def uncast(
    h: torch.Tensor, dtype: torch.dtype, scale: float, out: torch.Tensor, accumulate: bool = False
) -> torch.Tensor:
    """``out (+)= float(h) * scale`` where ``h`` holds ``dtype`` bits."""
    if native.usable(out) and out.numel() == h.numel():
        native.ext().from_half(
            native.ptr(h), out.numel(), scale, native.ptr(out), dtype == torch.bfloat16, accumulate
        )
        return out
    v = h.view(dtype).to(out.dtype) * scale
    return out.add_(v) if accumulate else out.copy_(v)
