"""Triton kernels of the statistics pass and the threshold selection
(:mod:`gradsync.codecs.kernels.threshold`): per-block partials in one read, a one-program
finish (fixed-order sums, block offsets), a compaction pass, the sampled threshold's gather and
the slot filler shared with MSTopK."""

import triton
import triton.language as tl

from gradsync.codecs.kernels.jit.common import hashed_uniform, load_sum, load_words, scalar_i64


@triton.jit
def scan_kernel(
    a_ptr,
    b_ptr,
    v_ptr,
    t_ptr,
    part_f_ptr,
    part_i_ptr,
    n,
    nblocks,
    HAS_B: tl.constexpr,
    WRITE_V: tl.constexpr,
    HAS_T: tl.constexpr,
    STRICT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One block per program: ``v = a (+ b)`` (stored when ``WRITE_V``) and its partials.

    float32 partials (``part_f[j * nblocks + block]``): sum |v|, max |v| ignoring NaN, sum v^2.
    int32 partials (``part_i``): non-finite count; with a threshold ``t``: the count of keys
    passing ``t``, and the count of keys equal to the block's maximum (what the finish needs to
    apply the rule that the largest element always passes)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = load_sum(a_ptr, b_ptr, offs, mask, HAS_B)
    if WRITE_V:
        tl.store(v_ptr + offs, v, mask=mask)
    x = v.to(tl.float32)
    key = tl.abs(x)
    bad = mask & ~(key < float("inf"))
    tl.store(part_f_ptr + pid, tl.sum(tl.where(mask, key, 0.0), axis=0))
    counted = tl.where(mask & (key == key), key, -1.0)
    top = tl.maximum(tl.max(counted, axis=0), 0.0)
    tl.store(part_f_ptr + nblocks + pid, top)
    tl.store(part_f_ptr + 2 * nblocks + pid, tl.sum(tl.where(mask, x * x, 0.0), axis=0))
    tl.store(part_i_ptr + pid, tl.sum(bad.to(tl.int32), axis=0))
    if HAS_T:
        t = tl.load(t_ptr).to(tl.float32)
        if STRICT:
            passing = key > t
        else:
            passing = key >= t
        tl.store(part_i_ptr + nblocks + pid, tl.sum((mask & passing).to(tl.int32), axis=0))
        tl.store(part_i_ptr + 2 * nblocks + pid, tl.sum((counted == top).to(tl.int32), axis=0))


@triton.jit
def finish_kernel(
    part_f_ptr,
    part_i_ptr,
    stats_ptr,
    t_ptr,
    state_ptr,
    offsets_ptr,
    count_ptr,
    nblocks,
    limit,
    HAS_T: tl.constexpr,
    STRICT: tl.constexpr,
    TILE: tl.constexpr,
):
    """One program: the statistics ``stats[0:4]`` (float64: sum |v|, max |v|, non-finite count,
    sum v^2; sums accumulated in a fixed order, so repeatable), and with a threshold: the
    effective threshold ``min(t, max)`` and the maximum in ``state[0:2]``, every block's first
    output slot ``offsets[0:nblocks+1]`` (exclusive prefix sum of the passing counts; the last
    entry is the total) and ``count = min(total, limit)``."""
    cols = tl.arange(0, TILE)
    s_abs = tl.zeros([TILE], dtype=tl.float64)
    s_sq = tl.zeros([TILE], dtype=tl.float64)
    top = tl.zeros([TILE], dtype=tl.float32)
    bad = tl.zeros([TILE], dtype=tl.int64)
    for start in range(0, nblocks, TILE):
        idx = start + cols
        m = idx < nblocks
        s_abs += tl.load(part_f_ptr + idx, mask=m, other=0.0).to(tl.float64)
        top = tl.maximum(top, tl.load(part_f_ptr + nblocks + idx, mask=m, other=0.0))
        s_sq += tl.load(part_f_ptr + 2 * nblocks + idx, mask=m, other=0.0).to(tl.float64)
        bad += tl.load(part_i_ptr + idx, mask=m, other=0).to(tl.int64)
    vmax = tl.max(top, axis=0)
    tl.store(stats_ptr, tl.sum(s_abs, axis=0))
    tl.store(stats_ptr + 1, vmax.to(tl.float64))
    tl.store(stats_ptr + 2, tl.sum(bad, axis=0).to(tl.float64))
    tl.store(stats_ptr + 3, tl.sum(s_sq, axis=0))
    if HAS_T:
        t = tl.load(t_ptr).to(tl.float32)
        t_nan = t != t
        tl.store(state_ptr, tl.where(t_nan, t, tl.minimum(t, vmax)))
        tl.store(state_ptr + 1, vmax)
        # the maximum's elements join when the threshold is above it (it is lowered to it), and
        # with `strict` also when it equals it or is NaN (they always pass)
        if STRICT:
            extra_on = (t >= vmax) | t_nan
        else:
            extra_on = t > vmax
        carry = scalar_i64(0)
        for start in range(0, nblocks, TILE):
            idx = start + cols
            m = idx < nblocks
            passing = tl.load(part_i_ptr + nblocks + idx, mask=m, other=0).to(tl.int64)
            at_max = tl.load(part_i_ptr + 2 * nblocks + idx, mask=m, other=0).to(tl.int64)
            block_max = tl.load(part_f_ptr + nblocks + idx, mask=m, other=-1.0)
            extra = tl.where((block_max == vmax) & m, at_max, 0)
            count = passing + tl.where(extra_on, extra, 0)
            inclusive = tl.cumsum(count, axis=0)
            tl.store(offsets_ptr + idx, carry + inclusive - count, mask=m)
            carry += tl.sum(count, axis=0)
        tl.store(offsets_ptr + nblocks, carry)
        tl.store(count_ptr, tl.minimum(carry, limit).to(count_ptr.dtype.element_ty))


@triton.jit
def compact_kernel(
    a_ptr,
    b_ptr,
    state_ptr,
    offsets_ptr,
    cand_ptr,
    n,
    pool,
    HAS_B: tl.constexpr,
    STRICT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Write the positions of the passing elements, in increasing order, into ``cand[0:pool]``
    (the first ``pool`` of them). Blocks with nothing to write skip their loads."""
    pid = tl.program_id(0)
    first = tl.load(offsets_ptr + pid)
    last = tl.load(offsets_ptr + pid + 1)
    # (a scalar condition folded into the bound: the interpreter mis-types scalar & vector masks)
    bound = tl.where((last > first) & (first < pool), n, 0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < bound
    key = tl.abs(load_sum(a_ptr, b_ptr, offs, mask, HAS_B).to(tl.float32))
    t = tl.load(state_ptr)
    vmax = tl.load(state_ptr + 1)
    if STRICT:
        passing = (key > t) | (key >= vmax)
    else:
        passing = key >= t
    passing = passing & mask
    pos = first + tl.cumsum(passing.to(tl.int64), axis=0) - 1
    tl.store(cand_ptr + pos, offs.to(cand_ptr.dtype.element_ty), mask=passing & (pos < pool))


@triton.jit
def sample_kernel(
    a_ptr,
    b_ptr,
    words_ptr,
    keys_ptr,
    n,
    n_f,
    s,
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``keys[i] = |v[pos_i]|`` (NaN as -inf) at the hashed positions
    ``pos_i = min(int(u_i * float32(n)), n - 1)`` of :func:`gradsync.codecs.ops.hashed_uniform`
    (the product rounded in float32, as torch multiplies a float32 tensor by an integer)."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < s
    k1, k2 = load_words(words_ptr)
    u = hashed_uniform(i, k1, k2)
    pos = tl.minimum((u * n_f).to(tl.int64), n - 1)
    key = tl.abs(load_sum(a_ptr, b_ptr, pos, m, HAS_B).to(tl.float32))
    key = tl.where(key == key, key, -float("inf"))
    tl.store(keys_ptr + i, key, mask=m)


@triton.jit
def slots_kernel(cand_ptr, v_ptr, idx_ptr, val_ptr, cap, BLOCK: tl.constexpr):
    """The fixed-size payload slots from a candidate list (positions in increasing order, then
    -1): each real slot keeps its position and value; an empty one repeats the first position
    (0 when there is none) with the value 0."""
    pid = tl.program_id(0)
    i = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < cap
    cand = tl.load(cand_ptr + i, mask=m, other=-1).to(tl.int64)
    first = tl.maximum(tl.load(cand_ptr).to(tl.int64), 0)
    real = cand >= 0
    idx = tl.where(real, cand, first)
    val = tl.load(v_ptr + idx, mask=m & real, other=0.0)
    tl.store(idx_ptr + i, idx.to(idx_ptr.dtype.element_ty), mask=m)
    tl.store(val_ptr + i, val, mask=m)
