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


@dataclass(frozen=True)
class DeviceStats:
    """:class:`TensorStats` kept as 0-dim tensors on the tensor's device (nothing is read back,
    so a GPU never waits for the host): float64 sums and maximum, a bool ``nonfinite``."""

    numel: int
    sum_abs: torch.Tensor
    max_abs: torch.Tensor
    nonfinite: torch.Tensor
    sum_sq: torch.Tensor

    @property
    def mean_abs(self) -> torch.Tensor:
        return self.sum_abs / max(self.numel, 1)


def device_stats(x: torch.Tensor) -> DeviceStats:
    """:func:`tensor_stats` without a host read: the same four reductions, left on the device."""
    if x.numel() == 0:
        z = torch.zeros((), dtype=torch.float64, device=x.device)
        return DeviceStats(0, z, z, torch.zeros((), dtype=torch.bool, device=x.device), z)
    v = _stats(x)
    return DeviceStats(x.numel(), v[0], v[1], v[2] > 0, v[3])


def stats_vector(x: torch.Tensor) -> torch.Tensor:
    """The four reductions of :func:`device_stats` as one float64 tensor on x's device,
    ``[sum |x|, max |x| (NaN ignored), non-finite count, sum x^2]`` (zeros for an empty tensor)."""
    if x.numel() == 0:
        return torch.zeros(4, dtype=torch.float64, device=x.device)
    return _stats(x)


def abs_max(x: torch.Tensor) -> tuple[float, bool]:
    """``(max |x|, whether any element is inf or NaN)`` in one pass; max is 0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0, False
    if native.usable(x):
        m, nf = native.ext().absmax(native.ptr(x), x.numel())
        return m, bool(nf)
    m, nf = _absmax(x).tolist()
    return m, nf > 0


def abs_max_on_device(x: torch.Tensor) -> torch.Tensor:
    """``max |x|`` (NaN ignored; 0 for an empty tensor) as a 1-element float32 tensor on x's
    device: ready for an all-reduce, never read by the host."""
    if x.numel() == 0:
        return torch.zeros(1, dtype=torch.float32, device=x.device)
    return _absmax(x)[:1].clone()


@compilable
def _absmax(x: torch.Tensor) -> torch.Tensor:
    a = x.float().abs()
    return torch.stack(
        [torch.where(torch.isnan(a), 0.0, a).amax(), (~torch.isfinite(a)).any().to(torch.float32)]
    )
