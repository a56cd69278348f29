"""Casting to 16-bit float formats with range checks in the same pass."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsync.codecs.ops import native
from gradsync.codecs.ops.backend import compilable

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
    if n == 0:
        return CastStats(0.0, 0, 0)
    if native.usable(x):
        bf16 = dtype == torch.bfloat16
        return CastStats(*native.ext().to_half(native.ptr(x), n, scale, native.ptr(out), out.nbytes, bf16))
    y, st = _cast(x, torch.tensor(scale, dtype=torch.float32, device=x.device), dtype)
    out.view(dtype).copy_(y)
    max_abs, nonfinite, inf = st.tolist()
    return CastStats(max_abs, int(nonfinite), int(not nonfinite and inf))


@compilable
def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The cast and ``[max |x| (NaN ignored), any inf/NaN in x, any inf in the result]``."""
    xf = x.float()
    y = (xf * scale).to(dtype)
    a = xf.abs()
    flags = [torch.where(torch.isnan(a), 0.0, a).amax(), (~torch.isfinite(xf)).any(), torch.isinf(y).any()]
    return y, torch.stack([f.float() for f in flags])


def cast_on_device(
    x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """:func:`cast_checked` with a 0-dim device ``scale`` and its statistics left on the device:
    float32 ``[max |x|, any inf/NaN in x, any inf in the result]``."""
    if dtype not in FORMAT_MAX:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    y, st = _cast(x, scale.float(), dtype)
    out.view(dtype).copy_(y)
    return st


def uncast(
    h: torch.Tensor,
    dtype: torch.dtype,
    scale: float | torch.Tensor,
    out: torch.Tensor,
    accumulate: bool = False,
) -> torch.Tensor:
    """``out (+)= float(h) * scale`` where ``h`` holds ``dtype`` bits (``scale``: a float or a
    0-dim tensor on ``out``'s device)."""
    if isinstance(scale, torch.Tensor):
        v = _uncast(h.view(dtype), scale.float(), out.dtype)
        return out.add_(v) if accumulate else out.copy_(v)
    if native.usable(out) and out.numel() == h.numel():
        bf16 = dtype == torch.bfloat16
        native.ext().from_half(
            native.ptr(h), out.numel(), scale, native.ptr(out), out.nbytes, bf16, accumulate
        )
        return out
    v = _uncast(h.view(dtype), torch.tensor(scale, dtype=torch.float32, device=h.device), out.dtype)
    return out.add_(v) if accumulate else out.copy_(v)


@compilable
def _uncast(h: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (h.float() * scale).to(dtype)
