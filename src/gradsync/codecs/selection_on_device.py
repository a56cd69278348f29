"""The selection methods of :mod:`gradsync.codecs.selection`, written so that nothing is read
back by the host: for a GPU, where every host read of a count or a threshold stalls the launch
queue until the device catches up (one stall per bucket, so communication cannot overlap the
backward pass).

What makes them host-free:

- every payload has a **capacity** known before the data is seen (``k`` for the exact-k methods,
  ``2k`` for the threshold methods whose count varies), so its size is fixed and a peer needs no
  size exchange. Slots past the real count are padding: a copy of the first selected index with
  the value 0, which a sparse add ignores;
- thresholds, counts and statistics stay 0-dim device tensors, and every branch of the host
  versions becomes a ``torch.where`` over them; searches run a fixed number of steps;
- compaction uses ``torch.nonzero_static`` (a fixed-size nonzero). When more elements pass a
  threshold than the candidate pool holds, the pool keeps the first ones by position and the
  capacity keeps the largest of those; error feedback carries the rest to the next step.

Departures from the host versions (which stay the reference on the CPU), each because the host
version decides on a count it would have to read:

- DGC sends what passes its sampled threshold, at most ``k`` (the largest, when more pass),
  without the retries at lower thresholds (the DGC paper's own rule);
- bsearch reuses its threshold for ``reuse`` calls without re-counting it; the bisection runs
  ``ceil(log2(1 / eps))`` steps and keeps the first threshold with a count in ``[k, 2k]``;
- trimmed top-k takes the exact top-k of the survivors when at most ``8k`` of them survive the
  chosen threshold (the usual case: the threshold is lowered only until ``k`` pass);
- a threshold is never above ``max |x|``, so at least one element is sent;
- random-k draws one position in each of ``k`` equal strata from the counter-based hash (O(k),
  on the device), not a uniform ``k``-subset from ``randperm`` on the host: every element is
  still sent with the same probability, and the unbiased variant scales by its stratum's size;
- random words come from the stream's device counter (:meth:`~gradsync.codecs.base.Stream.words`),
  not from its CPU generator, so that a replayed CUDA graph draws new ones every call.

MSTopK is the MSTopK paper's Algorithm 1 as printed for GPUs: ``iters`` bisection steps, each one
counting pass, then the random contiguous run of the band in one prefix sum.

Where the fused Triton kernels run (:mod:`gradsync.codecs.kernels`: CUDA with triton, or the CPU
under ``TRITON_INTERPRET=1``), chunked top-k, MSTopK, DGC, GradDrop and random-k run them, with
error feedback's addition (``addends``) fused into their first read; elsewhere the torch
versions below run (the same selections: bit for bit, but for MSTopK's and DGC's sums of
magnitudes, summed in another order).

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
- DGC paper: Lin et al., "Deep Gradient Compression", ICLR 2018, arXiv:1712.01887.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from gradsync.codecs import kernels
from gradsync.codecs.ops import DeviceStats, chunk_positions, device_stats, dgc_sample, hashed_uniform

Addends = tuple[torch.Tensor, torch.Tensor] | None
"""Error feedback's two addends: the input is their sum, written into it as it is read (one pass
where a fused kernel runs, an addition first elsewhere)."""


@dataclass
class Capped:
    """A selection in a fixed number of slots: the selected indices in increasing order, then
    padding (the first index again, value 0); ``count`` (0-dim int64) says how many are real;
    ``nonfinite`` (0-dim bool) whether the input held inf or NaN."""

    idx: torch.Tensor
    val: torch.Tensor
    count: torch.Tensor
    nonfinite: torch.Tensor


def _summed(x: torch.Tensor, addends: Addends) -> None:
    """Where no kernel fuses it: the input made the sum of its addends first."""
    if addends is not None:
        torch.add(*addends, out=x)


def _fused(x: torch.Tensor, addends: Addends) -> bool:
    """Whether the fused kernels take this input (and its addends)."""
    return kernels.use_kernels(x) and (addends is None or all(kernels.use_kernels(a) for a in addends))


def _source(
    x: torch.Tensor, addends: Addends
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A kernel's ``a``, ``b`` and ``v_out``: the addends (the sum written into ``x``), or ``x``."""
    if addends is None:
        return x, None, None
    return addends[0], addends[1], x


def _keys(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` in float32; NaN stays NaN and so passes no threshold."""
    return x.float().abs()


def _index_dtype(n: int) -> torch.dtype:
    return torch.int32 if n <= 2**31 - 1 else torch.int64


def _slots(x: torch.Tensor, cand: torch.Tensor, stats: DeviceStats) -> Capped:
    """``cand``: int64 positions, real ones first in increasing order, -1 after them."""
    real = cand >= 0
    first = cand[:1].clamp(min=0)
    idx = torch.where(real, cand, first)
    val = torch.where(real, x[idx], torch.zeros((), dtype=x.dtype, device=x.device))
    return Capped(idx.to(_index_dtype(x.numel())), val, real.sum(), stats.nonfinite)


def _outputs(x: torch.Tensor, slots: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A fused kernel's outputs: ``slots`` indices and values, a count and the statistics."""
    dev = x.device
    idx = torch.empty(slots, dtype=_index_dtype(x.numel()), device=dev)
    val = torch.empty(slots, dtype=x.dtype, device=dev)
    count = torch.empty(1, dtype=torch.int64, device=dev)
    return idx, val, count, torch.empty(4, dtype=torch.float64, device=dev)


def _above_fused(x: torch.Tensor, addends: Addends, t: torch.Tensor, capacity: int, strict: bool) -> Capped:
    """:func:`above` in the fused kernel (two reads, the statistics and the add fused)."""
    a, b, v = _source(x, addends)
    idx, val, count, stats = _outputs(x, min(capacity, x.numel()))
    kernels.select_above(a, t, capacity, idx, val, count, stats, strict=strict, b=b, v_out=v)
    return Capped(idx, val, count[0], stats[2] > 0)


def _largest_of(keys: torch.Tensor, cand: torch.Tensor, capacity: int) -> torch.Tensor:
    """The ``capacity`` candidates of largest key (empty slots, -1, last), in increasing order."""
    if cand.numel() <= capacity:
        return cand
    n = keys.numel()
    score = torch.where(cand >= 0, keys[cand.clamp(min=0)], -1.0)
    kept = cand[score.topk(capacity, sorted=False).indices]
    order = torch.where(kept >= 0, kept, n).sort().values
    return torch.where(order < n, order, -1)


def above(
    x: torch.Tensor,
    keys: torch.Tensor,
    t: torch.Tensor,
    capacity: int,
    strict: bool = False,
    stats: DeviceStats | None = None,
) -> Capped:
    """The elements whose key reaches ``t`` (exceeds it, with ``strict``), at most ``capacity``
    of them: the largest among the first ``2 * capacity`` that pass, by position. ``stats``:
    ``x``'s, when the caller has them already (else one pass computes them)."""
    stats = stats if stats is not None else device_stats(x)
    t = torch.minimum(t.float(), stats.max_abs.float())  # the largest element always passes
    mask = keys > t if strict else keys >= t
    if strict:  # ... also when it is the threshold itself
        mask = mask | (keys >= stats.max_abs.float())
    pool = min(x.numel(), 2 * capacity)
    cand = torch.nonzero_static(mask, size=pool, fill_value=-1).view(-1)
    return _slots(x, _largest_of(keys, cand, capacity), stats)


def exact_topk(x: torch.Tensor, k: int, addends: Addends = None) -> Capped:
    """The ``k`` largest magnitudes (``torch.topk``: no host read)."""
    _summed(x, addends)
    idx = _keys(x).nan_to_num(nan=math.inf).topk(k, sorted=False).indices.sort().values
    return _slots(x, idx, device_stats(x))


def mstopk(x: torch.Tensor, k: int, iters: int, words: torch.Tensor, addends: Addends = None) -> Capped:
    """The MSTopK paper's Algorithm 1 on the device: exactly ``min(k, numel)`` elements when the
    tensor is finite. ``words``: the call's random words (a device tensor; the first is used).

    One rule in one place, :func:`gradsync.codecs.kernels.mstopk`: where the fused kernels run,
    five reads instead of one counting pass per bisection step (the same thresholds, evaluated
    through histograms); elsewhere its torch form, ``iters`` counting passes."""
    if not _fused(x, addends):
        _summed(x, addends)
        addends = None
    a, b, v = _source(x, addends)
    idx, val, count, stats_out = _outputs(x, min(k, x.numel()))
    kernels.mstopk(a, k, iters, words[:1], idx, val, count, stats_out, b=b, v_out=v)
    return Capped(idx, val, count[0], stats_out[2] > 0)


def trimmed_topk(x: torch.Tensor, k: int, step: float, addends: Addends = None) -> Capped:
    """The RedSync paper's trimmed top-k on the device: every lowered threshold counted in one
    pass each (a fixed number: ``ceil(1 / step)``), the first with ``k`` survivors chosen, then
    the exact top-k of its survivors."""
    _summed(x, addends)
    keys, stats = _keys(x), device_stats(x)
    mean, top = stats.mean_abs.float(), stats.max_abs.float()
    ratios, r = [], 1.0
    while r > 0.0:
        r = max(r - step, 0.0)
        ratios.append(r)
    ts = torch.stack([mean + q * (top - mean) for q in ratios])
    counts = torch.stack([(keys > t).sum() for t in ts])
    enough = counts >= k
    first = ts.gather(0, enough.int().argmax().reshape(1)).reshape(())  # (a gather: no host read)
    chosen = torch.where(enough.any(), first, -math.inf)
    pool = min(x.numel(), 8 * k)
    cand = torch.nonzero_static(keys > chosen, size=pool, fill_value=-1).view(-1)
    return _slots(x, _largest_of(keys, cand, min(k, x.numel())), stats)


def bsearch(x: torch.Tensor, k: int, eps: float, reuse: torch.Tensor | None) -> tuple[Capped, torch.Tensor]:
    """The RedSync paper's threshold bisection on the device, at most ``2k`` elements; returns
    the selection and the threshold (0-dim) to reuse."""
    keys, stats = _keys(x), device_stats(x)
    if reuse is not None:  # (NaN after a non-finite input: the mean, capped, until the next search)
        reuse = torch.where(reuse.isnan(), stats.mean_abs.float(), reuse)
        return above(x, keys, reuse, 2 * k, strict=True, stats=stats), reuse
    mean, top = stats.mean_abs.float(), stats.max_abs.float()
    base = torch.where((keys > mean).sum() >= k, mean, torch.zeros_like(mean))
    lo, hi = torch.zeros_like(mean), torch.ones_like(mean)
    found, at = torch.zeros((), dtype=torch.bool, device=x.device), torch.zeros_like(mean)
    for _ in range(max(1, math.ceil(math.log2(1.0 / eps)))):
        ratio = lo + (hi - lo) / 2
        t = base + ratio * (top - base)
        count = (keys > t).sum()
        hit = (count >= k) & (count <= 2 * k) & ~found
        at, found = torch.where(hit, t, at), found | hit
        few = count < k
        hi, lo = torch.where(few, ratio, hi), torch.where(few, lo, ratio)
    threshold = torch.where(found, at, base + lo * (top - base))
    return above(x, keys, threshold, 2 * k, strict=True, stats=stats), threshold


def sampled_threshold(x: torch.Tensor, k: int, sample: float, words: torch.Tensor) -> torch.Tensor:
    """DGC's estimate of the k-th magnitude from a random sample, as a 0-dim device tensor (the
    sample's positions come from the counter-based hash keyed by the two device ``words``: no
    host-made index tensor to copy)."""
    n = x.numel()
    s, rank = dgc_sample(n, k, sample)
    w1, w2 = words[0], words[1]
    pos = (hashed_uniform(s, w1, w2, x.device) * n).long().clamp(max=n - 1)
    keys = x[pos].float().abs().nan_to_num(nan=-math.inf)
    return keys.topk(rank, sorted=False).values.min()


def _sampled_above(x: torch.Tensor, k: int, sample: float, words: torch.Tensor, addends: Addends,
                   capacity: int) -> Capped:  # fmt: skip
    """What passes the sampled threshold for ``k``, at most ``capacity``."""
    if _fused(x, addends):
        a, b, _ = _source(x, addends)
        t = torch.empty(1, dtype=torch.float32, device=x.device)
        kernels.sampled_threshold(a, k, sample, words, t, b=b)
        return _above_fused(x, addends, t, capacity, strict=False)
    _summed(x, addends)
    return above(x, _keys(x), sampled_threshold(x, k, sample, words), capacity)


def dgc(x: torch.Tensor, k: int, sample: float, words: torch.Tensor, addends: Addends = None) -> Capped:
    """DGC on the device: what passes the sampled threshold, at most ``k``."""
    return _sampled_above(x, k, sample, words, addends, k)


def graddrop(x: torch.Tensor, k: int, sample: float, words: torch.Tensor, addends: Addends = None) -> Capped:
    """GradDrop with a sampled threshold for about ``k`` elements, at most ``2k``."""
    return _sampled_above(x, k, sample, words, addends, min(x.numel(), 2 * k))


def randomk(
    x: torch.Tensor, k: int, words: torch.Tensor, addends: Addends = None
) -> tuple[Capped, torch.Tensor]:
    """``k`` distinct positions in increasing order, one drawn uniformly from each of ``k``
    strata of (nearly) equal size (:func:`gradsync.codecs.kernels.stratified_randomk`: O(k)
    work); returns the selection and each stratum's size (float32), by which an unbiased
    variant scales its values. Every element is sent with probability 1 / its stratum's size."""
    _summed(x, addends)
    n = x.numel()
    idx = torch.empty(k, dtype=_index_dtype(n), device=x.device)
    sizes = torch.empty(k, dtype=torch.float32, device=x.device)
    val = torch.empty(k, dtype=x.dtype, device=x.device)
    kernels.stratified_randomk(n, k, words, idx, sizes_out=sizes, a=x, val_out=val)
    bad = (
        ~torch.isfinite(x).all()
        if x.is_floating_point()
        else torch.zeros((), dtype=torch.bool, device=x.device)
    )
    return Capped(idx, val, torch.full((), k, dtype=torch.int64, device=x.device), bad), sizes


def chunked_topk(
    x: torch.Tensor, chunk: int, per_chunk: int, of_tail: int, addends: Addends = None
) -> Capped:
    """:func:`gradsync.codecs.selection.chunked_topk` with its statistics left on the device: in
    one read where the fused kernel runs (:func:`gradsync.codecs.kernels.chunked_topk`)."""
    n = x.numel()
    if _fused(x, addends):
        a, b, v = _source(x, addends)
        count = (n // chunk) * per_chunk + of_tail
        idx = torch.empty(count, dtype=_index_dtype(n), device=x.device)
        val = torch.empty(count, dtype=x.dtype, device=x.device)
        bad = torch.empty(1, dtype=torch.int32, device=x.device)
        kernels.chunked_topk(a, chunk, per_chunk, of_tail, idx, val, bad, b=b, v_out=v)
        return Capped(idx, val, torch.full((), count, dtype=torch.int64, device=x.device), bad[0] > 0)
    _summed(x, addends)
    idx = chunk_positions(_keys(x).nan_to_num(nan=math.inf), chunk, per_chunk, of_tail)
    return _slots(x, idx, device_stats(x))
