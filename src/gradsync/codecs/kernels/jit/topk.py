"""Triton kernels of the per-chunk top-k (:mod:`gradsync.codecs.kernels.topk`)."""

import triton
import triton.language as tl

from gradsync.codecs.kernels.jit.common import INF_BITS, load_sum, magnitude_bits, scalar_i32


@triton.jit
def chunk_topk_kernel(
    a_ptr,
    b_ptr,
    v_ptr,
    res_ptr,
    idx_ptr,
    val_ptr,
    nonfinite_ptr,
    n,
    chunk,
    per_chunk,
    of_tail,
    HAS_B: tl.constexpr,
    WRITE_V: tl.constexpr,
    WRITE_RES: tl.constexpr,
    REREAD_B: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``ROWS`` chunks per program, each held whole in registers (``chunk <= BLOCK``): one read.

    The k-th largest key of a chunk is found by bisection on the 31-bit pattern of ``|v|``
    (31 counting steps over registers), then the chunk is compacted with two prefix sums: every
    key above it, and the first ones equal to it by position until k are taken. (``REREAD_B``
    is the looped kernel's; unused here.)"""
    pid = tl.program_id(0)
    row = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    col = tl.arange(0, BLOCK)
    start = row * chunk
    length = tl.minimum(n - start, chunk)
    k = tl.where(length >= chunk, per_chunk, of_tail)
    k = tl.where(length > 0, k, 0)
    offs = start[:, None] + col[None, :]
    mask = col[None, :] < length[:, None]
    v = load_sum(a_ptr, b_ptr, offs, mask, HAS_B)
    if WRITE_V:
        tl.store(v_ptr + offs, v, mask=mask)
    raw = v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    bad = tl.sum(tl.sum((mask & (raw >= INF_BITS)).to(tl.int32), axis=1), axis=0)
    tl.atomic_add(nonfinite_ptr, bad)
    key = tl.where(mask, tl.minimum(raw, INF_BITS), -1)
    # invariant: at least k keys >= lo, fewer than k keys >= hi
    lo = tl.zeros([ROWS], dtype=tl.int32)
    hi = tl.full([ROWS], INF_BITS + 1, dtype=tl.int32)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        count = tl.sum((key >= mid[:, None]).to(tl.int32), axis=1)
        fits = count >= k
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid)
    above = key > lo[:, None]
    tie = key == lo[:, None]
    need = k - tl.sum(above.to(tl.int32), axis=1)
    tie_rank = tl.cumsum(tie.to(tl.int32), axis=1)
    # (k = 0: the bisection ends at the +inf pattern, so nothing is above it and need is 0)
    sel = above | (tie & (tie_rank <= need[:, None]))
    pos = tl.cumsum(sel.to(tl.int32), axis=1) - 1
    dst = row[:, None] * per_chunk + pos
    tl.store(idx_ptr + dst, offs.to(idx_ptr.dtype.element_ty), mask=sel)
    tl.store(val_ptr + dst, v, mask=sel)
    if WRITE_RES:
        tl.store(res_ptr + offs, tl.where(sel, tl.zeros_like(v), v), mask=mask)


@triton.jit
def chunk_topk_looped_kernel(
    a_ptr,
    b_ptr,
    v_ptr,
    res_ptr,
    idx_ptr,
    val_ptr,
    nonfinite_ptr,
    n,
    chunk,
    per_chunk,
    of_tail,
    HAS_B: tl.constexpr,
    WRITE_V: tl.constexpr,
    WRITE_RES: tl.constexpr,
    REREAD_B: tl.constexpr,
    TILE: tl.constexpr,
):
    """One chunk per program for chunks larger than a register block: the same bisection, each
    step a sweep over the chunk in tiles (the chunk is re-read from memory or cache: correct
    for every size, not at the memory floor)."""
    row = tl.program_id(0).to(tl.int64)
    start = row * chunk
    length = tl.minimum(n - start, chunk)
    k = tl.where(length >= chunk, per_chunk, of_tail)
    col = tl.arange(0, TILE)
    bad = tl.zeros([TILE], dtype=tl.int32)
    for t in range(0, length, TILE):
        offs = start + t + col
        mask = (t + col) < length
        v = load_sum(a_ptr, b_ptr, offs, mask, HAS_B)
        if WRITE_V:
            tl.store(v_ptr + offs, v, mask=mask)
        raw = v.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
        bad += (mask & (raw >= INF_BITS)).to(tl.int32)
    tl.atomic_add(nonfinite_ptr, tl.sum(bad, axis=0))
    if WRITE_V:  # v_out may alias a or b: the later sweeps read v itself
        src = v_ptr
    else:
        src = a_ptr
    lo = scalar_i32(0)
    hi = scalar_i32(INF_BITS + 1)
    for _ in range(31):
        mid = lo + (hi - lo) // 2
        count = scalar_i32(0)
        for t in range(0, length, TILE):
            offs = start + t + col
            mask = (t + col) < length
            key = tl.where(mask, magnitude_bits(load_sum(src, b_ptr, offs, mask, REREAD_B)), -1)
            count += tl.sum((key >= mid).to(tl.int32), axis=0)
        fits = count >= k
        lo = tl.where(fits, mid, lo)
        hi = tl.where(fits, hi, mid)
    need = k - 0
    for t in range(0, length, TILE):
        offs = start + t + col
        mask = (t + col) < length
        key = tl.where(mask, magnitude_bits(load_sum(src, b_ptr, offs, mask, REREAD_B)), -1)
        need -= tl.sum((key > lo).to(tl.int32), axis=0)
    ties_seen = scalar_i32(0)
    taken = scalar_i32(0)
    for t in range(0, length, TILE):
        offs = start + t + col
        mask = (t + col) < length
        v = load_sum(src, b_ptr, offs, mask, REREAD_B)
        key = tl.where(mask, magnitude_bits(v), -1)
        tie = key == lo
        tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), axis=0)
        sel = (key > lo) | (tie & (tie_rank <= need))
        pos = taken + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        dst = row * per_chunk + pos
        tl.store(idx_ptr + dst, offs.to(idx_ptr.dtype.element_ty), mask=sel)
        tl.store(val_ptr + dst, v, mask=sel)
        if WRITE_RES:
            tl.store(res_ptr + offs, tl.where(sel, tl.zeros_like(v), v), mask=mask)
        ties_seen += tl.sum(tie.to(tl.int32), axis=0)
        taken += tl.sum(sel.to(tl.int32), axis=0)
