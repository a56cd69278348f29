"""The compressed strategies over one group: packed all-gather, CaSync-Ring and CaSync-PS.

Each runs on the flat tensor of one rank over a group of p ranks and returns the result as
:class:`~gradsync.collectives.pieces.Piece` objects, which every rank decodes in the same order:

- ``allgather`` (the RedSync paper's packed sparse all-gather when the codec sparsifies): every rank
  encodes once; the payloads (header, indices and values in one buffer; sizes may differ) are
  all-gathered, and every rank decodes all p of them.
- ``ring`` (the HiPress paper's CaSync-Ring): the tensor is cut into p chunks. Reduce-scatter phase:
  p-1 steps, each sending one encoded chunk to the right neighbour and merging the one received from
  the left (decode, add, encode again; ``summable`` codecs add the payloads' values directly). The
  owner of each fully reduced chunk then encodes it once and the all-gather phase passes these
  payloads around the ring.
- ``ps`` (the HiPress paper's CaSync-PS, aggregators co-located on the workers): the tensor is cut
  into p partitions, partition j owned by group rank j. Every partition is encoded and sent to its
  owner (all-to-all); owners decode and sum (or add values), encode the aggregate, and all-gather
  it.

Each is a :class:`CompressedStrategy` in one registry, with its program and its predicted
seconds; scheme strings (``STRATEGY[+local]/CODEC``), the planner and the what-if simulator read
the registry, so a new strategy is one :func:`register_compressed_strategy` call.

:func:`reduce_scatter_pieces` is ``ps``'s first phase alone, a compressed reduce-scatter (what
FSDP needs: :mod:`gradsync.integrate.fsdp`).

References:

- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
- HiPress paper: Wu et al., "A Generic, High-Performance, Compression-Aware Framework for Data
  Parallel DNN Training", IEEE TPDS (HiPress, CaSync, CompLL).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from gradsync.codecs import Codec, Compressor, EncodeContext, Payload
from gradsync.codecs.ops import abs_max, abs_max_on_device
from gradsync.collectives import primitives as P
from gradsync.collectives.cost import CodecCost, CostModel, Link
from gradsync.collectives.pieces import Piece, fixed_capacity, trimmed
from gradsync.collectives.program import Step, last

Pieces = Generator[Step, Any, "list[Piece]"]


@dataclass
class Coder:
    """Encodes for one tensor (its state keyed by ``key`` plus the role of each encode, so every
    lossy encode a rank performs keeps its own residual) and rebuilds payloads from peers' bytes.

    ``base`` is where the tensor the strategy runs on starts in the caller's tensor (a bucket);
    each encode passes on where its input starts there (``EncodeContext.offset``), so that what
    error feedback keeps can be traced back to the caller's elements."""

    codec: Compressor
    key: str
    loss_scale: float
    base: int = 0

    @property
    def plain(self) -> Codec:
        return self.codec.plain

    def shifted(self, by: int) -> Coder:
        """The same coder for a tensor that starts ``by`` elements further into the caller's."""
        return replace(self, base=self.base + by)

    def encode(self, x: torch.Tensor, role: str, ctx: EncodeContext | None = None, at: int = 0) -> Payload:
        """Encode ``x``, which starts ``at`` elements into the strategy's tensor."""
        c = ctx or EncodeContext()
        c = EncodeContext(
            key=f"{self.key}/{role}", rank=c.rank, summands=c.summands, amax=c.amax, offset=self.base + at
        )
        return self.codec.encode(x, c, loss_scale=self.loss_scale)

    def received(self, data: torch.Tensor, like: torch.Tensor) -> Payload:
        return self.plain.payload_from_bytes(data, like.shape, like.dtype)


def _values(codec: Compressor, payload: Payload) -> torch.Tensor:
    """The value section of a payload of a ``summable`` codec (the trait guarantees one)."""
    values = codec.values(payload)
    assert values is not None, f"{codec.spec()!r} is summable but its payload has no value section"
    return values


def run_strategy(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    level: str,
    coder: Coder,
    strategy: str,
    rank: int,
    final: bool = False,
) -> Pieces:
    """Run the registered ``strategy`` on the flat ``x`` over ``group``; return the pieces of the
    result. ``final``: nothing follows it in the caller's program (its last step is marked last)."""
    return (yield from compressed_strategy(strategy).run(x, group, level, coder, rank, final))


def _agreed(
    x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: Coder, rank: int
) -> Generator[Step, Any, EncodeContext]:
    """The context for summable encodes: the group's max |x| (if the codec scales) and its size."""
    p = P.size(group)
    amax: float | torch.Tensor | None = None
    if coder.plain.agreed_scale and coder.plain.resident:  # the agreed max stays on the device
        t = abs_max_on_device(x)
        yield partial(P.all_reduce, t, group, level, op=dist.ReduceOp.MAX)
        amax = t
    elif coder.plain.agreed_scale:
        t = torch.tensor([abs_max(x)[0]], dtype=torch.float32, device=x.device)
        yield partial(P.all_reduce, t, group, level, op=dist.ReduceOp.MAX)
        amax = float(t)
    return EncodeContext(rank=rank, summands=p, amax=amax)


def _allgather(
    x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: Coder, rank: int, final: bool
) -> Pieces:
    payload = coder.encode(x, "allgather")
    capacity = fixed_capacity(coder.plain, x.numel(), x.dtype)
    if capacity is not None:  # one all-gather into fixed slots; each header gives its size
        bufs = yield last(partial(P.all_gather_fixed, payload.data, capacity, group, level), final)
        return [Piece(0, trimmed(coder.plain, b, x.numel(), x.dtype)) for b in bufs]
    datas = yield last(partial(P.all_gather_bytes, payload.data, group, level), final)
    return [Piece(0, coder.received(d, x)) for d in datas]  # checks every header against its size


def _ring(
    x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: Coder, rank: int, final: bool
) -> Pieces:
    p, g = P.size(group), P.group_rank(group)
    right, left = P.global_rank(group, (g + 1) % p), P.global_rank(group, (g - 1) % p)
    chunks = list(torch.tensor_split(x, p))
    offsets = [0]
    for c in chunks[:-1]:
        offsets.append(offsets[-1] + c.numel())
    owned = (g + 1) % p  # the chunk this rank holds fully reduced after the first phase
    codec = coder.plain
    capacities = [cap for chunk in chunks if (cap := fixed_capacity(codec, chunk.numel(), chunk.dtype))]
    width = max(capacities) if len(capacities) == p else None  # fixed slots: no sizes travel first
    exchange = partial(P.send_recv_bytes, dst=right, src=left, group=group, level=level, recv_size=width)

    def received(data: torch.Tensor, like: torch.Tensor) -> Payload:
        return coder.received(data, like) if width is None else trimmed(codec, data, like.numel(), like.dtype)

    if codec.summable:  # add the payloads' values, no decoding
        ctx = yield from _agreed(x, group, level, coder, rank)
        payloads = [coder.encode(c, f"ring{i}", ctx, offsets[i]) for i, c in enumerate(chunks)]
        send = payloads[g]
        for s in range(p - 1):
            idx = (g - s - 1) % p
            incoming = received((yield partial(exchange, send.data)), chunks[idx])
            _values(codec, payloads[idx]).add_(_values(codec, incoming))
            send = payloads[idx]
        reduced = payloads[owned]
    else:
        send = coder.encode(chunks[g], f"ring{g}", at=offsets[g])
        for s in range(p - 1):
            idx = (g - s - 1) % p
            incoming = received((yield partial(exchange, send.data)), chunks[idx])
            work = chunks[idx].clone()
            codec.decode(incoming, out=work, accumulate=True)
            send = coder.encode(
                work, f"ring{idx}", at=offsets[idx]
            )  # the last: the owned chunk's final payload
        reduced = send
    # all-gather phase: pass the final payloads around the ring
    pieces = [Piece(offsets[owned], reduced)]
    current, idx = reduced, owned
    for s in range(p - 1):
        data = yield last(partial(exchange, current.data), final and s == p - 2)
        idx = (idx - 1) % p
        current = received(data, chunks[idx])
        pieces.append(Piece(offsets[idx], current))
    return pieces


def _to_owners(
    x: torch.Tensor,
    group: dist.ProcessGroup | None,
    level: str,
    coder: Coder,
    ctx: EncodeContext | None,
) -> Generator[Step, Any, tuple[list[torch.Tensor], list[int], list[Payload]]]:
    """CaSync-PS's first phase: cut ``x`` into p partitions, encode each and send it to its owner
    (group rank j owns partition j). Returns the partitions, where each starts, and the p
    payloads of this rank's own partition, in group-rank order."""
    p, g = P.size(group), P.group_rank(group)
    parts = list(torch.tensor_split(x, p))
    starts = [0]
    for part in parts[:-1]:
        starts.append(starts[-1] + part.numel())
    payloads = [coder.encode(part, f"ps{j}", ctx, starts[j]) for j, part in enumerate(parts)]
    capacities = [c for part in parts if (c := fixed_capacity(coder.plain, part.numel(), part.dtype))]
    if len(capacities) == p:  # fixed slots: no sizes travel first
        bufs = yield partial(P.all_to_all_fixed, [q.data for q in payloads], capacities, group, level)
        return parts, starts, [trimmed(coder.plain, b, parts[g].numel(), x.dtype) for b in bufs]
    datas = yield partial(P.all_to_all_bytes, [q.data for q in payloads], group, level)
    return parts, starts, [coder.received(d, parts[g]) for d in datas]


def reduce_scatter_pieces(
    x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: Coder
) -> Pieces:
    """A compressed reduce-scatter: the owner phase of CaSync-PS alone. Returns the pieces of this
    rank's partition of the sum (offsets within the partition; every one covers all of it):
    group rank j's partition is ``torch.tensor_split(x, p)[j]``. Each rank sends one payload of
    each partition, (p-1)/p of what the all-reduce strategies send."""
    _, _, received = yield from _to_owners(x, group, level, coder, None)
    return [Piece(0, q) for q in received]


def _ps(
    x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: Coder, rank: int, final: bool
) -> Pieces:
    g = P.group_rank(group)
    codec = coder.plain
    summable = codec.summable
    ctx = (yield from _agreed(x, group, level, coder, rank)) if summable else None
    parts, starts, received = yield from _to_owners(x, group, level, coder, ctx)
    if summable:
        agg = received[0]
        total = _values(codec, agg).clone()
        for q in received[1:]:
            total.add_(_values(codec, q))
        _values(codec, agg).copy_(total)
    else:
        work = torch.zeros_like(parts[g])
        for q in received:
            codec.decode(q, out=work, accumulate=True)
        agg = coder.encode(work, "ps-aggregate", at=starts[g])
    capacities = [c for part in parts if (c := fixed_capacity(codec, part.numel(), part.dtype))]
    pieces, offset = [], 0
    if len(capacities) == len(parts):  # fixed slots, of the largest partition's bound
        width = max(capacities)
        bufs = yield last(partial(P.all_gather_fixed, agg.data, width, group, level), final)
        for j, buf in enumerate(bufs):
            pieces.append(Piece(offset, trimmed(codec, buf, parts[j].numel(), x.dtype)))
            offset += parts[j].numel()
        return pieces
    for j, data in enumerate((yield last(partial(P.all_gather_bytes, agg.data, group, level), final))):
        pieces.append(Piece(offset, coder.received(data, parts[j])))
        offset += parts[j].numel()
    return pieces


# -------------------------------------------------------------------------------- the registry
StrategyRun = Callable[[torch.Tensor, "dist.ProcessGroup | None", str, Coder, int, bool], Pieces]
"""A strategy's program: ``(x, group, level, coder, rank, final)`` -> the pieces of the sum."""
StrategyCost = Callable[[CostModel, float, CodecCost, int, Link], float]
"""A strategy's predicted seconds: ``(model, bytes, codec cost, ranks, link)`` over one group."""


Sends = Callable[[float, float], tuple[tuple[str, float, float], ...]]
"""What one synchronization sends, from ``(payload of the whole tensor, payload of one piece)``:
``(collective kind, bytes one call moves per rank, share of the communication time)`` each, the
kinds and classes of :func:`gradsync.collectives.cost.measure_efficiency`."""


@dataclass(frozen=True)
class CompressedStrategy:
    """A compressed aggregation over one group of ranks: its program, its predicted seconds, and
    the facts about it that the planner, the cost model and the fronts read (never its name)."""

    name: str
    run: StrategyRun
    cost: StrategyCost
    pieces: bool = False
    """Each rank cuts its tensor into one piece per rank of the group and encodes each (an encode
    call sees 1/p of the tensor); else it encodes the whole tensor once."""
    sends: Sends = lambda whole, piece: (("allgather", whole, 1.0),)
    """What it sends (see :data:`Sends`)."""
    pipelined: bool = False
    """With local aggregation it runs as a pipeline of chunks over the node's shard (the MSTopK
    paper's HiTopKComm)."""


_STRATEGIES: dict[str, CompressedStrategy] = {}

DEFAULT_STRATEGY = "allgather"
"""The strategy of a compressed synchronization that names none (the packed all-gather)."""


def register_compressed_strategy(strategy: CompressedStrategy) -> CompressedStrategy:
    """Add ``strategy`` to the registry (a name can be registered once; ``hitopk`` is the
    scheme grammar's name for ``allgather+local``) and return it. Register on every rank."""
    name = strategy.name
    if not name.isidentifier() or name == "hitopk" or name in _STRATEGIES:
        raise ValueError(
            f"strategy name must be a new identifier other than hitopk, got {name!r} "
            f"(registered: {', '.join(_STRATEGIES)})"
        )
    _STRATEGIES[name] = strategy
    return strategy


def compressed_strategy(name: str) -> CompressedStrategy:
    """The registered strategy ``name``; ``ValueError`` naming the registered ones."""
    try:
        return _STRATEGIES[name]
    except (KeyError, TypeError):
        raise ValueError(f"strategy must be one of {', '.join(_STRATEGIES)}, got {name!r}") from None


def compressed_strategy_names() -> tuple[str, ...]:
    """Every registered compressed strategy, in registration order."""
    return tuple(_STRATEGIES)


def _casync_cost(reencodes: bool) -> StrategyCost:
    """The HiPress paper's Eq. 2 for its ring (``reencodes``: every hop decodes, merges and
    encodes again) or PS; a send is one message when the codec's payloads fit fixed slots, else a
    size, then the payload."""

    def cost(model: CostModel, nbytes: float, c: CodecCost, ranks: int, link: Link) -> float:
        return model.casync(reencodes, nbytes, c, n=ranks, link=link, messages=c.messages)

    return cost


register_compressed_strategy(CompressedStrategy("allgather", _allgather, CostModel.gathered, pipelined=True))
# CaSync-Ring: every step a point-to-point send of a piece
register_compressed_strategy(CompressedStrategy(
    "ring", _ring, _casync_cost(True), pieces=True, sends=lambda whole, piece: (("sendrecv", piece, 1.0),)
))  # fmt: skip
# CaSync-PS: two collectives of equal steps, the pieces to their owners (an all-to-all) and the
# owners' aggregates back (an all-gather of one piece per rank)
register_compressed_strategy(CompressedStrategy(
    "ps", _ps, _casync_cost(False), pieces=True,
    sends=lambda whole, piece: (("sendrecv", piece, 0.5), ("allgather", piece, 0.5)),
))  # fmt: skip
