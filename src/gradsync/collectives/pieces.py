"""The pieces a compressed all-reduce's result is made of, and their wire format.

A strategy returns its result as :class:`Piece` objects: payloads with the offset (in elements)
of the range of the flat result they decode into. :func:`apply_pieces` writes them into the
result (summing pieces over the same range). With local aggregation the pieces that crossed the
nodes are forwarded inside the node as one byte buffer (:func:`pack_pieces`), which the receiver
checks field by field (:func:`unpack_pieces`) before it trusts any of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradsync.codecs import Compressor, Payload

_PIECE_HEADER = 3  # int64 words per piece: offset, numel, nbytes


@dataclass
class Piece:
    """Part of a result: decode ``payload`` and add it at ``offset`` (elements) of the flat tensor."""

    offset: int
    payload: Payload


def apply_pieces(pieces: list[Piece], x: torch.Tensor, codec: Compressor, scale: float = 1.0) -> None:
    """Write the result the pieces describe into the flat ``x``.

    Pieces over the same range are summed, ranges no piece covers become zero. The first piece of
    a range is decoded without accumulating (no separate zeroing pass). The same bytes in the same
    order give every rank a bit-identical result. Pieces cover identical ranges or do not overlap.
    """
    seen: set[tuple[int, int]] = set()
    for piece in pieces:
        span = (piece.offset, piece.payload.numel)
        codec.decode(piece.payload, out=x[span[0] : span[0] + span[1]], accumulate=span in seen, scale=scale)
        seen.add(span)
    pos = 0
    for start, n in sorted(seen):
        if start > pos:
            x[pos:start].zero_()
        pos = max(pos, start + n)
    if pos < x.numel():
        x[pos:].zero_()


def pack_pieces(pieces: list[Piece]) -> torch.Tensor:
    """Pieces as one uint8 buffer: int64 [count, (offset, numel, nbytes) * count] + payload bytes."""
    head = [len(pieces)]
    for q in pieces:
        head += [q.offset, q.payload.numel, q.payload.nbytes]
    device = pieces[0].payload.data.device if pieces else torch.device("cpu")
    head_t = torch.tensor(head, dtype=torch.int64, device=device).view(torch.uint8)
    return torch.cat([head_t, *(q.payload.data for q in pieces)])


def fixed_capacity(codec: Compressor, numel: int, dtype: torch.dtype) -> int | None:
    """The bytes every rank's payload of ``numel`` elements fits in, when that bound is tight
    enough to gather payloads in fixed slots (one collective, no size exchange first): at most
    twice the codec's estimate (every codec of the papers has an exact bound). None otherwise."""
    capacity = codec.max_nbytes(numel, (numel,), dtype)
    return capacity if capacity <= 2 * max(codec.estimate_nbytes(numel, (numel,), dtype), 1024) else None


def packed_capacity(numels: list[int], codec: Compressor, dtype: torch.dtype) -> int | None:
    """The bytes :func:`pack_pieces` needs at most for pieces of these element counts, when every
    piece's payload size is bounded tightly enough for fixed slots (see
    :func:`fixed_capacity`); None otherwise."""
    total = 8 * (1 + _PIECE_HEADER * len(numels))
    for n in numels:
        capacity = fixed_capacity(codec.plain, n, dtype)
        if capacity is None:
            return None
        total += capacity
    return total


def _header(blob: torch.Tensor) -> tuple[int, list[list[int]]]:
    """A pack's header from a peer, checked against the blob's size: its length in bytes and one
    ``[offset, numel, nbytes]`` row per piece."""
    if blob.numel() < 8:
        raise _corrupt(f"{blob.numel()} bytes")
    count = int(blob[:8].view(torch.int64))
    head_bytes = 8 * (1 + _PIECE_HEADER * count)
    if count < 0 or blob.numel() < head_bytes:
        raise _corrupt(f"count {count} in {blob.numel()} bytes")
    return head_bytes, blob[:head_bytes].view(torch.int64)[1:].view(count, _PIECE_HEADER).tolist()


def _corrupt(why: str) -> ValueError:
    return ValueError(f"corrupt result pieces from a peer: {why}")


def packed_length(blob: torch.Tensor) -> int:
    """How many bytes at the start of a fixed slot from a peer its packed pieces take (from the
    header, checked against the slot): :func:`unpack_pieces` then checks every field."""
    head_bytes, head = _header(blob)
    sizes = [row[2] for row in head]
    length = head_bytes + sum(sizes)
    if any(n < 0 for n in sizes) or length > blob.numel():
        raise _corrupt(f"{length} bytes of pieces in a {blob.numel()}-byte slot")
    return length


def unpack_pieces(blob: torch.Tensor, length: int, dtype: torch.dtype, codec: Compressor) -> list[Piece]:
    """Inverse of :func:`pack_pieces` for bytes from a peer: every field is checked before use."""
    head_bytes, head = _header(blob)
    pieces, pos = [], head_bytes
    for offset, numel, nbytes in head:
        if offset < 0 or numel < 0 or offset + numel > length or nbytes < 0 or pos + nbytes > blob.numel():
            raise _corrupt(f"piece at {offset} of {numel} elements and {nbytes} bytes (shard {length})")
        pieces.append(Piece(offset, codec.payload_from_bytes(blob[pos : pos + nbytes], (numel,), dtype)))
        pos += nbytes
    if pos != blob.numel():
        raise _corrupt(f"{blob.numel() - pos} trailing bytes")
    return pieces


def trimmed(codec: Compressor, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> Payload:
    """The payload at the start of a (padded) buffer from a peer, its size read from its header."""
    head = Payload(buf, codec.name, torch.Size([numel]), dtype)
    size = codec.payload_nbytes(head)
    if size > buf.numel():
        raise ValueError(
            f"{codec.name}: a peer's payload header claims {size} bytes in a {buf.numel()}-byte buffer"
        )
    return codec.payload_from_bytes(buf[:size], (numel,), dtype)
