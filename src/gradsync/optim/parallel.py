"""The MSTopK paper's parallel tensor operator (PTO, section 4.2, Eq. 12-14).

After the gradients are synchronized every rank holds the same weights and gradients, so every
rank computing the same per-layer quantity (a LARS or LAMB trust ratio needs two norms per layer)
repeats the work ``p`` times. :class:`ParallelTensorOperator` splits the layers into ``p``
contiguous shares balanced by element count, has each rank compute only its share, and
all-gathers the results (one scalar per layer) so every rank ends with all of them. Where the
operation is deterministic, every rank computes exactly what it would have alone: the result is
bitwise the local one.

It pays when the norm work saved, ``(1 - 1/p)`` of it, exceeds the all-gather's start-up cost;
:meth:`gradsync.collectives.cost.CostModel.parallel_tensor_op` predicts both, the all-gather
from its start-up as :func:`gradsync.collectives.cost.calibrate` measures it; ``gradsync train
--pto auto`` decides with it.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from gradsync.collectives import primitives as P


def balanced_shares(sizes: Sequence[int], parts: int) -> list[range]:
    """``parts`` contiguous index ranges over ``sizes`` whose element counts are about equal: share
    ``j`` starts at the first layer whose running total passes ``j / parts`` of the whole. Some
    shares are empty when there are fewer layers than parts."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    # layer i belongs to the share in which its first element falls
    starts: list[int] = []
    total = 0
    for s in sizes:
        starts.append(total)
        total += int(s)
    bounds = [0]
    for j in range(1, parts):
        bounds.append(max(bounds[-1], bisect.bisect_left(starts, j * total / parts)))
    bounds.append(len(sizes))
    return [range(bounds[j], bounds[j + 1]) for j in range(parts)]


def largest_share(sizes: Sequence[int], parts: int) -> tuple[float, int]:
    """For :func:`balanced_shares` over ``parts``: the largest share's fraction of the elements
    (the work the slowest rank does) and the most layers in a share (the values each rank
    contributes to the all-gather, padded to that)."""
    shares = balanced_shares(sizes, parts)
    total = max(sum(int(s) for s in sizes), 1)
    fraction = max(sum(int(sizes[i]) for i in s) for s in shares) / total
    return fraction, max(1, max(len(s) for s in shares))


class ParallelTensorOperator:
    """Compute one value per layer, each rank its share, gathered on every rank.

    ``group``: the ranks that hold identical tensors (default: the world). The layout (number of
    layers and their sizes) is checked to be the same on every rank the first time it is used,
    so a rank with another model fails with a clear error instead of mixing results.
    """

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "parallel=...: the parallel tensor operator needs an initialized process group "
                "(torch.distributed.init_process_group); pass parallel=None to compute locally"
            )
        self.group = group
        self.size = P.size(group)
        self.rank = P.group_rank(group)
        self._shares: dict[tuple[int, ...], list[range]] = {}

    def shares(self, sizes: Sequence[int]) -> list[range]:
        """Every rank's share of layers with these element counts (checked once per layout)."""
        key = tuple(int(s) for s in sizes)
        if key not in self._shares:
            P.check_same(
                self.group,
                "parallel_tensor_operator",
                layers=len(key),
                elements=sum(key),
                layout=",".join(map(str, key)),
            )
            self._shares[key] = balanced_shares(key, self.size)
        return self._shares[key]

    def map(
        self,
        sizes: Sequence[int],
        compute: Callable[[range], torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """``compute(share)`` on this rank's share (it returns one value per layer of the share),
        all-gathered: a 1-D ``dtype`` tensor of one value per layer, the same on every rank."""
        shares = self.shares(sizes)
        mine = shares[self.rank]
        if self.size == 1:
            return compute(mine).to(dtype)
        width = max(1, max(len(s) for s in shares))
        part = torch.zeros(width, dtype=dtype, device=device)
        if len(mine):
            part[: len(mine)] = compute(mine)
        table = torch.empty(self.size * width, dtype=dtype, device=device)
        P.all_gather(table, part, self.group, "world")
        rows = table.view(self.size, width)
        return torch.cat([rows[j, : len(s)] for j, s in enumerate(shares)])
