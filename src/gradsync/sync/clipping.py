"""Local gradient clipping (RedSync paper, appendix B; DGC): clip each rank's own gradient *before*
it meets the error-feedback residual, not the synchronized gradient after communication.

Clipping the synchronized gradient rescales everything in it, including the residual updates
that error feedback held back for several steps and released at once; that is the step the
papers avoid. Instead each rank clips its local gradient to ``threshold / sqrt(N)`` (N ranks):
if every rank's gradient is independent noise of the same size, the mean of N such gradients
has about the norm ``threshold``, so the local rule approximates ordinary clipping of the mean.

Two modes, :data:`CLIP_MODES`:

- ``global`` (the papers' rule; what an RNN needs): the norm over *all* of a rank's gradients.
  It is known only when the backward pass has ended, so no bucket is synchronized during the
  backward pass: compression and communication still overlap each other, not the backward.
- ``bucket`` (keeps the overlap): each bucket is clipped alone as soon as it is ready, to
  ``threshold / sqrt(N) * sqrt(n_b / n)`` for a bucket of ``n_b`` of the model's ``n`` elements,
  so that buckets all at their bound give a total norm of exactly ``threshold / sqrt(N)``. A
  bucket with a large gradient is clipped even when the whole is within bounds (and the other
  way round), so this is a different, stricter-per-layer rule, not an approximation of
  ``global``.

Norms are taken in float32 (float64 for float64 gradients) whatever the gradient dtype, and
stay on the device: no host synchronization.

References:

- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

CLIP_MODES = ("global", "bucket")
EPS = 1e-6  # as torch.nn.utils.clip_grad_norm_


def local_threshold(threshold: float, world: int) -> float:
    """The bound on one rank's gradient norm: ``threshold / sqrt(N)``."""
    return threshold / math.sqrt(max(world, 1))


def bucket_threshold(threshold: float, world: int, numel: int, total: int) -> float:
    """The bound on one bucket's norm in ``bucket`` mode."""
    return local_threshold(threshold, world) * math.sqrt(numel / max(total, 1))


def total_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all ``tensors`` together, as a float64 scalar on the first one's device."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    if not groups:
        return torch.zeros((), dtype=torch.float64)
    home = tensors[0].device
    squares = []
    for (_, dtype), ts in groups.items():
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        norms = torch._foreach_norm(ts, 2, dtype=acc)
        squares.append(torch.stack(norms).double().square().sum().to(home))
    return torch.stack(squares).sum().sqrt()


def clip_(tensors: Sequence[torch.Tensor], bound: float, loss_scale: float = 1.0) -> torch.Tensor:
    """Scale ``tensors`` in place so their joint norm (divided by ``loss_scale``, for gradients
    of a scaled loss) is at most ``bound``; return the factor applied (1 where already within).
    A non-finite norm gives a non-finite factor: the gradients stay non-finite, for the
    overflow check to see."""
    norm = total_norm(tensors) / loss_scale
    factor = torch.clamp(bound / (norm + EPS), max=1.0)
    groups: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device, []).append(t)
    for device, ts in groups.items():
        torch._foreach_mul_(ts, factor.to(device))
    return factor
