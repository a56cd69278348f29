"""Compressed all-reduce strategies (papers 01, 04, 05), built from codec encode/decode calls.

Strategies over a group of p ranks (the world, or one inter-node group with local aggregation):

- ``allgather`` (paper 04's packed sparse all-gather when the codec sparsifies): every rank
  encodes once; the payloads (header, indices and values in one buffer; sizes may differ) are
  all-gathered; every rank decodes all p of them into the result (sparse add). Over the whole
  world this is the ``naive`` scheme.
- ``ring`` (paper 05's CaSync-Ring): the tensor is cut into p chunks. Reduce-scatter phase: p-1
  steps, each sending one encoded chunk to the right neighbour and merging the one received from
  the left (decode, add, encode again; summable codecs add the payloads' values directly). Then
  the owner of each fully reduced chunk encodes it once and the all-gather phase passes these
  payloads around the ring; every rank decodes them.
- ``ps`` (paper 05's CaSync-PS with aggregators co-located on the workers): the tensor is cut into
  p partitions, partition j owned by group rank j. Encode every partition, all-to-all them to the
  owners, owners decode and sum (or add values), encode the aggregate, all-gather, decode.

``local_aggregation`` (paper 05): sum densely inside the node first (a reduce-scatter over the
fast links), run the strategy across nodes on each local rank's shard (the per_node inter-node
groups in parallel), all-gather inside the node. ``hitopk`` (paper 01, Algorithm 2) is exactly
``allgather`` with local aggregation and a sparsifying codec: intra reduce-scatter, top-k of the
shard, inter-node packed all-gather, sparse add, intra all-gather.

PowerSGD's factors are summable but need two rounds: P = M Q is all-reduced, orthogonalized,
then Q = M^T P is all-reduced (:func:`lowrank_program`, which batches every matrix of a bucket
into those two all-reduces, the bucket's vectors riding along with the first); with local
aggregation only the node leaders do this across nodes (between an intra-node reduce and
broadcast).

Error feedback: pass an :class:`~gradsync.codecs.ErrorFeedback` and every lossy encode a rank
performs keeps its own residual (keyed by the call's ``key`` plus the role of that encode), so
nothing a rank compresses away is lost. Every rank ends with bit-identical results: each one
decodes the same payloads in the same order, owners included.

Results are exact for groups of one rank (nothing is compressed there).

Every strategy is a step program (:mod:`gradsync.collectives.program`): it yields its
communication steps and returns the decoding work as a finisher.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from gradsync.codecs import Codec, EncodeContext, ErrorFeedback, Payload
from gradsync.codecs.lowrank import matrix_shape
from gradsync.codecs.ops import Workspace, abs_max
from gradsync.collectives import primitives as P
from gradsync.collectives.dense import shard_buffers
from gradsync.collectives.program import Finisher, Program, Step, chain, run
from gradsync.collectives.topology import Topology, default_topology

STRATEGIES = ("allgather", "ring", "ps")

Pieces = Generator[Step, Any, "list[_Piece]"]


@dataclass
class _Coder:
    """Encoding with or without error feedback, plus payload rebuilding for received bytes."""

    codec: Codec | ErrorFeedback
    key: str
    loss_scale: float

    @property
    def plain(self) -> Codec:
        return self.codec.codec if isinstance(self.codec, ErrorFeedback) else self.codec

    def encode(self, x: torch.Tensor, role: str, ctx: EncodeContext | None = None) -> Payload:
        c = ctx or EncodeContext()
        c = EncodeContext(key=f"{self.key}/{role}", rank=c.rank, summands=c.summands, amax=c.amax)
        if isinstance(self.codec, ErrorFeedback):
            return self.codec.encode(x, c, loss_scale=self.loss_scale)
        return self.codec.encode(x, c)

    def received(self, data: torch.Tensor, like: torch.Tensor) -> Payload:
        return self.plain.payload_from_bytes(data, like.shape, like.dtype)


def codec_spec(codec: Codec | ErrorFeedback) -> str:
    """The spec string of a codec (with its error-feedback wrapper)."""
    return codec.spec() if isinstance(codec, ErrorFeedback) else codec.config.spec()


def check_arguments(tensor: torch.Tensor, codec: object, strategy: str, op: str, pipeline: object) -> None:
    """Raise for arguments :func:`compressed_allreduce` cannot take (before communicating)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if not isinstance(pipeline, int) or isinstance(pipeline, bool) or pipeline < 1:
        raise ValueError(f"pipeline must be a positive number of chunks, got {pipeline!r}")
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if not isinstance(codec, (Codec, ErrorFeedback)):
        raise TypeError(f"codec must be a gradsync codec, got {type(codec).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"compressed all-reduce needs a floating tensor, got {tensor.dtype}")


def compressed_allreduce(
    tensor: torch.Tensor,
    topology: Topology | None,
    codec: Codec | ErrorFeedback,
    strategy: str = "allgather",
    local_aggregation: bool = False,
    op: str = "mean",
    key: str = "",
    loss_scale: float = 1.0,
    check: bool = True,
    pipeline: int = 4,
) -> torch.Tensor:
    """All-reduce ``tensor`` in place through ``codec`` with a compressed ``strategy``.

    ``key`` names the tensor for the codec's per-tensor state (use the same key every step);
    ``loss_scale`` is passed to error feedback. With ``check`` the ranks first agree on size,
    dtype, codec and strategy (one tiny all-gather) and raise on every rank if they differ.

    With local aggregation the ``allgather`` strategy (hitopk) cuts the tensor into ``pipeline``
    chunks (of at least 4 MiB) whose inter-node transfers overlap the next chunk's reduce-scatter
    and compression; the codec then selects within each chunk (paper 05's partitioning).
    ``pipeline=1`` is paper 01's algorithm as printed. On the emulated 2 x 2 cluster at
    100 Mbit/s, 64 MiB took about 240 ms in 1 chunk, 173 ms in 2 and 160 ms in 4; 16 MiB 67 ms in
    1 and 61 ms in 4; but 4 MiB took 21 ms in 1 chunk and 33 ms in 4 chunks of 1 MiB (each
    chunk's fixed costs, three collectives, outweigh the overlap), hence the 4 MiB minimum.
    """
    check_arguments(tensor, codec, strategy, op, pipeline)
    topo = topology.bind() if topology is not None else default_topology()
    if check:
        P.check_same(
            topo.world_group, tensor.device, "compressed_allreduce", numel=tensor.numel(),
            shape=str(tuple(tensor.shape)), dtype=str(tensor.dtype), codec=codec_spec(codec),
            strategy=strategy, local_aggregation=int(local_aggregation), op=op,
        )  # fmt: skip
    if topo.world == 1:
        return tensor
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    run(
        compressed_program(
            work, topo, codec, strategy, local_aggregation, op, key, loss_scale, pipeline, topo.workspace
        )
    )
    if work.data_ptr() != tensor.data_ptr():
        tensor.copy_(work)
    return tensor


def compressed_program(
    x: torch.Tensor,
    topo: Topology,
    codec: Codec | ErrorFeedback,
    strategy: str = "allgather",
    local_aggregation: bool = False,
    op: str = "mean",
    key: str = "",
    loss_scale: float = 1.0,
    pipeline: int = 4,
    ws: Workspace | None = None,
    parts: list[tuple[torch.Tensor, str]] | None = None,
) -> Program:
    """:func:`compressed_allreduce` of the contiguous ``x`` as a step program (arguments checked
    by the caller). ``ws`` holds this program's scratch space. For low-rank codecs ``parts``
    lists the tensors inside ``x`` (views with their own shapes) and their state keys; by default
    ``x`` is one tensor."""
    ws = ws if ws is not None else topo.workspace
    if topo.world == 1:
        return None
    coder = _Coder(codec, key, loss_scale)
    scale = 1.0 / topo.world if op == "mean" else 1.0
    flat = x.view(-1)
    if is_lowrank(coder.plain):
        local = local_aggregation and topo.per_node > 1
        return (yield from lowrank_program(flat, parts or [(x, f"{key}/lowrank")], topo, coder, local, scale))
    if local_aggregation and topo.per_node > 1:
        return (yield from _locally_aggregated(flat, topo, coder, strategy, pipeline, scale, ws))
    group = topo.world_group
    pieces = yield from _strategy(flat, group, _level(topo, group), coder, strategy, topo.rank)
    return partial(_apply, pieces, flat, coder.plain, scale)


def hitopk(
    tensor: torch.Tensor, topology: Topology, codec: Codec | ErrorFeedback, **kwargs: object
) -> torch.Tensor:
    """Paper 01's hierarchical top-k aggregation (HiTopKComm) with any sparsifying codec."""
    if not codec.sparse:
        raise ValueError(f"hitopk needs a sparsifying codec (topk, mstopk, dgc, ...), got {codec.name!r}")
    return compressed_allreduce(tensor, topology, codec, "allgather", True, **kwargs)  # type: ignore[arg-type]


def _level(topo: Topology, group: dist.ProcessGroup | None) -> str:
    if group is topo.intra_group or topo.nodes == 1:
        return "intra"
    if group is topo.inter_group or topo.per_node == 1:
        return "inter"
    return "world"


@dataclass
class _Piece:
    """Part of a result: decode ``payload`` and add it at ``offset`` (elements) of the flat tensor."""

    offset: int
    payload: Payload


def _apply(pieces: list[_Piece], x: torch.Tensor, codec: Codec, scale: float = 1.0) -> None:
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


def _scaled(flat: torch.Tensor, scale: float) -> Finisher | None:
    return (lambda: flat.mul_(scale)) if scale != 1.0 else None


def _locally_aggregated(
    flat: torch.Tensor,
    topo: Topology,
    coder: _Coder,
    strategy: str,
    pipeline: int,
    scale: float,
    ws: Workspace,
) -> Program:
    padded, shard = shard_buffers(flat, topo, ws)
    scratch = ws.get("rs", padded.numel(), flat.dtype, flat.device)

    def copy_back() -> None:
        if padded.data_ptr() != flat.data_ptr():
            flat.copy_(padded[: flat.numel()])

    if topo.nodes == 1:  # nothing crosses a node: a plain dense reduce-scatter and all-gather
        yield partial(P.reduce_scatter, shard, padded, topo.intra_group, "intra", scratch)
        yield partial(P.all_gather, padded, shard, topo.intra_group, "intra")
        return chain(copy_back, _scaled(flat, scale))
    if strategy == "allgather":
        pieces = yield from _pipelined_allgather(padded, topo, coder, pipeline, scratch, ws)
    else:
        yield partial(P.reduce_scatter, shard, padded, topo.intra_group, "intra", scratch)
        base = topo.local_rank * shard.numel()
        inner = yield from _strategy(shard, topo.inter_group, "inter", coder, strategy, topo.rank)
        pieces = [_Piece(base + q.offset, q.payload) for q in inner]
    # forward what crossed the nodes to the other ranks of the node (not the dense shard:
    # paper 01's sparse intra-node all-gather), then everybody decodes all of it
    blobs = yield partial(P.all_gather_bytes, _pack(pieces), topo.intra_group, "intra")

    def finish() -> None:
        everything = [q for blob in blobs for q in _unpack(blob, padded.numel(), flat.dtype, coder.plain)]
        _apply(everything, padded, coder.plain, scale)
        copy_back()

    return finish


_MIN_CHUNK_BYTES = 4 << 20


def pipeline_chunks(nbytes: int, pipeline: int) -> int:
    """How many chunks hitopk's pipeline cuts ``nbytes`` into: ``pipeline``, but none under
    4 MiB (so at least one)."""
    return max(1, min(pipeline, nbytes // _MIN_CHUNK_BYTES))


def encode_numels(
    numel: int,
    strategy: str,
    local_aggregation: bool,
    nodes: int,
    per_node: int,
    pipeline: int = 4,
    itemsize: int = 4,
) -> list[int]:
    """The element counts the codec's encode calls see when :func:`compressed_program` reduces
    a flat tensor of ``numel`` elements (so a codec can refuse a size before anything runs: a
    fixed ``k`` above one of them). Follows the programs' own cuts; low-rank codecs excepted."""
    world = nodes * per_node
    if world == 1:
        return []
    if local_aggregation and per_node > 1:
        if nodes == 1:
            return []  # dense inside the node
        shard = -(-numel // per_node)
        if strategy != "allgather":
            return _split_sizes(shard, nodes)
        padded = shard * per_node
        chunks = pipeline_chunks(padded * itemsize, pipeline)
        per_chunk = -(-padded // chunks)
        per_chunk = -(-per_chunk // per_node) * per_node  # as _pipelined_allgather cuts
        return sorted({min(per_chunk, padded - start) // per_node for start in range(0, padded, per_chunk)})
    return [numel] if strategy == "allgather" else _split_sizes(numel, world)


def codec_refusal(
    codec: Codec | ErrorFeedback,
    numel: int,
    strategy: str,
    local_aggregation: bool,
    nodes: int,
    per_node: int,
    itemsize: int = 4,
) -> str | None:
    """Why ``codec`` cannot take the sizes its encode calls would see when a tensor of ``numel``
    elements is reduced this way (the codec's own words, e.g. a ``k`` above one of them), or
    None when it can. Low-rank codecs take any size (what they cannot factor goes dense)."""
    plain = codec.codec if isinstance(codec, ErrorFeedback) else codec
    if is_lowrank(plain):
        return None
    for n in encode_numels(numel, strategy, local_aggregation, nodes, per_node, itemsize=itemsize):
        try:
            plain.check_numel(n)
        except ValueError as e:
            return str(e)
    return None


def _split_sizes(numel: int, parts: int) -> list[int]:
    """The sizes ``torch.tensor_split`` cuts ``numel`` elements into."""
    return sorted({numel // parts + (1 if i < numel % parts else 0) for i in range(parts)})


def _pipelined_allgather(
    padded: torch.Tensor, topo: Topology, coder: _Coder, pipeline: int, scratch: torch.Tensor, ws: Workspace
) -> Pieces:
    """hitopk's inner part, cut into :func:`pipeline_chunks` chunks so that the
    inter-node all-gather of one chunk (network) overlaps the reduce-scatter and compression of
    the next (CPU and the node's own links). Pieces carry offsets into ``padded``."""
    n = topo.per_node
    total = padded.numel()
    chunks = pipeline_chunks(total * padded.element_size(), pipeline)
    per_chunk = -(-total // chunks)
    per_chunk = -(-per_chunk // n) * n  # a multiple of per_node
    codec = coder.plain
    pending = []
    for start in range(0, total, per_chunk):
        chunk = padded[start : start + per_chunk]
        sub = chunk.numel() // n
        shard = ws.get("pipeline_shard", sub, padded.dtype, padded.device)
        yield partial(P.reduce_scatter, shard, chunk, topo.intra_group, "intra", scratch)
        payload = coder.encode(shard, f"allgather@{start}")
        capacity = codec.max_nbytes(sub, (sub,), padded.dtype)
        offset = start + topo.local_rank * sub
        if capacity > 2 * max(codec.estimate_nbytes(sub, (sub,), padded.dtype), 1024):
            # a variable-size codec with a loose bound: exchange the sizes instead (no overlap)
            bufs = yield partial(P.all_gather_bytes, payload.data, topo.inter_group, "inter")
            pending.append((offset, sub, None, bufs))
        else:
            gather = yield partial(
                P.start_all_gather_fixed, payload.data, capacity, topo.inter_group, "inter"
            )
            pending.append((offset, sub, gather, None))
    pieces = []
    for offset, sub, gather, bufs in pending:
        if gather is not None:
            bufs = yield gather.wait
        for buf in bufs:
            pieces.append(_Piece(offset, _trimmed(codec, buf, sub, padded.dtype)))
    return pieces


def _trimmed(codec: Codec, buf: torch.Tensor, numel: int, dtype: torch.dtype) -> Payload:
    """The payload at the start of a (padded) buffer from a peer, its size read from its header."""
    head = Payload(buf, codec.name, torch.Size([numel]), dtype)
    size = codec.payload_nbytes(head)
    if size > buf.numel():
        raise ValueError(
            f"{codec.name}: a peer's payload header claims {size} bytes in a {buf.numel()}-byte buffer"
        )
    return codec.payload_from_bytes(buf[:size], (numel,), dtype)


_PIECE_HEADER = 3  # int64 words per piece: offset, numel, nbytes


def _pack(pieces: list[_Piece]) -> torch.Tensor:
    """Pieces as one uint8 buffer: int64 [count, (offset, numel, nbytes) * count] + payload bytes."""
    head = [len(pieces)]
    for q in pieces:
        head += [q.offset, q.payload.numel, q.payload.nbytes]
    device = pieces[0].payload.data.device if pieces else "cpu"
    head_t = torch.tensor(head, dtype=torch.int64, device=device).view(torch.uint8)
    return torch.cat([head_t, *(q.payload.data for q in pieces)])


def _unpack(blob: torch.Tensor, length: int, dtype: torch.dtype, codec: Codec) -> list[_Piece]:
    """Inverse of :func:`_pack` for bytes from a peer: every field is checked before use."""

    def bad(why: str) -> ValueError:
        return ValueError(f"corrupt result pieces from a peer: {why}")

    if blob.numel() < 8:
        raise bad(f"{blob.numel()} bytes")
    count = int(blob[:8].view(torch.int64))
    head_bytes = 8 * (1 + _PIECE_HEADER * count)
    if count < 0 or blob.numel() < head_bytes:
        raise bad(f"count {count} in {blob.numel()} bytes")
    head = blob[:head_bytes].view(torch.int64)[1:].view(count, _PIECE_HEADER).tolist()
    pieces, pos = [], head_bytes
    for offset, numel, nbytes in head:
        if offset < 0 or numel < 0 or offset + numel > length or nbytes < 0 or pos + nbytes > blob.numel():
            raise bad(f"piece at {offset} of {numel} elements and {nbytes} bytes (shard {length})")
        pieces.append(_Piece(offset, codec.payload_from_bytes(blob[pos : pos + nbytes], (numel,), dtype)))
        pos += nbytes
    if pos != blob.numel():
        raise bad(f"{blob.numel() - pos} trailing bytes")
    return pieces


def _strategy(
    x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder, strategy: str, rank: int
) -> Pieces:
    """Run ``strategy`` on the flat ``x`` over ``group``; return the pieces of the result."""
    if strategy == "allgather":
        return (yield from _allgather(x, group, level, coder))
    if strategy == "ring":
        return (yield from _ring(x, group, level, coder, rank))
    return (yield from _ps(x, group, level, coder, rank))


def is_lowrank(codec: Codec) -> bool:
    """Whether the codec compresses by summable low-rank factors in two rounds (PowerSGD)."""
    return hasattr(codec, "project") and hasattr(codec, "reproject")


def _agreed(
    x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder, rank: int
) -> Generator[Step, Any, EncodeContext]:
    """The context for summable encodes: the group's max |x| (if the codec scales) and its size."""
    p = P.size(group)
    amax = None
    if coder.plain.agreed_scale:
        t = torch.tensor([abs_max(x)[0]], dtype=torch.float32, device=x.device)
        yield partial(P.all_reduce, t, group, level, op=dist.ReduceOp.MAX)
        amax = float(t)
    return EncodeContext(rank=rank, summands=p, amax=amax)


def _allgather(x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder) -> Pieces:
    payload = coder.encode(x, "allgather")
    datas = yield partial(P.all_gather_bytes, payload.data, group, level)
    return [_Piece(0, coder.received(d, x)) for d in datas]  # checks every header against its size


def _ring(x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder, rank: int) -> Pieces:
    p, g = P.size(group), P.group_rank(group)
    right, left = P.global_rank(group, (g + 1) % p), P.global_rank(group, (g - 1) % p)
    chunks = list(torch.tensor_split(x, p))
    offsets = [0]
    for c in chunks[:-1]:
        offsets.append(offsets[-1] + c.numel())
    owned = (g + 1) % p  # the chunk this rank holds fully reduced after the first phase
    codec = coder.plain
    exchange = partial(P.send_recv_bytes, dst=right, src=left, group=group, level=level)
    if codec.summable:  # add the payloads' values, no decoding
        ctx = yield from _agreed(x, group, level, coder, rank)
        payloads = [coder.encode(c, f"ring{i}", ctx) for i, c in enumerate(chunks)]
        send = payloads[g]
        for s in range(p - 1):
            idx = (g - s - 1) % p
            incoming = coder.received((yield partial(exchange, send.data)), chunks[idx])
            codec.values(payloads[idx]).add_(codec.values(incoming))
            send = payloads[idx]
        final = payloads[owned]
    else:
        send = coder.encode(chunks[g], f"ring{g}")
        for s in range(p - 1):
            idx = (g - s - 1) % p
            incoming = coder.received((yield partial(exchange, send.data)), chunks[idx])
            work = chunks[idx].clone()
            codec.decode(incoming, out=work, accumulate=True)
            send = coder.encode(work, f"ring{idx}")  # the last one is the owned chunk's final payload
        final = send
    # all-gather phase: pass the final payloads around the ring
    pieces = [_Piece(offsets[owned], final)]
    current, idx = final, owned
    for _ in range(p - 1):
        data = yield partial(exchange, current.data)
        idx = (idx - 1) % p
        current = coder.received(data, chunks[idx])
        pieces.append(_Piece(offsets[idx], current))
    return pieces


def _ps(x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder, rank: int) -> Pieces:
    p, g = P.size(group), P.group_rank(group)
    parts = list(torch.tensor_split(x, p))
    codec = coder.plain
    summable = codec.summable
    ctx = (yield from _agreed(x, group, level, coder, rank)) if summable else None
    payloads = [coder.encode(part, f"ps{j}", ctx) for j, part in enumerate(parts)]
    datas = yield partial(P.all_to_all_bytes, [q.data for q in payloads], group, level)
    received = [coder.received(d, parts[g]) for d in datas]
    if summable:
        agg = received[0]
        total = codec.values(agg).clone()
        for q in received[1:]:
            total.add_(codec.values(q))
        codec.values(agg).copy_(total)
    else:
        work = torch.zeros_like(parts[g])
        for q in received:
            codec.decode(q, out=work, accumulate=True)
        agg = coder.encode(work, "ps-aggregate")
    pieces, offset = [], 0
    for j, data in enumerate((yield partial(P.all_gather_bytes, agg.data, group, level))):
        pieces.append(_Piece(offset, coder.received(data, parts[j])))
        offset += parts[j].numel()
    return pieces


def lowrank_program(
    flat: torch.Tensor,
    parts: list[tuple[torch.Tensor, str]],
    topo: Topology,
    coder: _Coder,
    local: bool,
    scale: float,
) -> Program:
    """PowerSGD over the tensors ``parts`` (views into the contiguous ``flat``, with state keys).

    Without local aggregation the two rounds run over the world. With it the node reduces onto
    its leader, the leaders run the rounds across nodes, and the leader broadcasts the result."""
    if local:
        yield partial(P.reduce, flat, topo.leader, topo.intra_group, "intra")
        if topo.local_rank == 0 and topo.nodes > 1:
            tail = yield from _lowrank_rounds(parts, topo.inter_group, "inter", coder)
            if tail is not None:
                tail()  # the leader reconstructs before it broadcasts
        yield partial(P.broadcast, flat, topo.leader, topo.intra_group, "intra")
        return _scaled(flat, scale)
    group = topo.world_group
    tail = yield from _lowrank_rounds(parts, group, _level(topo, group), coder)
    return chain(tail, _scaled(flat, scale))


def _lowrank_rounds(
    parts: list[tuple[torch.Tensor, str]], group: dist.ProcessGroup | None, level: str, coder: _Coder
) -> Program:
    """Sum the tensors over ``group`` through PowerSGD's factors, every matrix of ``parts`` in the
    same two all-reduces (P, then Q); tensors the codec sends dense ride along with P."""
    codec = coder.plain
    ef = coder.codec if isinstance(coder.codec, ErrorFeedback) else None
    dense = [x for x, _ in parts if not codec.compresses(x.shape)]  # type: ignore[attr-defined]
    mats = []
    first_parts = [x.reshape(-1).float() for x in dense]
    for x, key in parts:
        if not codec.compresses(x.shape):  # type: ignore[attr-defined]
            continue
        v = ef.accumulate(x, key, coder.loss_scale) if ef is not None else x.reshape(-1)
        m = v.view(matrix_shape(x.shape)).float()
        stream = codec.stream(key)
        p = codec.project(m, stream)  # type: ignore[attr-defined]
        mats.append((x, key, m, stream, p.shape, stream.p))  # stream.p: restored if the sums overflow
        first_parts.append(p.reshape(-1))
    if not first_parts:
        return None
    first = torch.cat(first_parts)
    yield partial(P.all_reduce, first, group, level)
    pos = sum(x.numel() for x in dense)
    q_locals = []
    for _, _, m, stream, shape, _ in mats:
        n = shape.numel()
        q_locals.append(codec.reproject(m, first[pos : pos + n].view(shape), stream).contiguous())  # type: ignore[attr-defined]
        pos += n
    second = torch.cat([q.reshape(-1) for q in q_locals]) if q_locals else first.new_empty(0)
    if mats:
        yield partial(P.all_reduce, second, group, level)

    def finish() -> None:
        # any rank's inf/NaN reaches the summed factors (and stays there: never hidden)
        finite = bool(torch.isfinite(first).all()) and bool(torch.isfinite(second).all())
        pos = 0
        for x in dense:
            x.copy_(first[pos : pos + x.numel()].view(x.shape))
            pos += x.numel()
        qpos = 0
        for (x, key, _, stream, _, old_p), q_local in zip(mats, q_locals, strict=True):
            q_sum = second[qpos : qpos + q_local.numel()].view(q_local.shape)
            qpos += q_local.numel()
            if ef is not None:
                if finite:  # what this rank's data contributed to the sum
                    ef.commit(key, dense=(stream.p @ q_local.T).reshape(-1))
                else:
                    ef.discard(key)
            if not finite:  # keep the factors finite (a skipped step); the NaN result makes it skip
                stream.p = old_p
                x.fill_(float("nan"))
                continue
            out = x.view(matrix_shape(x.shape)) if x.dtype == torch.float32 and x.is_contiguous() else None
            result = codec.reconstruct(q_sum, stream, out=out)  # type: ignore[attr-defined]
            if out is None:
                x.copy_(result.view(x.shape))

    return finish
