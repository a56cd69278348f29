"""Bit packing of 1/2/4/8-bit codes and the fused quantize-and-pack operators.

Codes are packed little-endian inside each byte: element ``i`` of a ``b``-bit code array lives in
byte ``i // (8 // b)`` at bit offset ``(i % (8 // b)) * b``. Decoding maps every code through a
small lookup table, which covers onebit (two reconstruction values), TBQ and TernGrad alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsync.codecs.ops import native
from gradsync.codecs.ops.backend import compilable
from gradsync.codecs.ops.random import hashed_uniform16

SUPPORTED_BITS = (1, 2, 4, 8)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed for ``numel`` codes of ``bits`` bits."""
    per = 8 // bits
    return (numel + per - 1) // per


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    c = codes.reshape(-1).to(torch.int32)
    pad = (-c.numel()) % per
    if pad:
        c = torch.cat([c, c.new_zeros(pad)])
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=c.device)
    return (c.view(-1, per) << shifts).sum(1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    # element i: byte i // per, shifted by (i % per) * bits; written per element so that
    # torch.compile turns it into one loop
    per = 8 // bits
    i = torch.arange(numel, dtype=torch.int32, device=packed.device)
    byte = packed[i // per].to(torch.int32)
    return (byte >> ((i % per) * bits)) & ((1 << bits) - 1)


def pack_codes(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack integer codes (each < 2**bits) into a uint8 tensor."""
    _check_bits(bits)
    packed = _pack(codes, bits)
    if out is None:
        return packed
    out[: packed.numel()].copy_(packed)
    return out[: packed.numel()]


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int64 codes of length ``numel``."""
    _check_bits(bits)
    return _unpack(packed, bits, numel).long()


def lut_decode(
    packed: torch.Tensor,
    bits: int,
    lut: list[float] | torch.Tensor,
    out: torch.Tensor,
    accumulate: bool = False,
) -> torch.Tensor:
    """``out[i] (+)= lut[code_i]`` for the ``out.numel()`` codes in ``packed``. ``lut``: floats,
    or a float32 tensor on ``out``'s device (made there: nothing is copied from the host)."""
    _check_bits(bits)
    if len(lut) != 1 << bits:
        raise ValueError(f"a {bits}-bit lookup table needs {1 << bits} entries, got {len(lut)}")
    n = out.numel()
    if isinstance(lut, torch.Tensor):
        vals = _lut(packed, lut.float(), bits, n).to(out.dtype)
        return out.add_(vals) if accumulate else out.copy_(vals)
    if native.usable(out) and packed.is_cpu and packed.is_contiguous():
        native.ext().lut_unpack(
            native.ptr(packed), packed.nbytes, n, bits, lut, native.ptr(out), out.nbytes, accumulate
        )
        return out
    table = torch.tensor(lut, dtype=torch.float32, device=out.device)
    vals = _lut(packed, table, bits, n).to(out.dtype)
    return out.add_(vals) if accumulate else out.copy_(vals)


@compilable
def _lut(packed: torch.Tensor, table: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    return table[_unpack(packed, bits, numel)]


@dataclass(frozen=True)
class SignStats:
    """Sums by sign from :func:`sign_pack`."""

    pos_sum: float
    pos_count: int
    neg_sum: float
    neg_count: int
    nonfinite: int


def sign_pack(x: torch.Tensor, out: torch.Tensor) -> SignStats:
    """Write one bit per element (1 where ``x >= 0``) into ``out``; return the sums by sign."""
    n = x.numel()
    if native.usable(x):
        sp, cp, sn, nf = native.ext().sign_pack(native.ptr(x), n, native.ptr(out), out.nbytes)
        return SignStats(sp, cp, sn, n - cp, nf)
    packed, st = _sign(x)
    out[: packed.numel()].copy_(packed)
    sp, cp, sn, nf = st.tolist()
    return SignStats(sp, int(cp), sn, n - int(cp), int(nf))


def sign_pack_on_device(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """:func:`sign_pack` with its sums left on the device: float64
    ``[sum of x >= 0, their count, sum of x < 0, non-finite count]``."""
    packed, st = _sign(x)
    out[: packed.numel()].copy_(packed)
    return st


@compilable
def _sign(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    nonneg = xf >= 0
    neg = xf < 0
    parts = [
        torch.where(nonneg, xf, 0.0).sum(),
        nonneg.sum(),
        torch.where(neg, xf, 0.0).sum(),
        (~torch.isfinite(xf)).sum(),
    ]
    return _pack(nonneg, 1), torch.stack([p.to(torch.float64) for p in parts])


def threshold_pack(x: torch.Tensor, tau: float, out: torch.Tensor) -> tuple[int, int]:
    """2-bit codes: 1 where ``x > tau``, 2 where ``x < -tau``, else 0.

    Returns ``(number of non-zero codes, non-zero when any input is inf or NaN)``.
    """
    n = x.numel()
    if native.usable(x):
        return native.ext().ternary_pack(native.ptr(x), n, tau, native.ptr(out), out.nbytes)
    packed, st = _threshold(x, torch.tensor(tau, dtype=torch.float32, device=x.device))
    out[: packed.numel()].copy_(packed)
    nz, nf = st.tolist()
    return nz, nf


def threshold_pack_on_device(x: torch.Tensor, tau: float, out: torch.Tensor) -> torch.Tensor:
    """:func:`threshold_pack` with its counts left on the device: ``[non-zero codes, non-finite]``."""
    packed, st = _threshold(x, torch.full((), tau, dtype=torch.float32, device=x.device))
    out[: packed.numel()].copy_(packed)
    return st


@compilable
def _threshold(x: torch.Tensor, tau: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf = x.float()
    codes = (xf > tau).to(torch.int32) + 2 * (xf < -tau).to(torch.int32)
    return _pack(codes, 2), torch.stack([(codes != 0).sum(), (~torch.isfinite(xf)).sum()])


def stochastic_pack(
    x: torch.Tensor,
    mult: float | torch.Tensor,
    levels: int,
    bits: int,
    words: tuple[int, int] | tuple[torch.Tensor, torch.Tensor],
    out: torch.Tensor,
) -> None:
    """Stochastic symmetric quantization, one pass.

    ``level_i = clamp(floor(|x_i| * mult + u_i), 0, levels)`` with ``u_i`` the counter-based
    uniform of :func:`gradsync.codecs.ops.random.hashed_uniform16` keyed by ``words``; the code is
    the level with x's sign bit on top. ``E[level_i] = |x_i| * mult`` when that is at most
    ``levels``. The sum is formed as ``(|x| * mult) + (1 + u)`` in float32 with separate roundings,
    identically on both paths. Inf/NaN inputs give arbitrary codes: check them first.
    """
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    n = x.numel()
    k1, k2 = words
    dev = x.device
    if isinstance(k1, torch.Tensor) and isinstance(k2, torch.Tensor):  # words drawn on the device
        keys = torch.stack([k1.reshape(()), k2.reshape(())]).to(torch.int64)
    else:
        assert isinstance(k1, int) and isinstance(k2, int)
        if native.usable(x) and not isinstance(mult, torch.Tensor):
            native.ext().stoch_pack(native.ptr(x), n, mult, levels, bits, k1, k2, native.ptr(out), out.nbytes)
            return
        # made on the device from scalars (fill kernels): a tensor built on the host and copied
        # over, or an item assignment (which copies a host scalar), would make the host wait
        keys = torch.empty(2, dtype=torch.int64, device=dev)
        keys[0].fill_(k1)
        keys[1].fill_(k2)
    m = (
        mult.float()
        if isinstance(mult, torch.Tensor)
        else torch.full((), mult, dtype=torch.float32, device=dev)
    )
    packed = _stochastic(x, m, keys, levels, bits)
    out[: packed.numel()].copy_(packed)


@compilable
def _stochastic(
    x: torch.Tensor, mult: torch.Tensor, keys: torch.Tensor, levels: int, bits: int
) -> torch.Tensor:
    xf = x.float()
    f = hashed_uniform16(xf.numel(), keys[0], keys[1], xf.device) + 1.0  # exact: u has 16 bits
    lvl = (torch.floor(xf.abs() * mult + f) - 1).nan_to_num(0.0).clamp(0, levels).to(torch.int32)
    codes = lvl | (torch.signbit(xf).to(torch.int32) << (bits - 1))
    return _pack(codes, bits)
