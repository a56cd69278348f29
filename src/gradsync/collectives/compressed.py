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
then Q = M^T P is all-reduced (:func:`_lowrank`); with local aggregation only the node leaders do
this across nodes (between an intra-node reduce and broadcast).

Error feedback: pass an :class:`~gradsync.codecs.ErrorFeedback` and every lossy encode a rank
performs keeps its own residual (keyed by the call's ``key`` plus the role of that encode), so
nothing a rank compresses away is lost. Every rank ends with bit-identical results: each one
decodes the same payloads in the same order, owners included.

Results are exact for groups of one rank (nothing is compressed there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gradsync.codecs import Codec, EncodeContext, ErrorFeedback, Payload
from gradsync.codecs.lowrank import matrix_shape
from gradsync.codecs.ops import abs_max
from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology

STRATEGIES = ("allgather", "ring", "ps")


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
) -> torch.Tensor:
    """All-reduce ``tensor`` in place through ``codec`` with a compressed ``strategy``.

    ``key`` names the tensor for the codec's per-tensor state (use the same key every step);
    ``loss_scale`` is passed to error feedback. With ``check`` the ranks first agree on size,
    dtype, codec and strategy (one tiny all-gather) and raise on every rank if they differ.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if not isinstance(codec, (Codec, ErrorFeedback)):
        raise TypeError(f"codec must be a gradsync codec, got {type(codec).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"compressed all-reduce needs a floating tensor, got {tensor.dtype}")
    topo = topology or Topology()
    spec = codec.spec() if isinstance(codec, ErrorFeedback) else codec.config.spec()
    if check:
        P.check_same(
            topo.world_group, tensor.device, numel=tensor.numel(), shape=str(tuple(tensor.shape)),
            dtype=str(tensor.dtype), codec=spec, strategy=strategy, local_aggregation=int(local_aggregation),
            op=op,
        )  # fmt: skip
    if topo.world == 1:
        return tensor
    coder = _Coder(codec, key, loss_scale)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    if local_aggregation and topo.per_node > 1:
        _locally_aggregated(work, topo, coder, strategy)
    else:
        _strategy(work, topo.world_group, _level(topo, topo.world_group), coder, strategy, topo.rank)
    if op == "mean":
        work.div_(topo.world)
    if work.data_ptr() != tensor.data_ptr():
        tensor.copy_(work)
    return tensor


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


def _locally_aggregated(x: torch.Tensor, topo: Topology, coder: _Coder, strategy: str) -> None:
    if _is_lowrank(coder.plain):
        # the factors need the whole matrix: reduce to the node leader, compress across nodes
        # among the leaders, broadcast back
        P.reduce(x, topo.leader, topo.intra_group, "intra")
        if topo.local_rank == 0 and topo.nodes > 1:
            _lowrank(x, topo.inter_group, "inter", coder)
        P.broadcast(x, topo.leader, topo.intra_group, "intra")
        return
    flat = x.view(-1)
    n = topo.per_node
    shard_len = -(-flat.numel() // n)
    padded = (
        flat
        if shard_len * n == flat.numel()
        else torch.cat([flat, flat.new_zeros(shard_len * n - flat.numel())])
    )
    shard = flat.new_empty(shard_len)
    P.reduce_scatter(shard, padded, topo.intra_group, "intra")
    if topo.nodes > 1:
        _strategy(shard, topo.inter_group, "inter", coder, strategy, topo.rank)
    P.all_gather(padded, shard, topo.intra_group, "intra")
    if padded.data_ptr() != flat.data_ptr():
        flat.copy_(padded[: flat.numel()])


def _strategy(
    x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder, strategy: str, rank: int
) -> None:
    if P.size(group) == 1:
        return
    if _is_lowrank(coder.plain):
        _lowrank(x, group, level, coder)
    elif strategy == "allgather":
        _allgather(x.view(-1), group, level, coder)
    elif strategy == "ring":
        _ring(x.view(-1), group, level, coder, rank)
    else:
        _ps(x.view(-1), group, level, coder, rank)


def _is_lowrank(codec: Codec) -> bool:
    return hasattr(codec, "project") and hasattr(codec, "reproject")


def _agreed(
    x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder, rank: int
) -> EncodeContext:
    """The context for summable encodes: the group's max |x| (if the codec scales) and its size."""
    p = P.size(group)
    amax = None
    if coder.plain.agreed_scale:
        t = torch.tensor([abs_max(x)[0]], dtype=torch.float32, device=x.device)
        P.all_reduce(t, group, level, op=dist.ReduceOp.MAX)
        amax = float(t)
    return EncodeContext(rank=rank, summands=p, amax=amax)


def _allgather(x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder) -> None:
    payload = coder.encode(x, "allgather")
    datas = P.all_gather_bytes(payload.data, group, level)
    received = [coder.received(d, x) for d in datas]  # checks every header against its size
    x.zero_()
    for p in received:
        coder.plain.decode(p, out=x, accumulate=True)


def _ring(x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder, rank: int) -> None:
    p, g = P.size(group), P.group_rank(group)
    right, left = P.global_rank(group, (g + 1) % p), P.global_rank(group, (g - 1) % p)
    chunks = list(torch.tensor_split(x, p))
    owned = (g + 1) % p  # the chunk this rank holds fully reduced after the first phase
    codec = coder.plain
    if codec.summable:  # add the payloads' values, no decoding
        ctx = _agreed(x, group, level, coder, rank)
        payloads = [coder.encode(c, f"ring{i}", ctx) for i, c in enumerate(chunks)]
        send = payloads[g]
        for s in range(p - 1):
            idx = (g - s - 1) % p
            incoming = coder.received(P.send_recv_bytes(send.data, right, left, group, level), chunks[idx])
            mine = codec.values(payloads[idx])
            mine.add_(codec.values(incoming))
            send = payloads[idx]
        final = payloads[owned]
    else:
        send = coder.encode(chunks[g], f"ring{g}")
        work = chunks[g]
        for s in range(p - 1):
            idx = (g - s - 1) % p
            incoming = coder.received(P.send_recv_bytes(send.data, right, left, group, level), chunks[idx])
            work = chunks[idx].clone()
            codec.decode(incoming, out=work, accumulate=True)
            send = coder.encode(work, f"ring{idx}")  # the last one is the owned chunk's final payload
        final = send
    # all-gather phase: pass the final payloads around; everybody (owner included) decodes them
    current, idx = final, owned
    codec.decode(current, out=chunks[idx])
    for _ in range(p - 1):
        data = P.send_recv_bytes(current.data, right, left, group, level)
        idx = (idx - 1) % p
        current = coder.received(data, chunks[idx])
        codec.decode(current, out=chunks[idx])


def _ps(x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder, rank: int) -> None:
    p, g = P.size(group), P.group_rank(group)
    parts = list(torch.tensor_split(x, p))
    codec = coder.plain
    summable = codec.summable
    ctx = _agreed(x, group, level, coder, rank) if summable else None
    payloads = [coder.encode(part, f"ps{j}", ctx) for j, part in enumerate(parts)]
    received = [
        coder.received(d, parts[g]) for d in P.all_to_all_bytes([q.data for q in payloads], group, level)
    ]
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
    for j, data in enumerate(P.all_gather_bytes(agg.data, group, level)):
        codec.decode(coder.received(data, parts[j]), out=parts[j])


def _lowrank(x: torch.Tensor, group: dist.ProcessGroup | None, level: str, coder: _Coder) -> None:
    """PowerSGD's two summable rounds over ``group`` (x keeps its matrix shape)."""
    codec = coder.plain
    if not codec.compresses(x.shape):  # type: ignore[attr-defined]
        P.all_reduce(x, group, level)
        return
    ef = coder.codec if isinstance(coder.codec, ErrorFeedback) else None
    key = f"{coder.key}/lowrank"
    v = ef.accumulate(x, key, coder.loss_scale) if ef is not None else x.reshape(-1)
    finite = not abs_max(v)[1]
    if ef is not None and not finite:
        ef.discard(key)  # no residual update, and the result is poisoned below
    m = v.view(matrix_shape(x.shape)).float()
    stream = codec.stream(key)
    p_sum = codec.project(m, stream).contiguous()  # type: ignore[attr-defined]
    P.all_reduce(p_sum, group, level)
    q_local = codec.reproject(m, p_sum, stream).contiguous()  # type: ignore[attr-defined]
    q_sum = q_local.clone()
    P.all_reduce(q_sum, group, level)
    if ef is not None and finite:
        ef.commit(key, dense=(stream.p @ q_local.T).reshape(-1))  # what this rank's data contributed
    out = codec.reconstruct(q_sum, stream)  # type: ignore[attr-defined]
    if not torch.isfinite(p_sum).all() or not torch.isfinite(q_sum).all():
        out = torch.full_like(out, float("nan"))  # never hide a non-finite input
    x.copy_(out.view(x.shape))
