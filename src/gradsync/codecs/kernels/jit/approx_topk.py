"""Triton kernels of MSTopK in a few passes (:mod:`gradsync.codecs.kernels.approx_topk`).

Every threshold the bisection of the MSTopK paper's Algorithm 1 can try is
``T(m) = mean + (m / 2^iters) * (top - mean)`` for an integer ``m``, evaluated in float32
with separate roundings (launches pass ``enable_fp_fusion=False`` so that no multiply-add is
fused). ``T`` is monotone in ``m`` (increasing, or decreasing when rounding makes the mean
exceed the maximum), so each key has a "bin": how many of the thresholds it reaches. A
histogram of bins gives the count at every threshold at once, and the bisection is replayed on
it exactly."""

import triton
import triton.language as tl

from gradsync.codecs.kernels.jit.common import scalar_f32, scalar_i64


@triton.jit
def mean_span(stats_ptr, n):
    """``mean`` and ``top - mean`` in float32 from the float64 statistics, as the reference
    computes them (``(sum / numel).float()``, ``max.float()``), and whether ``T`` increases."""
    mean = (tl.load(stats_ptr) / n).to(tl.float32)  # float64 division, correctly rounded
    top = tl.load(stats_ptr + 1).to(tl.float32)
    span = top - mean
    return mean, span, span >= 0


@triton.jit
def threshold(mean, span, m, SCALE: tl.constexpr):
    """``T(m) = mean + (m * SCALE) * span``; ``m * SCALE`` is exact (a dyadic ratio)."""
    ratio = m.to(tl.float32) * SCALE
    return mean + ratio * span


@triton.jit
def hist_kernel(
    v_ptr,
    stats_ptr,
    hist_ptr,
    n,
    BITS: tl.constexpr,
    NB: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Coarse histogram: each key's bin ``b`` in ``[0, NB = 2^BITS)``, the number of the thresholds
    ``T(1..NB-1)`` (at resolution ``SCALE = 1 / NB``) that it reaches. The bin is estimated from
    ``(key - mean) / span`` and corrected by one either way against the exact thresholds; a
    block where that does not settle every key (falling thresholds, NaN statistics, bins
    narrower than the float32 spacing) finds them by bisection over ``b`` instead. Bin 0 is not
    counted (it reaches none); the top bin is summed per program first (every program has keys
    there)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = tl.abs(tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    key = tl.where(mask, key, -1.0)
    mean, span, rising = mean_span(stats_ptr, n)
    guess = (key - mean) * (NB / span)
    guess = tl.minimum(tl.maximum(tl.where(guess == guess, guess, 0.0), 0.0), NB - 1.0)
    b = tl.where(rising, guess.to(tl.int32), 0)
    b = tl.where((b > 0) & (key < threshold(mean, span, tl.where(rising, b, NB - b), SCALE)), b - 1, b)
    above = key >= threshold(mean, span, tl.where(rising, b + 1, NB - b - 1), SCALE)
    b = tl.where((b < NB - 1) & above, b + 1, b)
    low_ok = (b == 0) | (key >= threshold(mean, span, tl.where(rising, b, NB - b), SCALE))
    high_ok = (b == NB - 1) | (key < threshold(mean, span, tl.where(rising, b + 1, NB - b - 1), SCALE))
    if tl.sum((low_ok & high_ok).to(tl.int32), axis=0) < BLOCK:
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = lo + NB
        for _ in range(BITS):
            mid = (lo + hi) >> 1
            reached = key >= threshold(mean, span, tl.where(rising, mid, NB - mid), SCALE)
            lo = tl.where(reached, mid, lo)
            hi = tl.where(reached, hi, mid)
        b = lo
    tl.atomic_add(hist_ptr + NB - 1, tl.sum((b == NB - 1).to(tl.int32), axis=0))
    tl.atomic_add(hist_ptr + b, 1, mask=(b > 0) & (b < NB - 1))


@triton.jit
def coarse_kernel(
    hist_ptr,
    stats_ptr,
    state_f_ptr,
    state_i_ptr,
    n,
    k,
    STEPS: tl.constexpr,
    NB: tl.constexpr,
    SCALE: tl.constexpr,
):
    """One program: the first ``STEPS`` bisection steps replayed on the coarse histogram.
    State out: ``state_f = [thres1, thres2]``, ``state_i = [lo, hi, k1]`` (lo and hi in units
    of ``1 / NB``)."""
    mean, span, rising = mean_span(stats_ptr, n)
    bins = tl.arange(0, NB)
    h = tl.load(hist_ptr + bins).to(tl.int64)
    reach = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys in bin >= b
    lo = scalar_i64(0)
    hi = scalar_i64(NB)
    thres1 = scalar_f32(float("inf"))
    thres2 = scalar_f32(0.0)
    k1 = scalar_i64(0)
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        count = tl.sum(tl.where(bins == tl.where(rising, mid, NB - mid), reach, 0), axis=0)
        t = threshold(mean, span, mid, SCALE)
        fits = count <= k
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid)
        thres1 = tl.where(fits, t, thres1)
        k1 = tl.where(fits, count, k1)
        thres2 = tl.where(fits, thres2, t)
    tl.store(state_f_ptr, thres1)
    tl.store(state_f_ptr + 1, thres2)
    tl.store(state_i_ptr, lo)
    tl.store(state_i_ptr + 1, hi)
    tl.store(state_i_ptr + 2, k1)


@triton.jit
def refine_kernel(
    v_ptr,
    stats_ptr,
    state_i_ptr,
    sub_ptr,
    n,
    BITS: tl.constexpr,
    NS: tl.constexpr,
    SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Fine histogram inside the coarse interval ``[lo, lo + 1]`` (units ``2^-12``): the
    thresholds ``T(lo * 2^BITS + j)``, ``j = 1 .. 2^BITS - 1``, at ``SCALE = 2^-iters``; each key's
    sub-bin is how many of them it reaches. Only keys strictly inside the interval's range
    need a search (a block without any skips it). ``NS = 2^BITS``."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = tl.abs(tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    key = tl.where(mask, key, -1.0)
    mean, span, rising = mean_span(stats_ptr, n)
    base = tl.load(state_i_ptr) * NS
    lowest = threshold(mean, span, base + tl.where(rising, 1, NS - 1), SCALE)
    highest = threshold(mean, span, base + tl.where(rising, NS - 1, 1), SCALE)
    sub = tl.where(key >= highest, NS - 1, 0)
    inside = (key >= lowest) & (key < highest)
    if tl.sum(inside.to(tl.int32), axis=0) > 0:
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = lo + NS
        for _ in range(BITS):
            mid = (lo + hi) >> 1
            reached = key >= threshold(mean, span, base + tl.where(rising, mid, NS - mid), SCALE)
            lo = tl.where(reached, mid, lo)
            hi = tl.where(reached, hi, mid)
        sub = lo
    tl.atomic_add(sub_ptr + NS - 1, tl.sum((sub == NS - 1).to(tl.int32), axis=0))
    tl.atomic_add(sub_ptr + sub, 1, mask=(sub > 0) & (sub < NS - 1))


@triton.jit
def fine_kernel(
    sub_ptr,
    stats_ptr,
    state_f_ptr,
    state_i_ptr,
    n,
    k,
    BITS: tl.constexpr,
    NS: tl.constexpr,
    SCALE: tl.constexpr,
):
    """One program: the remaining ``BITS`` bisection steps replayed on the fine histogram,
    continuing from the coarse state; writes ``thres1``, ``thres2`` and ``k1`` back."""
    mean, span, rising = mean_span(stats_ptr, n)
    bins = tl.arange(0, NS)
    h = tl.load(sub_ptr + bins).to(tl.int64)
    reach = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h
    base = tl.load(state_i_ptr) * NS
    lo = base
    hi = base + NS
    thres1 = tl.load(state_f_ptr)
    thres2 = tl.load(state_f_ptr + 1)
    k1 = tl.load(state_i_ptr + 2)
    for _ in range(BITS):
        mid = (lo + hi) // 2
        j = mid - base
        count = tl.sum(tl.where(bins == tl.where(rising, j, NS - j), reach, 0), axis=0)
        t = threshold(mean, span, mid, SCALE)
        fits = count <= k
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid)
        thres1 = tl.where(fits, t, thres1)
        k1 = tl.where(fits, count, k1)
        thres2 = tl.where(fits, thres2, t)
    tl.store(state_f_ptr, thres1)
    tl.store(state_f_ptr + 1, thres2)
    tl.store(state_i_ptr + 2, k1)


@triton.jit
def band_masks(key, state_f_ptr):
    """``upper = key >= thres1``, the band ``thres2 <= key < thres1`` and the fallback band
    ``key < thres1`` (NaN keys in none)."""
    thres1 = tl.load(state_f_ptr)
    thres2 = tl.load(state_f_ptr + 1)
    upper = key >= thres1
    band = (key >= thres2) & ~upper  # (not key < thres1: they differ when thres1 is NaN)
    return upper, band, key < thres1


@triton.jit
def count_kernel(v_ptr, state_f_ptr, part_ptr, n, nblocks, BLOCK: tl.constexpr):
    """Per block: the counts of ``upper``, of the band and of the fallback band."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    key = tl.abs(tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    key = tl.where(mask, key, float("nan"))
    upper, band, below = band_masks(key, state_f_ptr)
    tl.store(part_ptr + pid, tl.sum(upper.to(tl.int32), axis=0))
    tl.store(part_ptr + nblocks + pid, tl.sum(band.to(tl.int32), axis=0))
    tl.store(part_ptr + 2 * nblocks + pid, tl.sum(below.to(tl.int32), axis=0))


@triton.jit
def first_rank_at(x):
    """The least integer ``r >= 0`` whose float32 rounding is ``>= x`` (``x`` a float32 in
    ``[0, 2^40)``): how the reference's ``rank >= start`` (a float32 comparison) bounds ranks."""
    lo = scalar_i64(-1)
    hi = scalar_i64(1 << 40)
    for _ in range(41):
        mid = lo + (hi - lo) // 2
        ok = mid.to(tl.float32) >= x
        hi = tl.where(ok, mid, hi)
        lo = tl.where(ok, lo, mid)
    return hi


@triton.jit
def scan_kernel(
    part_ptr,
    state_i_ptr,
    word_ptr,
    offsets_ptr,
    count_ptr,
    nblocks,
    cap,
    TILE: tl.constexpr,
):
    """One program: the random run inside the band, and each block's first slot.

    ``need = max(cap - k1, 0)``; the fallback band replaces the band when the band holds fewer;
    the run starts at rank ``floor(u * max(band - need + 1, 1))`` with ``u`` from the word,
    everything in float32 as the reference computes it. Writes ``offsets[0:nblocks+1]`` (first
    slot of each block; the total last), ``offsets[nblocks+1:]`` (band elements before each
    block), ``state_i[3:6] = [fallback, first rank, end rank]`` and ``count = min(total, cap)``."""
    cols = tl.arange(0, TILE)
    up_all = tl.zeros([TILE], dtype=tl.int64)
    band_all = tl.zeros([TILE], dtype=tl.int64)
    below_all = tl.zeros([TILE], dtype=tl.int64)
    for start in range(0, nblocks, TILE):
        idx = start + cols
        m = idx < nblocks
        up_all += tl.load(part_ptr + idx, mask=m, other=0).to(tl.int64)
        band_all += tl.load(part_ptr + nblocks + idx, mask=m, other=0).to(tl.int64)
        below_all += tl.load(part_ptr + 2 * nblocks + idx, mask=m, other=0).to(tl.int64)
    upper_total = tl.sum(up_all, axis=0)
    k1 = tl.load(state_i_ptr + 2)
    need = tl.maximum(cap - k1, 0)
    fallback = tl.sum(band_all, axis=0) < need
    band_total = tl.where(fallback, tl.sum(below_all, axis=0), tl.sum(band_all, axis=0))
    u = (tl.load(word_ptr) >> 8).to(tl.float32) * (1.0 / 16777216.0)
    span = tl.maximum(band_total - need + 1, 1)
    run_start = (u * span.to(tl.float32)).to(tl.int64).to(tl.float32)
    run_end = run_start + need.to(tl.float32)
    r_lo = first_rank_at(run_start)
    r_hi = first_rank_at(run_end)
    carry_up = scalar_i64(0)
    carry_band = scalar_i64(0)
    for start in range(0, nblocks, TILE):
        idx = start + cols
        m = idx < nblocks
        up = tl.load(part_ptr + idx, mask=m, other=0).to(tl.int64)
        band = tl.where(
            fallback,
            tl.load(part_ptr + 2 * nblocks + idx, mask=m, other=0),
            tl.load(part_ptr + nblocks + idx, mask=m, other=0),
        ).to(tl.int64)
        up_before = carry_up + tl.cumsum(up, axis=0) - up
        band_before = carry_band + tl.cumsum(band, axis=0) - band
        run_before = tl.maximum(tl.minimum(band_before, r_hi) - r_lo, 0)
        tl.store(offsets_ptr + idx, up_before + run_before, mask=m)
        tl.store(offsets_ptr + nblocks + 1 + idx, band_before, mask=m)
        carry_up += tl.sum(up, axis=0)
        carry_band += tl.sum(band, axis=0)
    total = upper_total + tl.maximum(tl.minimum(band_total, r_hi) - r_lo, 0)
    tl.store(offsets_ptr + nblocks, total)
    tl.store(state_i_ptr + 3, fallback.to(tl.int64))
    tl.store(state_i_ptr + 4, r_lo)
    tl.store(state_i_ptr + 5, r_hi)
    tl.store(count_ptr, tl.minimum(total, cap).to(count_ptr.dtype.element_ty))


@triton.jit
def compact_kernel(
    v_ptr,
    state_f_ptr,
    state_i_ptr,
    offsets_ptr,
    cand_ptr,
    n,
    nblocks,
    cap,
    BLOCK: tl.constexpr,
):
    """Write the selected positions (``upper``, and the band's run by rank) in increasing order
    into ``cand[0:cap]``. Blocks with nothing to write skip their loads."""
    pid = tl.program_id(0)
    first = tl.load(offsets_ptr + pid)
    last = tl.load(offsets_ptr + pid + 1)
    band_first = tl.load(offsets_ptr + nblocks + 1 + pid)
    bound = tl.where((last > first) & (first < cap), n, 0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < bound
    key = tl.abs(tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32))
    key = tl.where(mask, key, float("nan"))
    upper, band, below = band_masks(key, state_f_ptr)
    fallback = tl.load(state_i_ptr + 3)
    r_lo = tl.load(state_i_ptr + 4)
    r_hi = tl.load(state_i_ptr + 5)
    band = tl.where(fallback != 0, below, band)
    rank = band_first + tl.cumsum(band.to(tl.int64), axis=0) - 1
    sel = upper | (band & (rank >= r_lo) & (rank < r_hi))
    pos = first + tl.cumsum(sel.to(tl.int64), axis=0) - 1
    tl.store(cand_ptr + pos, offs.to(cand_ptr.dtype.element_ty), mask=sel & (pos < cap))
