"""The quantizers' encode with error feedback fused, one read of the data each: onebit's sign
bits and sums, TBQ's ternary codes (and residual), stochastic quantization (TernGrad) and the
16-bit float casts, with their commits (the residual ``v - decode(payload)``).

Packing follows :mod:`gradsync.codecs.ops.bits`: element ``i`` of a ``b``-bit code array is in
byte ``i // (8 // b)`` at bit ``(i % (8 // b)) * b``. Codes, counts, flags and residuals equal
the torch operators' bit for bit; onebit's float sums are accumulated per program in float32
and across programs in float64, so they match torch's to rounding only.

Two-pass codecs stay two passes: TernGrad's scale is the maximum of ``v``
(:func:`~gradsync.codecs.kernels.threshold.fused_stats` first, which also writes ``v``) and the
16-bit casts without an agreed maximum need theirs before the cast.
"""

from __future__ import annotations

import torch

from gradsync.codecs.kernels.launch import (
    ScratchLayout,
    cdiv,
    check_addend,
    check_out,
    check_words,
    module,
    use_kernels,
)
from gradsync.codecs.ops import FORMAT_MAX, hashed_uniform16, pack_codes, packed_nbytes

_ELEMENTS = 4096  # elements per program


def _bytes(bits: int) -> int:
    """Packed bytes per program."""
    return _ELEMENTS * bits // 8


_CAST_BLOCK = 4096
_TILE = 1024


def onebit_layout(n: int) -> ScratchLayout:
    """Scratch of :func:`onebit_encode`: four float32 partials per program."""
    return ScratchLayout((("part", 4 * cdiv(n, _ELEMENTS), torch.float32),))


def _check_v(name: str, a: torch.Tensor, t: torch.Tensor | None) -> None:
    if t is not None:
        check_out(name, t, a.numel(), (a.dtype,), a.device)


def onebit_encode(
    a: torch.Tensor,
    codes_out: torch.Tensor,
    sums_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """onebit's pass over ``v = a (+ b)``: ``codes_out`` (uint8, ``ceil(n / 8)`` bytes) gets a 1
    bit where ``v >= 0``; ``sums_out`` (float64, 4) gets ``[sum of v >= 0, their count, sum of
    v < 0, inf/NaN count]`` (:func:`gradsync.codecs.ops.sign_pack_on_device`'s values: NaN is
    in neither sum and has bit 0); ``v_out`` gets ``v``. Scratch: :func:`onebit_layout`."""
    check_addend(a, b)
    n, dev = a.numel(), a.device
    check_out("codes_out", codes_out, packed_nbytes(n, 1), (torch.uint8,), dev)
    check_out("sums_out", sums_out, 4, (torch.float64,), dev)
    _check_v("v_out", a, v_out)
    if not use_kernels(a):
        onebit_encode_torch(a, codes_out, sums_out, b=b, v_out=v_out)
        return
    if n == 0:
        sums_out[:4].zero_()
        return
    nbytes = packed_nbytes(n, 1)
    blocks = cdiv(n, _ELEMENTS)
    part = onebit_layout(n).carve(scratch, dev)["part"]
    kernels = module("quantize")
    kernels.sign_kernel[(blocks,)](
        a,
        b if b is not None else a,
        v_out if v_out is not None else a,
        codes_out,
        part,
        n,
        nbytes,
        blocks,
        HAS_B=b is not None,
        WRITE_V=v_out is not None,
        BYTES=_bytes(1),
        num_warps=8,
        enable_fp_fusion=False,
    )
    kernels.sum_parts_kernel[(1,)](
        part, sums_out, blocks, ROWS=4, TILE=_TILE, num_warps=4, enable_fp_fusion=False
    )


def onebit_encode_torch(
    a: torch.Tensor,
    codes_out: torch.Tensor,
    sums_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """:func:`onebit_encode` in torch operations (``scratch`` unused)."""
    check_addend(a, b)
    v = (torch.add(a, b) if b is not None else a).view(-1)
    xf = v.float()
    nonneg, neg = xf >= 0, xf < 0
    parts = [
        torch.where(nonneg, xf, 0.0).sum(),
        nonneg.sum(),
        torch.where(neg, xf, 0.0).sum(),
        (~torch.isfinite(xf)).sum(),
    ]
    sums_out[:4].copy_(torch.stack([p.to(torch.float64) for p in parts]))
    pack_codes(nonneg.to(torch.int32), 1, codes_out)
    if v_out is not None:
        v_out.view(-1)[: v.numel()].copy_(v)


def _unpack(codes: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    per = 8 // bits
    i = torch.arange(n, dtype=torch.int64, device=codes.device)
    return (codes[i // per].to(torch.int32) >> ((i % per) * bits).to(torch.int32)) & ((1 << bits) - 1)


def lut_residual(
    v: torch.Tensor,
    codes: torch.Tensor,
    bits: int,
    lut: torch.Tensor,
    residual_out: torch.Tensor | None = None,
) -> None:
    """Error feedback's commit for a lookup-table code: ``v - lut[code]`` into ``residual_out``
    (in place into ``v`` when None), ``lut[code]`` rounded to v's dtype first, as the decode
    writes it. A kernel for onebit (``bits=1``); torch operations for the other widths (their
    encode kernels write the residual in the same pass)."""
    n, dev = v.numel(), v.device
    check_out("codes", codes, packed_nbytes(n, bits), (torch.uint8,), dev)
    if lut.numel() != 1 << bits or lut.device != dev:
        raise ValueError(f"lut must hold {1 << bits} values on {dev}")
    out = residual_out if residual_out is not None else v
    check_out("residual_out", out, n, (v.dtype,), dev)
    if n == 0:
        return
    if bits == 1 and use_kernels(v) and lut.dtype == torch.float32:
        module("quantize").sign_residual_kernel[(cdiv(n, _ELEMENTS),)](
            v, codes, lut, out, n, BYTES=_bytes(1), num_warps=8, enable_fp_fusion=False
        )
        return
    decoded = lut.float()[_unpack(codes, bits, n)].to(v.dtype)
    torch.sub(v.view(-1), decoded, out=out.view(-1)[:n])


def tbq_encode(
    a: torch.Tensor,
    tau: float | torch.Tensor,
    codes_out: torch.Tensor,
    counts_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> None:
    """TBQ over ``v = a (+ b)``: 2-bit codes into ``codes_out`` (1 where ``v > tau``, 2 where
    ``v < -tau``, 0 otherwise; ``tau`` a float or a one-element float device tensor, compared in
    float32), ``counts_out[0:2]`` (int32 or int64) = ``[non-zero codes, inf/NaN count]``
    (:func:`gradsync.codecs.ops.threshold_pack_on_device`'s), ``v_out`` = ``v``, and
    ``residual_out`` = ``v - decoded`` with decoded ``+tau``, ``-tau`` or 0 (tau rounded to v's
    dtype): error feedback's commit in the same pass. No scratch."""
    check_addend(a, b)
    n, dev = a.numel(), a.device
    check_out("codes_out", codes_out, packed_nbytes(n, 2), (torch.uint8,), dev)
    check_out("counts_out", counts_out, 2, (torch.int32, torch.int64), dev)
    _check_v("v_out", a, v_out)
    _check_v("residual_out", a, residual_out)
    if isinstance(tau, torch.Tensor) and (tau.numel() != 1 or tau.device != dev):
        raise ValueError(f"tau must be a float or a one-element tensor on {dev}")
    if not use_kernels(a):
        tbq_encode_torch(a, tau, codes_out, counts_out, b=b, v_out=v_out, residual_out=residual_out)
        return
    counts_out.zero_()
    if n == 0:
        return
    nbytes = packed_nbytes(n, 2)
    dummy = a
    by_ptr = isinstance(tau, torch.Tensor)
    module("quantize").ternary_kernel[(cdiv(n, _ELEMENTS),)](
        a,
        b if b is not None else dummy,
        v_out if v_out is not None else dummy,
        residual_out if residual_out is not None else dummy,
        codes_out,
        counts_out,
        tau if isinstance(tau, torch.Tensor) else dummy,
        0.0 if by_ptr else float(tau),
        n,
        nbytes,
        HAS_B=b is not None,
        WRITE_V=v_out is not None,
        WRITE_RES=residual_out is not None,
        TAU_PTR=by_ptr,
        BYTES=_bytes(2),
        num_warps=8,
        enable_fp_fusion=False,
    )


def tbq_encode_torch(
    a: torch.Tensor,
    tau: float | torch.Tensor,
    codes_out: torch.Tensor,
    counts_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> None:
    """:func:`tbq_encode` in torch operations."""
    check_addend(a, b)
    v = (torch.add(a, b) if b is not None else a).view(-1)
    xf = v.float()
    t = tau.reshape(()).float() if isinstance(tau, torch.Tensor) else torch.full((), tau, device=v.device)
    up, down = xf > t, xf < -t
    codes = up.to(torch.int32) + 2 * down.to(torch.int32)
    pack_codes(codes, 2, codes_out)
    counts_out[:2].copy_(torch.stack([(codes != 0).sum(), (~torch.isfinite(xf)).sum()]))
    if residual_out is not None:
        step = t.to(v.dtype)
        decoded = torch.where(up, step, torch.where(down, -step, torch.zeros_like(step)))
        residual_out.view(-1)[: v.numel()].copy_(v - decoded)
    if v_out is not None:
        v_out.view(-1)[: v.numel()].copy_(v)


def _check_stochastic(
    a: torch.Tensor,
    mult: torch.Tensor,
    bits: int,
    words: torch.Tensor,
    codes_out: torch.Tensor,
    lut: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> None:
    n, dev = a.numel(), a.device
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    if mult.numel() != 1 or mult.device != dev:
        raise ValueError(f"mult must be a one-element tensor on {dev}")
    check_words(words, dev)
    check_out("codes_out", codes_out, packed_nbytes(n, bits), (torch.uint8,), dev)
    if residual_out is not None:
        if lut is None or lut.numel() != 1 << bits or lut.device != dev:
            raise ValueError(f"residual_out needs lut: {1 << bits} decoded values on {dev}")
        _check_v("residual_out", a, residual_out)


def stochastic_encode(
    a: torch.Tensor,
    mult: torch.Tensor,
    levels: int,
    bits: int,
    words: torch.Tensor,
    codes_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    lut: torch.Tensor | None = None,
) -> None:
    """Stochastic quantization of ``v = a (+ b)`` (TernGrad's, :func:`gradsync.codecs.ops.stochastic_pack`
    with a tensor ``mult``): ``level = clamp(floor(|v| * mult + (1 + u)) - 1, 0, levels)``,
    ``u`` from :func:`gradsync.codecs.ops.hashed_uniform16` keyed by ``words`` (int64 device
    tensor ``[k1, k2]``), code = level with v's sign bit at bit ``bits - 1``, packed into
    ``codes_out``. ``mult``: a one-element device tensor. ``residual_out`` (needs ``lut``, the
    ``2^bits`` decoded values as a device tensor, as the decode builds them): ``v - lut[code]``.
    Inf/NaN inputs give arbitrary (but equal to the reference's) codes. No scratch."""
    check_addend(a, b)
    _check_stochastic(a, mult, bits, words, codes_out, lut, residual_out)
    _check_v("v_out", a, v_out)
    n = a.numel()
    if not use_kernels(a):
        stochastic_encode_torch(
            a, mult, levels, bits, words, codes_out, b=b, v_out=v_out, residual_out=residual_out, lut=lut
        )
        return
    if n == 0:
        return
    nbytes = packed_nbytes(n, bits)
    per = 8 // bits
    dummy = a
    module("quantize").stochastic_kernel[(cdiv(n, _ELEMENTS),)](
        a,
        b if b is not None else dummy,
        v_out if v_out is not None else dummy,
        residual_out if residual_out is not None else dummy,
        lut if lut is not None else dummy,
        codes_out,
        mult,
        words,
        n,
        nbytes,
        LEVELS=levels,
        BITS=bits,
        PER=per,
        HAS_B=b is not None,
        WRITE_V=v_out is not None,
        WRITE_RES=residual_out is not None,
        BYTES=_bytes(bits),
        num_warps=8,
        enable_fp_fusion=False,
    )


def stochastic_encode_torch(
    a: torch.Tensor,
    mult: torch.Tensor,
    levels: int,
    bits: int,
    words: torch.Tensor,
    codes_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    lut: torch.Tensor | None = None,
) -> None:
    """:func:`stochastic_encode` in torch operations (the operator's own formula)."""
    check_addend(a, b)
    _check_stochastic(a, mult, bits, words, codes_out, lut, residual_out)
    v = (torch.add(a, b) if b is not None else a).view(-1)
    xf = v.float()
    f = hashed_uniform16(xf.numel(), words[0], words[1], xf.device) + 1.0
    s = xf.abs() * mult.reshape(()).float() + f
    lvl = (torch.floor(s) - 1).nan_to_num(0.0).clamp(0, levels).to(torch.int32)
    codes = lvl | (torch.signbit(xf).to(torch.int32) << (bits - 1))
    pack_codes(codes, bits, codes_out)
    if residual_out is not None:
        assert lut is not None
        decoded = lut.float()[codes.long()].to(v.dtype)
        residual_out.view(-1)[: v.numel()].copy_(v - decoded)
    if v_out is not None:
        v_out.view(-1)[: v.numel()].copy_(v)


def _check_cast(
    a: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor,
    out: torch.Tensor,
    flags_out: torch.Tensor,
    residual_out: torch.Tensor | None,
    decode_scale: torch.Tensor | None,
) -> torch.Tensor:
    n, dev = a.numel(), a.device
    if dtype not in FORMAT_MAX:
        raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
    if scale.numel() != 1 or scale.device != dev:
        raise ValueError(f"scale must be a one-element tensor on {dev}")
    if out.element_size() != 2 or out.numel() < n or out.device != dev or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous 2-byte tensor of at least {n} elements on {dev}")
    check_out("flags_out", flags_out, 3, (torch.float32,), dev)
    if residual_out is not None:
        if decode_scale is None or decode_scale.numel() != 1 or decode_scale.device != dev:
            raise ValueError(f"residual_out needs decode_scale: a one-element tensor on {dev}")
        _check_v("residual_out", a, residual_out)
    return out.view(dtype)


def cast_encode(
    a: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor,
    out: torch.Tensor,
    flags_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    decode_scale: torch.Tensor | None = None,
) -> None:
    """The checked 16-bit cast of ``v = a (+ b)`` (:func:`gradsync.codecs.ops.cast_on_device`):
    ``out`` (any 2-byte tensor; its bits are written) = ``dtype(v * scale)``, to nearest even;
    ``flags_out`` (float32, 3) = ``[max |v| ignoring NaN, 1 if any v is inf/NaN, 1 if any result
    is inf]``; ``v_out`` = ``v``; ``residual_out`` = ``v - float(out) * decode_scale`` (rounded
    as the decode and the subtraction round: error feedback's commit; ``decode_scale`` a
    one-element device tensor, the decode's ``2^-e``). No scratch."""
    check_addend(a, b)
    y = _check_cast(a, dtype, scale, out, flags_out, residual_out, decode_scale)
    _check_v("v_out", a, v_out)
    n = a.numel()
    if not use_kernels(a):
        cast_encode_torch(
            a,
            dtype,
            scale,
            out,
            flags_out,
            b=b,
            v_out=v_out,
            residual_out=residual_out,
            decode_scale=decode_scale,
        )
        return
    flags_out.zero_()
    if n == 0:
        return
    dummy = a
    module("quantize").cast_kernel[(cdiv(n, _CAST_BLOCK),)](
        a,
        b if b is not None else dummy,
        v_out if v_out is not None else dummy,
        residual_out if residual_out is not None else dummy,
        y,
        scale,
        decode_scale if decode_scale is not None else scale,
        flags_out,
        n,
        HAS_B=b is not None,
        WRITE_V=v_out is not None,
        WRITE_RES=residual_out is not None,
        BLOCK=_CAST_BLOCK,
        num_warps=8,
        enable_fp_fusion=False,
    )


def cast_encode_torch(
    a: torch.Tensor,
    dtype: torch.dtype,
    scale: torch.Tensor,
    out: torch.Tensor,
    flags_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    decode_scale: torch.Tensor | None = None,
) -> None:
    """:func:`cast_encode` in torch operations."""
    check_addend(a, b)
    y = _check_cast(a, dtype, scale, out, flags_out, residual_out, decode_scale)
    v = (torch.add(a, b) if b is not None else a).view(-1)
    n = v.numel()
    xf = v.float()
    cast = (xf * scale.reshape(()).float()).to(dtype)
    y[:n].copy_(cast)
    mag = xf.abs()
    if n:
        flags = [
            torch.where(torch.isnan(mag), 0.0, mag).amax(),
            (~torch.isfinite(xf)).any(),
            torch.isinf(cast).any(),
        ]
        flags_out[:3].copy_(torch.stack([f.float() for f in flags]))
    else:
        flags_out[:3].zero_()
    if residual_out is not None:
        assert decode_scale is not None
        decoded = (cast.float() * decode_scale.reshape(()).float()).to(v.dtype)
        residual_out.view(-1)[:n].copy_(v - decoded)
    if v_out is not None:
        v_out.view(-1)[:n].copy_(v)
