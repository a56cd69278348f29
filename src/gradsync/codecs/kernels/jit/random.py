"""Triton kernel of the stratified random-k (:mod:`gradsync.codecs.kernels.random`)."""

import triton
import triton.language as tl

from gradsync.codecs.kernels.jit.common import hashed_bits, load_sum, load_words


@triton.jit
def strata_kernel(
    words_ptr,
    idx_ptr,
    size_ptr,
    a_ptr,
    b_ptr,
    val_ptr,
    n,
    k,
    WRITE_SIZE: tl.constexpr,
    GATHER: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Stratum ``i`` is ``[i * n // k, (i + 1) * n // k)``; its position is its start plus
    ``(m_i * size_i) >> 23`` with ``m_i`` the 23-bit integer of the hashed uniform ``u_i``
    (integer arithmetic: exact, and the same in torch)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = i < k
    lo = i * n // k
    size = (i + 1) * n // k - lo
    k1, k2 = load_words(words_ptr)
    draw = (hashed_bits(i, k1, k2) >> 9).to(tl.int64)
    pos = lo + ((draw * size) >> 23)
    tl.store(idx_ptr + i, pos.to(idx_ptr.dtype.element_ty), mask=m)
    if WRITE_SIZE:
        tl.store(size_ptr + i, size.to(size_ptr.dtype.element_ty), mask=m)
    if GATHER:
        tl.store(val_ptr + i, load_sum(a_ptr, b_ptr, pos, m, HAS_B), mask=m)
