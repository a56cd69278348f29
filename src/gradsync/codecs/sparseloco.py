"""``sparseloco``: SparseLoCo's pseudo-gradient codec, chunked top-k with chunk-local indices and
values of a few bits.

Each chunk of ``chunk`` elements keeps its ``ceil(density * chunk)`` largest magnitudes (the
shorter last chunk its own share), as ``chunktopk`` does, but sends them compactly:

- an index is the position inside its chunk, 16 bits (``chunk`` is at most 65536), not 32;
- a value is ``bits`` bits: its sign, and ``bits - 1`` bits that place its magnitude on
  ``2^(bits - 1)`` evenly spaced levels from the smallest to the largest magnitude the chunk
  kept (rounded to the nearest; the two ends are sent per chunk, two float32). With ``bits=2``
  a value is sent as plus or minus the chunk's smallest or largest kept magnitude.

So the payload's size follows from the tensor's size alone. At the default density (64 of every
4096) a chunk costs 64 x 16 index bits, 64 x 2 value bits and 64 bits of ends: about 108 times
less than float32. The rounding is biased: give it error feedback (``+ef``, which ``wrap`` and
the outer loop add themselves), whose ``decay`` option keeps a fading residual in place of
momentum as SparseLoCo does (``sparseloco+ef:decay=0.95``).

Payload: the header (``count``: elements sent) + int16 local indices (the 16-bit pattern of the
position) + the packed codes (``bits`` per element, the sign on top) + the ends' float32 lows
and highs, one of each per chunk.

Reference: SparseLoCo, Templar's sparse outer-gradient DiLoCo variant (chunked top-k, 2-bit
values, error feedback with a decay), arXiv:2508.15706.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from gradsync.codecs import selection, selection_on_device
from gradsync.codecs.base import Codec, EncodeContext, Stream, nonfinite_flag
from gradsync.codecs.config import SparsityConfig, check_choice, check_range
from gradsync.codecs.ops import pack_codes, packed_nbytes, sparse_add_, sparse_to_dense_, unpack_codes
from gradsync.codecs.payload import Header, Layout, Payload, device_flags, write_device_header
from gradsync.codecs.registry import register
from gradsync.codecs.sparse import chunk_counts

MAX_CHUNK = 1 << 16
"""The largest chunk whose positions fit 16 bits."""


@dataclass(frozen=True)
class SparselocoConfig(SparsityConfig):
    codec: ClassVar[str] = "sparseloco"
    chunk: int = 4096
    """Elements per chunk (at most 65536: a position inside it is sent in 16 bits)."""
    bits: int = 2
    """Bits per value sent: the sign and ``bits - 1`` bits of magnitude (2, 4 or 8)."""

    def validate(self) -> None:
        if self.k is not None:
            raise ValueError(
                f"{self.codec}: give density (the share each chunk keeps), not k (got k={self.k})"
            )
        super().validate()
        check_range(self.codec, "chunk", self.chunk, 1, MAX_CHUNK)
        check_choice(self.codec, "bits", self.bits, (2, 4, 8))


@register
class SparseLoCo(Codec[Stream]):
    """Chunked top-k with chunk-local 16-bit indices and ``bits``-bit values (see the module)."""

    name = "sparseloco"
    Config = SparselocoConfig
    config: SparselocoConfig
    sparse = True
    capturable = True

    @property
    def host_free(self) -> bool:
        return True  # the counts follow from the size alone

    # ------------------------------------------------------------------ sizes
    def _counts(self, numel: int) -> tuple[int, int, int]:
        """(full chunks, elements kept per full chunk, elements kept of the last, shorter one)."""
        density = self.scheduled_density if self.scheduled_density is not None else self.config.density
        assert density is not None
        return chunk_counts(numel, self.config.chunk, density)

    def _layout(self, numel: int) -> Layout:
        full, per, tail = self._counts(numel)
        count, chunks = full * per + tail, full + (1 if tail else 0)
        return Layout([
            ("idx", count, torch.int16),
            ("codes", packed_nbytes(count, self.config.bits), torch.uint8),
            ("lo", chunks, torch.float32),
            ("hi", chunks, torch.float32),
        ])  # fmt: skip

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        return self._layout(numel).nbytes

    def check_numel(self, numel: int) -> None:
        self._counts(numel)

    # ------------------------------------------------------------------ encode
    def _encode(
        self, x: torch.Tensor, shape: torch.Size, ctx: EncodeContext, stream: Stream, out: torch.Tensor | None
    ) -> Payload:
        n = x.numel()
        lay = self._layout(n)
        data, payload = self._new_payload(lay, x, shape, out)
        full, per, tail = self._counts(n)
        if self._on_device:
            sel = selection_on_device.chunked_topk(x, self.config.chunk, per, tail) if n else None
            idx, val = (sel.idx, sel.val) if sel is not None else (x.new_zeros(0, dtype=torch.int32), x[:0])
        else:
            chosen = selection.chunked_topk(x, self.config.chunk, per, tail) if n else None
            idx, val = (
                (chosen.idx, chosen.val) if chosen is not None else (x.new_zeros(0, dtype=torch.int32), x[:0])
            )
        self._pack(data, lay, idx, val, full, per)
        if self._on_device:
            nonfinite = (
                sel.nonfinite if sel is not None else torch.zeros((), dtype=torch.bool, device=x.device)
            )
            write_device_header(data, idx.numel(), device_flags(nonfinite))
            return payload
        bad = bool(chosen.stats.nonfinite) if chosen is not None else False
        return self._finish(data, payload, Header(count=idx.numel(), flags=nonfinite_flag(bad)))

    def _pack(
        self, data: torch.Tensor, lay: Layout, idx: torch.Tensor, val: torch.Tensor, full: int, per: int
    ) -> None:
        """Write the local indices, the codes and the chunks' ends of the selection."""
        if not idx.numel():
            return
        chunk, levels = self.config.chunk, 1 << (self.config.bits - 1)
        chunk_of = self._chunk_of(idx.numel(), full, per, idx.device)
        local = idx.long() - chunk_of * chunk
        lay.view(data, "idx").copy_(local.to(torch.int16))  # (the 16-bit pattern: wraps above 32767)
        mag = val.float().abs()
        chunks = lay.sections["lo"][1]
        lo = torch.full((chunks,), math.inf, device=idx.device).scatter_reduce(0, chunk_of, mag, "amin")
        hi = torch.zeros(chunks, device=idx.device).scatter_reduce(0, chunk_of, mag, "amax")
        lo = torch.minimum(lo, hi)  # (a non-finite chunk: its ends as they come; the header flags it)
        span = (hi - lo)[chunk_of]
        step = torch.where(span > 0, span / (levels - 1), 1.0) if levels > 1 else torch.ones_like(span)
        level = torch.round((mag - lo[chunk_of]) / step).nan_to_num(0.0).clamp(0, levels - 1).to(torch.int32)
        codes = level | (torch.signbit(val.float()).to(torch.int32) << (self.config.bits - 1))
        pack_codes(codes, self.config.bits, out=lay.view(data, "codes"))
        lay.view(data, "lo").copy_(lo)
        lay.view(data, "hi").copy_(hi)

    def _chunk_of(self, count: int, full: int, per: int, device: torch.device) -> torch.Tensor:
        """The chunk of every slot: ``per`` slots per full chunk, then the tail's."""
        slot = torch.arange(count, device=device)
        return torch.where(slot < full * per, slot // max(per, 1), full)

    # ------------------------------------------------------------------ decode
    def transmitted(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """The global indices and the decoded values."""
        n = payload.numel
        lay = self._layout(n)
        full, per, tail = self._counts(n)
        count = full * per + tail
        device = payload.data.device
        if not count:
            return torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(
                0, dtype=payload.dtype, device=device
            )
        chunk_of = self._chunk_of(count, full, per, device)
        local = lay.view(payload.data, "idx").to(torch.int64) & 0xFFFF
        if not self._on_device:  # bytes from a peer: every position inside its own chunk
            size = torch.where(chunk_of < full, self.config.chunk, n - full * self.config.chunk)
            if bool((local >= size).any()):
                raise ValueError(f"{self.name}: a received index lies outside its chunk (corrupt payload)")
        idx = chunk_of * self.config.chunk + local
        bits, levels = self.config.bits, 1 << (self.config.bits - 1)
        codes = unpack_codes(lay.view(payload.data, "codes"), bits, count)
        level = (codes & (levels - 1)).float()
        lo, hi = lay.view(payload.data, "lo")[chunk_of], lay.view(payload.data, "hi")[chunk_of]
        mag = lo + level * ((hi - lo) / (levels - 1) if levels > 1 else 0.0)
        val = torch.where((codes >> (bits - 1)) != 0, -mag, mag)
        return idx, val.to(payload.dtype)

    def _decode(self, payload: Payload, out: torch.Tensor, accumulate: bool, scale: float) -> None:
        idx, val = self.transmitted(payload)
        if scale != 1.0:
            val = val * scale
        if accumulate:
            sparse_add_(out, idx, val.to(out.dtype), on_device=self._on_device)
        else:
            sparse_to_dense_(out, idx, val.to(out.dtype), on_device=self._on_device)


__all__ = ["MAX_CHUNK", "SparseLoCo", "SparselocoConfig"]
