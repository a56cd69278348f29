"""Bit packing of 1/2/4/8-bit codes and the fused quantize-and-pack operators.

Codes are packed little-endian inside each byte: element ``i`` of a ``b``-bit code array lives in
byte ``i // (8 // b)`` at bit offset ``(i % (8 // b)) * b``. Decoding maps every code through a
small lookup table, which covers onebit (two reconstruction values), TBQ and TernGrad alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsync.codecs.ops import native
from gradsync.codecs.ops.random import hashed_uniform16

SUPPORTED_BITS = (1, 2, 4, 8)


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes needed for ``numel`` codes of ``bits`` bits."""
    per = 8 // bits
    return (numel + per - 1) // per


def _check_bits(bits: int) -> None:
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits}")


def pack_codes(codes: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Pack integer codes (each < 2**bits) into a uint8 tensor."""
    _check_bits(bits)
    n = codes.numel()
    nbytes = packed_nbytes(n, bits)
    per = 8 // bits
    c = codes.reshape(-1).to(torch.int32)
    if n % per:
        c = torch.cat([c, c.new_zeros(per - n % per)])
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=c.device)
    packed = (c.view(-1, per) << shifts).sum(1).to(torch.uint8)
    if out is None:
        return packed
    out[:nbytes].copy_(packed)
    return out[:nbytes]


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: int64 codes of length ``numel``."""
    _check_bits(bits)
    shifts = torch.arange(0, 8, bits, dtype=torch.int64, device=packed.device)
    codes = (packed[: packed_nbytes(numel, bits)].long().unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(-1)[:numel]


def lut_decode(
    packed: torch.Tensor, bits: int, lut: list[float], out: torch.Tensor, accumulate: bool = False
) -> torch.Tensor:
    """``out[i] (+)= lut[code_i]`` for the ``out.numel()`` codes in ``packed``."""
    _check_bits(bits)
    if len(lut) != 1 << bits:
        raise ValueError(f"a {bits}-bit lookup table needs {1 << bits} entries, got {len(lut)}")
    n = out.numel()
    if native.usable(out):
        native.ext().lut_unpack(native.ptr(packed), n, bits, lut, native.ptr(out), accumulate)
        return out
    table = torch.tensor(lut, dtype=torch.float32, device=out.device)
    vals = table[unpack_codes(packed, bits, n)].to(out.dtype)
    return out.add_(vals) if accumulate else out.copy_(vals)


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
        sp, cp, sn, nf = native.ext().sign_pack(native.ptr(x), n, native.ptr(out))
        return SignStats(sp, cp, sn, n - cp, nf)
    xf = x.float()
    nonneg = xf >= 0
    pack_codes(nonneg, 1, out=out)
    cp = int(nonneg.sum())
    return SignStats(
        float(xf[nonneg].sum()),
        cp,
        float(xf[~nonneg & ~xf.isnan()].sum()),
        n - cp,
        int((~torch.isfinite(xf)).sum()),
    )


def threshold_pack(x: torch.Tensor, tau: float, out: torch.Tensor) -> tuple[int, int]:
    """2-bit codes: 1 where ``x > tau``, 2 where ``x < -tau``, else 0.

    Returns ``(number of non-zero codes, number of non-finite inputs)``.
    """
    n = x.numel()
    if native.usable(x):
        return native.ext().ternary_pack(native.ptr(x), n, tau, native.ptr(out))
    xf = x.float()
    t = torch.tensor(tau, dtype=torch.float32)
    codes = (xf > t).to(torch.int32) + 2 * (xf < -t).to(torch.int32)
    pack_codes(codes, 2, out=out)
    return int((codes != 0).sum()), int((~torch.isfinite(xf)).sum())


def stochastic_pack(
    x: torch.Tensor, mult: float, levels: int, bits: int, words: tuple[int, int], out: torch.Tensor
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
    if native.usable(x):
        native.ext().stoch_pack(native.ptr(x), n, mult, levels, bits, k1, k2, native.ptr(out))
        return
    xf = x.float()
    f = hashed_uniform16(n, k1, k2, x.device) + 1.0  # exact: u has 16 bits
    m = torch.tensor(mult, dtype=torch.float32, device=x.device)
    lvl = (torch.floor(xf.abs() * m + f) - 1).nan_to_num(0.0).clamp(0, levels).to(torch.int32)
    codes = lvl | (torch.signbit(xf).to(torch.int32) << (bits - 1))
    pack_codes(codes, bits, out=out)
