"""Reductions over a whole tensor in one pass, accumulated in at least float32.

``tensor_stats`` is what every codec calls first (or gets fused into its main pass): the mean
and maximum magnitude drive the threshold searches, the sum of squares gives norms, and the
non-finite count is how a codec reports an inf/NaN gradient instead of hiding it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradsync.codecs.ops import native
from gradsync.codecs.ops.backend import compilable


@dataclass(frozen=True)
class TensorStats:
    """Magnitude statistics of a tensor.

    ``nonfinite`` is non-zero when any element is inf or NaN (a count or, from fused passes, 1).
    ``max_abs`` is only meaningful when ``nonfinite`` is 0. ``sum_abs`` / ``sum_sq`` are NaN
    when the pass that produced the stats did not compute them.
    """

    numel: int
    sum_abs: float
    max_abs: float
    nonfinite: int
    sum_sq: float = math.nan

    @property
    def mean_abs(self) -> float:
        return self.sum_abs / self.numel if self.numel else 0.0

    @property
    def norm(self) -> float:
        return math.sqrt(self.sum_sq) if self.sum_sq >= 0 else math.nan


def tensor_stats(x: torch.Tensor) -> TensorStats:
    """Sum and max of ``|x|``, count of non-finite entries and sum of squares of a 1-D tensor."""
    n = x.numel()
    if n == 0:
        return TensorStats(0, 0.0, 0.0, 0, 0.0)
    if native.usable(x):
        s, m, nf, q = native.ext().stats(native.ptr(x), n)
        return TensorStats(n, s, m, nf, q)
    s, m, nf, q = _stats(x).tolist()
    return TensorStats(n, s, m, int(nf), q)


@compilable
def _stats(x: torch.Tensor) -> torch.Tensor:
    """``[sum |x|, max |x| (NaN ignored), non-finite count, sum x^2]`` as float64."""
    xf = x.float()
    a = xf.abs()
    parts = [
        a.sum(),
        torch.where(torch.isnan(a), 0.0, a).amax(),
        (~torch.isfinite(xf)).sum(),
        xf.square().sum(),
    ]
    return torch.stack([p.to(torch.float64) for p in parts])


def abs_max(x: torch.Tensor) -> tuple[float, bool]:
    """``(max |x|, whether any element is inf or NaN)`` in one pass; max is 0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0, False
    if native.usable(x):
        m, nf = native.ext().absmax(native.ptr(x), x.numel())
        return m, bool(nf)
    m, nf = _absmax(x).tolist()
    return m, nf > 0


@compilable
def _absmax(x: torch.Tensor) -> torch.Tensor:
    a = x.float().abs()
    return torch.stack(
        [torch.where(torch.isnan(a), 0.0, a).amax(), (~torch.isfinite(a)).any().to(torch.float32)]
    )
