"""Triton kernels of the quantizers (:mod:`gradsync.codecs.kernels.quantize`).

Each program covers ``BYTES`` packed bytes, laid out as a ``[BYTES, 8 // bits]`` tile so that
the codes of one byte sit in one row: a row's codes shifted to their bit offsets and summed are
the byte (element ``i`` at bit ``(i % per) * bits`` of byte ``i // per``). Loads and stores of
the tile are contiguous."""

import triton
import triton.language as tl

from gradsync.codecs.kernels.jit.common import hashed_uniform16, load_sum, load_words, round_to


@triton.jit
def tile(BYTES: tl.constexpr, PER: tl.constexpr):
    """The byte indices ``[BYTES]`` of this program, element offsets ``[BYTES, PER]`` and the
    lane of each element in its byte."""
    byte = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    lane = tl.arange(0, PER)
    offs = byte[:, None] * PER + lane[None, :]
    return byte, lane, offs


@triton.jit
def sign_kernel(
    a_ptr,
    b_ptr,
    v_ptr,
    codes_ptr,
    part_ptr,
    n,
    nbytes,
    nblocks,
    HAS_B: tl.constexpr,
    WRITE_V: tl.constexpr,
    BYTES: tl.constexpr,
):
    """onebit: bit 1 where ``v >= 0``; float32 partials per program: sum of v >= 0, their count,
    sum of v < 0, non-finite count (counts exact: a program has fewer than 2^24 elements)."""
    byte, lane, offs = tile(BYTES, 8)
    mask = offs < n
    v = load_sum(a_ptr, b_ptr, offs, mask, HAS_B)
    if WRITE_V:
        tl.store(v_ptr + offs, v, mask=mask)
    x = v.to(tl.float32)
    nonneg = mask & (x >= 0)
    neg = mask & (x < 0)
    packed = tl.sum(nonneg.to(tl.int32) << lane[None, :], axis=1)
    tl.store(codes_ptr + byte, packed.to(tl.uint8), mask=byte < nbytes)
    pid = tl.program_id(0)
    tl.store(part_ptr + pid, tl.sum(tl.sum(tl.where(nonneg, x, 0.0), axis=1), axis=0))
    tl.store(part_ptr + nblocks + pid, tl.sum(tl.sum(nonneg.to(tl.float32), axis=1), axis=0))
    tl.store(part_ptr + 2 * nblocks + pid, tl.sum(tl.sum(tl.where(neg, x, 0.0), axis=1), axis=0))
    bad = mask & ~(tl.abs(x) < float("inf"))
    tl.store(part_ptr + 3 * nblocks + pid, tl.sum(tl.sum(bad.to(tl.float32), axis=1), axis=0))


@triton.jit
def sum_parts_kernel(part_ptr, out_ptr, nblocks, ROWS: tl.constexpr, TILE: tl.constexpr):
    """One program: ``out[r] = sum(part[r * nblocks : (r + 1) * nblocks])`` in float64, for each of
    the ``ROWS`` rows, accumulated in a fixed order (repeatable)."""
    cols = tl.arange(0, TILE)
    for r in range(ROWS):
        acc = tl.zeros([TILE], dtype=tl.float64)
        for start in range(0, nblocks, TILE):
            idx = start + cols
            acc += tl.load(part_ptr + r * nblocks + idx, mask=idx < nblocks, other=0.0).to(tl.float64)
        tl.store(out_ptr + r, tl.sum(acc, axis=0))


@triton.jit
def sign_residual_kernel(v_ptr, codes_ptr, lut_ptr, out_ptr, n, BYTES: tl.constexpr):
    """onebit's commit: ``out = v - lut[bit]`` (``lut = [value of bit 0, value of bit 1]``,
    float32, rounded to v's dtype before the subtraction, as the decode writes it)."""
    byte, lane, offs = tile(BYTES, 8)
    mask = offs < n
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    code = (tl.load(codes_ptr + byte, mask=byte * 8 < n, other=0).to(tl.int32)[:, None] >> lane[None, :]) & 1
    dtype = v_ptr.dtype.element_ty
    low = round_to(tl.load(lut_ptr).to(tl.float32), dtype).to(tl.float32)
    high = round_to(tl.load(lut_ptr + 1).to(tl.float32), dtype).to(tl.float32)
    r = v.to(tl.float32) - tl.where(code != 0, high, low)
    tl.store(out_ptr + offs, round_to(r, dtype), mask=mask)


@triton.jit
def ternary_kernel(
    a_ptr,
    b_ptr,
    v_ptr,
    res_ptr,
    codes_ptr,
    counts_ptr,
    tau_ptr,
    tau_value,
    n,
    nbytes,
    HAS_B: tl.constexpr,
    WRITE_V: tl.constexpr,
    WRITE_RES: tl.constexpr,
    TAU_PTR: tl.constexpr,
    BYTES: tl.constexpr,
):
    """TBQ: code 1 where ``v > tau``, 2 where ``v < -tau``, 0 otherwise (2 bits); atomically
    adds the count of non-zero codes and of inf/NaN elements into ``counts[0:2]``; with
    ``WRITE_RES`` the residual ``v - decoded`` (decoded: +tau, -tau or 0 in v's dtype)."""
    byte, lane, offs = tile(BYTES, 4)
    mask = offs < n
    v = load_sum(a_ptr, b_ptr, offs, mask, HAS_B)
    if WRITE_V:
        tl.store(v_ptr + offs, v, mask=mask)
    if TAU_PTR:
        tau = tl.load(tau_ptr).to(tl.float32)
    else:
        tau = tau_value
    x = v.to(tl.float32)
    up = mask & (x > tau)
    down = mask & (x < -tau)
    code = up.to(tl.int32) + 2 * down.to(tl.int32)
    tl.store(codes_ptr + byte, tl.sum(code << (lane[None, :] * 2), axis=1).to(tl.uint8), mask=byte < nbytes)
    tl.atomic_add(counts_ptr, tl.sum(tl.sum((up | down).to(tl.int32), axis=1), axis=0))
    bad = mask & ~(tl.abs(x) < float("inf"))
    tl.atomic_add(counts_ptr + 1, tl.sum(tl.sum(bad.to(tl.int32), axis=1), axis=0))
    if WRITE_RES:
        dtype = v_ptr.dtype.element_ty
        step = round_to(tau, dtype).to(tl.float32)
        decoded = tl.where(up, step, tl.where(down, -step, 0.0))
        tl.store(res_ptr + offs, round_to(x - decoded, dtype), mask=mask)


@triton.jit
def stochastic_kernel(
    a_ptr,
    b_ptr,
    v_ptr,
    res_ptr,
    lut_ptr,
    codes_ptr,
    mult_ptr,
    words_ptr,
    n,
    nbytes,
    LEVELS: tl.constexpr,
    BITS: tl.constexpr,
    PER: tl.constexpr,
    HAS_B: tl.constexpr,
    WRITE_V: tl.constexpr,
    WRITE_RES: tl.constexpr,
    BYTES: tl.constexpr,
):
    """Stochastic quantization (:func:`gradsync.codecs.ops.stochastic_pack`): ``level =
    clamp(floor(|x| * mult + (1 + u)) - 1, 0, LEVELS)`` (two float32 roundings, no fused
    multiply-add), ``u`` from the 16-bit counter hash; code = level with x's sign bit on top.
    With ``WRITE_RES`` the residual ``v - lut[code]``. ``PER = 8 // BITS`` codes per byte."""
    byte, lane, offs = tile(BYTES, PER)
    mask = offs < n
    v = load_sum(a_ptr, b_ptr, offs, mask, HAS_B)
    if WRITE_V:
        tl.store(v_ptr + offs, v, mask=mask)
    x = v.to(tl.float32)
    k1, k2 = load_words(words_ptr)
    f = hashed_uniform16(offs, k1, k2) + 1.0
    s = tl.abs(x) * tl.load(mult_ptr).to(tl.float32) + f
    # floor(s) - 1 clamped to [0, LEVELS], NaN to 0: s is clamped first so the conversion is safe
    s = tl.where(s == s, s, 0.0)
    s = tl.minimum(tl.maximum(s, 0.0), LEVELS + 2.0)
    level = tl.minimum(tl.maximum(s.to(tl.int32) - 1, 0), LEVELS)
    sign = (x.to(tl.int32, bitcast=True) < 0).to(tl.int32)
    code = tl.where(mask, level | (sign << (BITS - 1)), 0)
    tl.store(
        codes_ptr + byte, tl.sum(code << (lane[None, :] * BITS), axis=1).to(tl.uint8), mask=byte < nbytes
    )
    if WRITE_RES:
        dtype = v_ptr.dtype.element_ty
        decoded = round_to(tl.load(lut_ptr + code, mask=mask, other=0.0).to(tl.float32), dtype)
        tl.store(res_ptr + offs, round_to(x - decoded.to(tl.float32), dtype), mask=mask)


@triton.jit
def cast_kernel(
    a_ptr,
    b_ptr,
    v_ptr,
    res_ptr,
    out_ptr,
    scale_ptr,
    dscale_ptr,
    flags_ptr,
    n,
    HAS_B: tl.constexpr,
    WRITE_V: tl.constexpr,
    WRITE_RES: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """16-bit cast ``y = dtype(x * scale)`` (to nearest even) and, by atomic maxima into
    ``flags[0:3]`` (float32): max |x| ignoring NaN, 1 if any x is inf/NaN, 1 if any y is inf.
    With ``WRITE_RES``: ``v - (float(y) * dscale)`` rounded to v's dtype (the decode, then the
    subtraction, each rounded as torch rounds them)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    v = load_sum(a_ptr, b_ptr, offs, mask, HAS_B)
    if WRITE_V:
        tl.store(v_ptr + offs, v, mask=mask)
    x = v.to(tl.float32)
    y = round_to(x * tl.load(scale_ptr).to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=mask)
    mag = tl.abs(x)
    tl.atomic_max(flags_ptr, tl.max(tl.where(mask & (mag == mag), mag, 0.0), axis=0))
    bad = mask & ~(mag < float("inf"))
    tl.atomic_max(flags_ptr + 1, tl.max(bad.to(tl.float32), axis=0))
    yf = y.to(tl.float32)
    overflow = mask & (tl.abs(yf) == float("inf"))
    tl.atomic_max(flags_ptr + 2, tl.max(overflow.to(tl.float32), axis=0))
    if WRITE_RES:
        dtype = v_ptr.dtype.element_ty
        decoded = round_to(yf * tl.load(dscale_ptr).to(tl.float32), dtype).to(tl.float32)
        tl.store(res_ptr + offs, round_to(x - decoded, dtype), mask=mask)
