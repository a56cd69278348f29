"""Selection methods of the papers, written with the common operators.

Each function takes a flat floating tensor and returns a :class:`Selected`: indices in the flat
tensor, their values, and the tensor's statistics (for the non-finite check). They are pure apart
from the generator or reuse state passed in, and none of them communicates.

- :func:`exact_topk`: the k largest magnitudes (the reference).
- :func:`mstopk`: MSTopK, the MSTopK paper's Algorithm 1: N bisection steps between mean(|x|) and
  max(|x|) give two thresholds around the k-th magnitude; everything above the upper one is kept
  and the rest is filled with a random contiguous run of the elements between the two.
- :func:`trimmed_topk`: the RedSync paper's Algorithm 2: lower a mean/max threshold in steps until
  at least k elements survive it, then take the exact top-k of the survivors.
- :func:`bsearch`: the RedSync paper's Algorithm 3: bisect a threshold until between k and 2k
  elements exceed it, and reuse it for the following calls.
- :func:`dgc`: Deep Gradient Compression's sampled threshold, refined to exactly k.
- :func:`graddrop`: keep what exceeds a threshold (given, or sampled for a target density).
- :func:`randomk`: k uniformly random elements.
- :func:`chunked_topk`: the largest magnitudes of each fixed-size chunk, as DeMo and SparseLoCo
  select: the count follows from the size alone, and one batched ``torch.topk`` finds them all
  with no data-dependent size (on a GPU, no wait for the host).

All threshold tests run on the :class:`~gradsync.codecs.ops.CandidateSet` produced by one fused
pass over the tensor, so the number of search iterations hardly costs anything; answers are exact
(a threshold below the candidates' floor falls back to a full pass). Under error feedback that
pass also adds the residual to the gradient (``addends``): the sum is written once and never
read back for the selection.

References:

- DeMo: Peng et al., "DeMo: Decoupled Momentum Optimization", arXiv:2411.19870.
- SparseLoCo: Templar's sparse outer-gradient DiLoCo variant, arXiv:2508.15706.
- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradsync.codecs.ops import (
    CandidateSet,
    Key,
    TensorStats,
    Workspace,
    chunk_positions,
    dgc_sample,
    draw_index,
    f32,
    f32_above,
    gather,
    kth_largest,
    random_subset,
    tensor_stats,
)

Addends = tuple[torch.Tensor, torch.Tensor] | None
"""Two tensors whose sum the selection's input is to hold: the selections that begin with one
scan of their input (exact top-k, MSTopK, trimmed top-k) compute it in that scan."""


@dataclass
class Selected:
    """The result of a selection: flat indices (ascending unless noted), values, input stats."""

    idx: torch.Tensor
    val: torch.Tensor
    stats: TensorStats

    @property
    def count(self) -> int:
        return self.idx.numel()


def exact_topk(x: torch.Tensor, k: int, ws: Workspace | None = None, addends: Addends = None) -> Selected:
    """The ``k`` elements of largest magnitude; ties broken by lower index. ``addends``: ``x`` is
    to be computed as their sum by the first scan (:meth:`CandidateSet.scan`)."""
    cand = CandidateSet.scan(x, Key.ABS, target=k, minimum=k, ws=ws, want_sum=False, addends=addends)
    idx, val = cand.top(k)
    return Selected(idx, val, cand.stats)


def mstopk(
    x: torch.Tensor,
    k: int,
    iters: int,
    gen: torch.Generator,
    ws: Workspace | None = None,
    addends: Addends = None,
) -> Selected:
    """The MSTopK paper's Algorithm 1, returning exactly ``min(k, numel)`` elements.

    Two departures from the printed pseudo-code, both for inputs it does not cover: if no step
    ever finds a threshold with at most ``k`` elements above it, the upper threshold is +inf
    (the pseudo-code's initial 0 would select every element); and thresholds are compared in
    float32, the precision of the data. Indices come out in increasing order. ``addends`` as in
    :func:`exact_topk`.
    """
    n = x.numel()
    cand = CandidateSet.scan(x, Key.ABS, target=k, minimum=0, ws=ws, want_sum=True, addends=addends)
    if cand.stats.nonfinite:  # no meaningful thresholds; the payload is flagged anyway
        return _top_of_finite(cand, k)
    mean, top = cand.stats.mean_abs, cand.stats.max_abs

    def threshold(ratio: float) -> float:
        return f32(mean + ratio * (top - mean))

    def counts(ts: list[float]) -> dict[float, int | None]:
        # below the floor with more than k candidates a count is certainly > k, and its exact
        # value is never needed (see below): skip it
        known = [t for t in ts if not (t < cand.floor and cand.count > k)]
        found: dict[float, int | None] = dict.fromkeys(ts)
        found.update(zip(known, cand.count_ge_many(known), strict=True))
        return found

    lo_r, hi_r = 0.0, 1.0
    thres1, k1 = math.inf, 0  # largest count <= k seen, and its threshold
    thres2 = 0.0  # threshold of the smallest count > k seen
    done = 0
    while done < iters:
        depth = min(4, iters - done)
        # the counts for the next `depth` steps: one pass over the candidates
        found = counts([threshold(r) for r in _midpoints(lo_r, hi_r, depth)])
        for _ in range(depth):
            ratio = lo_r + (hi_r - lo_r) / 2
            t = threshold(ratio)
            nnz = found[t]
            if nnz is not None and nnz <= k:
                hi_r = ratio
                # the pseudo-code updates only on a strictly larger count; an equal count means
                # no element lies between the two thresholds, so the selected sets are identical
                thres1, k1 = t, nnz
            else:
                lo_r = ratio
                thres2 = t
        done += depth
    upper = cand.select(thres1) if k1 > 0 else (cand.idx[:0], cand.val[:0])
    need = min(k, n) - upper[0].numel()
    if need <= 0:
        return Selected(upper[0], upper[1], cand.stats)
    band_idx, band_val = cand.select(thres2, thres1)
    if band_idx.numel() < need:  # only when the data has fewer than k finite elements
        band_idx, band_val = cand.select(-math.inf, thres1)
    start = draw_index(gen, band_idx.numel() - need + 1)
    idx, val = _merge(upper, (band_idx[start : start + need], band_val[start : start + need]))
    return Selected(idx, val, cand.stats)


def _merge(
    a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two (indices, values) runs with ascending, disjoint indices into one ascending run."""
    (ia, va), (ib, vb) = a, b
    if ib.numel() == 0:
        return ia, va
    if ia.numel() == 0:
        return ib, vb
    ib = ib.to(ia.dtype)
    # where each element of b lands: its rank in a plus its rank in b
    pos_b = torch.searchsorted(ia, ib) + torch.arange(ib.numel(), device=ib.device)
    in_a = torch.ones(ia.numel() + ib.numel(), dtype=torch.bool, device=ia.device)
    in_a[pos_b] = False
    idx = torch.empty(in_a.numel(), dtype=ia.dtype, device=ia.device)
    val = torch.empty(in_a.numel(), dtype=va.dtype, device=va.device)
    idx[pos_b], val[pos_b] = ib, vb
    idx[in_a], val[in_a] = ia, va
    return idx, val


def _midpoints(lo: float, hi: float, depth: int) -> list[float]:
    """Every ratio ``depth`` bisection steps from ``[lo, hi]`` can visit, computed the way the
    steps compute them (so the floats match exactly): 2^depth - 1 values."""
    if depth == 0:
        return []
    mid = lo + (hi - lo) / 2
    return [mid, *_midpoints(lo, mid, depth - 1), *_midpoints(mid, hi, depth - 1)]


def _top_of_finite(cand: CandidateSet, k: int) -> Selected:
    """For a tensor with inf/NaN: any k elements will do (the payload is flagged non-finite)."""
    idx, val = cand.top(k)
    return Selected(idx, val, cand.stats)


def trimmed_topk(
    x: torch.Tensor, k: int, step: float, ws: Workspace | None = None, addends: Addends = None
) -> Selected:
    """The RedSync paper's Algorithm 2: exact top-``k`` computed on the survivors of a trimmed threshold.

    The threshold starts at ``mean + (1 - step) * (max - mean)`` of ``|x|`` and drops by
    ``step * (max - mean)`` until at least ``k`` elements exceed it (the printed loop condition
    is inverted; the text describes this). If even the mean lets fewer than ``k`` through, every
    element survives. Returns exactly ``min(k, numel)`` elements. ``addends`` as in
    :func:`exact_topk`.
    """
    cand = CandidateSet.scan(x, Key.ABS, target=k, minimum=k, ws=ws, want_sum=True, addends=addends)
    if cand.stats.nonfinite:
        return _top_of_finite(cand, k)
    mean, top = cand.stats.mean_abs, cand.stats.max_abs
    survivors = None
    ratio = 1.0
    while True:
        ratio = max(ratio - step, 0.0)
        t = f32_above(mean + ratio * (top - mean))  # strictly greater than the threshold
        if t < cand.floor and cand.count >= k:
            survivors = cand  # the candidates alone already exceed it k times over
            break
        if cand.count_ge(t) >= k:
            survivors = cand.restrict(t)
            break
        if ratio == 0.0:
            break
    if survivors is None:
        survivors = cand if cand.floor == -math.inf else cand.restrict(-math.inf)
    idx, val = survivors.top(k)
    return Selected(idx, val, cand.stats)


@dataclass
class BsearchResult:
    selected: Selected
    threshold: float
    searched: bool


def bsearch(
    x: torch.Tensor, k: int, eps: float, reuse: float | None, ws: Workspace | None = None
) -> BsearchResult:
    """The RedSync paper's Algorithm 3: a threshold with between ``k`` and ``2k`` elements above it.

    ``reuse`` is a threshold from an earlier call: if it still yields a count in ``[k, 2k]`` it is
    used as is (one pass, no search). The search bisects ``ratio`` in ``[0, 1]`` for the
    threshold ``mean + ratio * (max - mean)`` of ``|x|`` (moving the bound to the ratio; the
    printed pseudo-code assigns the threshold to it) until the count lands in ``[k, 2k]`` or the
    interval is narrower than ``eps``; it then keeps the lower bound, whose count exceeds ``2k``.
    If fewer than ``k`` elements exceed the mean, the search runs from 0 instead; if fewer than
    ``k`` are non-zero, all non-zero elements are returned.
    """
    if reuse is not None:
        cand = CandidateSet.at(x, Key.ABS, reuse, ws, cap=2 * k + 1024, want_sum=False)
        if k <= cand.count <= 2 * k:
            return BsearchResult(Selected(cand.idx, cand.val, cand.stats), reuse, False)
    cand = CandidateSet.scan(x, Key.ABS, target=2 * k, minimum=k, ws=ws, want_sum=True)
    if cand.stats.nonfinite:
        return BsearchResult(_top_of_finite(cand, k), math.nan, False)
    mean, top = cand.stats.mean_abs, cand.stats.max_abs

    def count_above(t: float) -> int | None:
        """Elements strictly above ``t``; None when it is certainly more than 2k."""
        t32 = f32_above(t)
        if t32 < cand.floor and cand.count > 2 * k:
            return None
        return cand.count_ge(t32)

    c = count_above(mean)
    base = mean if c is None or c >= k else 0.0
    if base == 0.0 and (count_above(0.0) or 0) < k:
        t = f32_above(0.0)
        idx, val = cand.select(t)
        return BsearchResult(Selected(idx, val, cand.stats), t, True)
    lo_r, hi_r = 0.0, 1.0
    found: dict[float, int | None] = {}
    while True:
        if hi_r - lo_r <= eps:
            threshold = f32_above(base + lo_r * (top - base))
            break
        ratio = lo_r + (hi_r - lo_r) / 2
        if ratio not in found:  # counts for the next four steps in one pass
            mids = _midpoints(lo_r, hi_r, 4)
            ts = [f32_above(base + r * (top - base)) for r in mids]
            known = [t for t in ts if not (t < cand.floor and cand.count > 2 * k)]
            by_t = dict(zip(known, cand.count_ge_many(known), strict=True))
            found.update((r, by_t.get(t)) for r, t in zip(mids, ts, strict=True))
        nnz = found[ratio]
        if nnz is not None and k <= nnz <= 2 * k:
            threshold = f32_above(base + ratio * (top - base))
            break
        if nnz is not None and nnz < k:
            hi_r = ratio
        else:
            lo_r = ratio
    idx, val = cand.select(threshold)
    return BsearchResult(Selected(idx, val, cand.stats), threshold, True)


def sampled_threshold(
    x: torch.Tensor, k: int, sample: float, gen: torch.Generator, ws: Workspace | None
) -> float:
    """DGC's estimate of the k-th magnitude: the matching order statistic of a random sample."""
    n = x.numel()
    s, rank = dgc_sample(n, k, sample)
    sidx = torch.randint(0, n, (s,), generator=gen).to(x.device)
    keys = x[sidx].float().abs().nan_to_num(nan=-math.inf)
    return kth_largest(keys, rank, ws)


def dgc(
    x: torch.Tensor,
    k: int,
    sample: float,
    tolerance: float,
    gen: torch.Generator,
    ws: Workspace | None = None,
) -> Selected:
    """DGC selection: a sampled threshold, then exactly ``k`` by a top-k of what passed it.

    When the sampled threshold lets fewer than ``k`` elements through, up to two lower
    thresholds are tried; a result with at least ``ceil((1 - tolerance) * k)`` elements is
    accepted, otherwise the exact top-k is taken. So the count is always in
    ``[ceil((1 - tolerance) * k), k]``.
    """
    minimum = math.ceil((1.0 - tolerance) * k)
    t = sampled_threshold(x, k, sample, gen, ws)
    for _ in range(3):
        cand = CandidateSet.at(x, Key.ABS, t, ws, cap=2 * k + 1024, want_sum=False)
        if cand.count >= k:
            idx, val = cand.top(k)
            return Selected(idx, val, cand.stats)
        if cand.count >= minimum:
            return Selected(cand.idx, cand.val, cand.stats)
        t = t * 0.8 if t > 0 else -math.inf
    return exact_topk(x, k, ws)


def graddrop(
    x: torch.Tensor,
    k: int | None,
    threshold: float | None,
    sample: float,
    gen: torch.Generator,
    ws: Workspace | None = None,
) -> Selected:
    """GradDrop: keep the elements whose magnitude reaches a threshold, drop the rest.

    The threshold is given, or sampled (as in :func:`sampled_threshold`) so that about ``k``
    elements pass; the count varies from call to call.
    """
    t = threshold if threshold is not None else sampled_threshold(x, k or 1, sample, gen, ws)
    cap = 2 * (k or 0) + 1024
    cand = CandidateSet.at(x, Key.ABS, t, ws, cap=cap, want_sum=False)
    return Selected(cand.idx, cand.val, cand.stats)


def randomk(x: torch.Tensor, k: int, gen: torch.Generator) -> Selected:
    """``k`` distinct indices drawn uniformly at random (ascending), and their values."""
    stats = tensor_stats(x)
    idx = random_subset(x.numel(), k, gen, x.device)
    if idx.dtype == torch.int64 and x.numel() <= 2**31 - 1:
        idx = idx.to(torch.int32)
    return Selected(idx, gather(x, idx), stats)


def chunked_topk(x: torch.Tensor, chunk: int, per_chunk: int, of_tail: int) -> Selected:
    """The ``per_chunk`` largest magnitudes of every full ``chunk`` of ``x`` and the ``of_tail``
    largest of the shorter last one; indices ascending. The count is known before looking at the
    data, so nothing about the selection has to come back to the host."""
    n = x.numel()
    idx = chunk_positions(x.abs(), chunk, per_chunk, of_tail)
    idx = idx.to(torch.int32) if n <= 2**31 - 1 else idx
    return Selected(idx, x[idx], tensor_stats(x))
