"""Randomness for codecs: explicit generators, counter-based uniforms, stochastic rounding.

Rules (see DESIGN.md): no codec touches the global RNG. Each tensor stream owns a
``torch.Generator`` seeded from ``(config seed, stream key)`` with a stable hash, so every rank
that builds the same codec draws the same numbers. Per-element noise (stochastic rounding) uses a
counter-based hash of the element index keyed by two 32-bit words drawn from that generator: it
costs no memory, runs inside one fused pass, and the torch formula below gives bit-identical
draws to the native kernel.
"""

from __future__ import annotations

import hashlib

import torch

from gradsync.codecs.ops import native
from gradsync.codecs.ops.backend import expected_host_read

_M32 = 0xFFFFFFFF


def stream_seed(seed: int, key: str) -> int:
    """A 63-bit seed for stream ``key`` of a codec seeded with ``seed``; stable across processes."""
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def make_generator(seed: int, key: str = "") -> torch.Generator:
    """A CPU generator for one stream (CPU so that its state is device-independent)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(stream_seed(seed, key))
    return g


def draw_words(gen: torch.Generator, count: int = 2) -> list[int]:
    """``count`` uniformly random 32-bit words from ``gen`` (a CPU generator: no device is read)."""
    with expected_host_read("a stream's CPU generator"):
        return [int(v) for v in torch.randint(0, 2**32, (count,), generator=gen, dtype=torch.int64)]


def device_words(counter: torch.Tensor, seed: int, count: int = 2) -> torch.Tensor:
    """``count`` random 32-bit words as an int64 tensor on ``counter``'s device, for call number
    ``counter`` (a 0-dim int64 device tensor) of a stream seeded ``seed``; ``counter`` advances
    by one, on the device. Nothing is read or written by the host, so a replayed CUDA graph draws
    new words on every replay (the words of call ``c`` are a hash of ``(seed, c, j)``)."""
    j = torch.arange(count, dtype=torch.int64, device=counter.device)
    h = _mix32((counter * count + j + (seed & _M32)) & _M32)
    h = _mix32(h ^ ((seed >> 32) & _M32))
    counter.add_(1)
    return h


def draw_index(gen: torch.Generator, high: int) -> int:
    """A uniform integer in ``[0, high)``."""
    if high <= 0:
        raise ValueError(f"high must be positive, got {high}")
    return int(torch.randint(0, high, (1,), generator=gen, device=gen.device))


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    # (h * c) mod 2^32 without overflowing int64: split c into 16-bit halves.
    lo, hi = c & 0xFFFF, c >> 16
    return (h * lo + ((h * hi) & 0xFFFF) * 65536) & _M32


def _mix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x7FEB352D)
    h = h ^ (h >> 15)
    h = _mul32(h, 0x846CA68B)
    return h ^ (h >> 16)


def hashed_uniform(
    n: int, k1: int | torch.Tensor, k2: int | torch.Tensor, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """``u[i] = ((mix(i + k1) ^ k2) >> 9) / 2^23`` for ``i < n``, as float32 in ``[0, 1)``.

    ``mix`` is the "lowbias32" integer hash; ``k1``, ``k2`` are fresh random 32-bit words per call
    (ints, or 0-dim int64 tensors on ``device``: words drawn on the device)."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    h = _mix32((i + k1) & _M32) ^ k2
    return (h >> 9).to(torch.float32) * (1.0 / 8388608.0)


def hashed_uniform16(
    n: int, k1: int | torch.Tensor, k2: int | torch.Tensor, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """Uniforms of 16-bit resolution, two per hash: the stream that stochastic quantization uses.

    Element ``i`` lies in block ``b = i // 16`` at lane ``j = i % 8``, in the low half when
    ``i % 16 < 8``: ``h = mix(8 b + j + k1) ^ k2`` and ``u = (h & 0xffff or h >> 16) / 2^16``.
    Halving the hashing per element makes the fused quantize pass about a third cheaper; 16 bits
    of resolution bias a rounding decision by at most 2^-16 of one level. The words may be 0-d
    int64 tensors (the compiled quantizer passes them so: new words need no recompilation).
    """
    i = torch.arange(n, dtype=torch.int64, device=device)
    h = _mix32(((i >> 4) * 8 + (i & 7) + k1) & _M32) ^ k2
    half = torch.where((i & 8) != 0, h >> 16, h & 0xFFFF)
    return half.to(torch.float32) * (1.0 / 65536.0)


def stochastic_round(x: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Round each entry of ``x`` down or up at random so that the expectation is ``x``."""
    k1, k2 = draw_words(gen)
    u = hashed_uniform(x.numel(), k1, k2, x.device).view_as(x)
    return torch.floor(x.float() + u)


def random_subset(n: int, k: int, gen: torch.Generator, device: torch.device | str = "cpu") -> torch.Tensor:
    """``k`` distinct indices drawn uniformly from ``range(n)``, in increasing order.

    int32 on the native path, int64 otherwise. The native path (Floyd's algorithm, O(k)) and the
    torch path (a random permutation, O(n)) draw different, equally uniform subsets.
    """
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, n={n}], got {k}")
    if native.enabled() and n <= native.MAX_NUMEL and torch.device(device).type == "cpu":
        lo, hi = draw_words(gen)
        idx = torch.empty(k, dtype=torch.int32)
        bitmap = torch.empty((n + 63) // 64, dtype=torch.int64)
        native.ext().random_subset(
            n, k, lo | (hi << 32), native.ptr(idx), idx.nbytes, native.ptr(bitmap), bitmap.nbytes
        )
        return idx
    perm = torch.randperm(n, generator=gen)[:k]
    return perm.sort().values.to(device)
