"""Compressed all-reduce (the MSTopK, RedSync and HiPress papers): a strategy over a group, built
from codec calls.

:func:`compressed_allreduce` (and :func:`compressed_program`, the same as a step program for the
sync engine) reduces a tensor through a :class:`~gradsync.codecs.Compressor` with one of the
strategies of :mod:`gradsync.collectives.strategies` (``allgather``, CaSync's ``ring`` and
``ps``), over the whole world or, with ``local_aggregation`` (HiPress paper), across nodes only: the
node sums densely first (a reduce-scatter over the fast links), the strategy runs across nodes
on each local rank's shard (the per-node inter groups in parallel), and what crossed the nodes
is all-gathered inside the node as compressed pieces (the MSTopK paper's sparse intra-node
all-gather) for every rank to decode. ``hitopk`` (the MSTopK paper's Algorithm 2) is ``allgather``
with local aggregation and a sparsifying codec, pipelined in chunks
(:mod:`gradsync.collectives.hitopk_pipeline`). Low-rank codecs (PowerSGD) run their two factor
rounds instead (:mod:`gradsync.collectives.lowrank_rounds`).

Error feedback: pass a compressor with error feedback and every lossy encode a rank performs
keeps its own residual (keyed by the call's ``key`` plus the role of that encode), so nothing a
rank compresses away is lost. Every rank ends with bit-identical results: each one decodes the
same payloads in the same order, owners included. Groups of one rank compress nothing.

:func:`encode_numels` and :func:`codec_refusal` tell, before anything runs, which sizes the
codec's encode calls will see and whether it can take them.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
- HiPress paper: Wu et al., "A Generic, High-Performance, Compression-Aware Framework for Data
  Parallel DNN Training", IEEE TPDS (HiPress, CaSync, CompLL).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from gradsync.codecs import Compressor
from gradsync.codecs.ops import Workspace
from gradsync.collectives import primitives as P
from gradsync.collectives.dense import shard_buffers
from gradsync.collectives.hitopk_pipeline import pipeline_chunks, pipelined_allgather
from gradsync.collectives.lowrank_rounds import lowrank_program
from gradsync.collectives.pieces import (
    Piece,
    apply_pieces,
    pack_pieces,
    packed_capacity,
    packed_length,
    unpack_pieces,
)
from gradsync.collectives.program import Program, chain, last, run, scaled
from gradsync.collectives.strategies import Coder, compressed_strategy, run_strategy
from gradsync.collectives.topology import Topology, default_topology


def check_arguments(tensor: torch.Tensor, codec: object, strategy: str, op: str, pipeline: object) -> None:
    """Raise for arguments :func:`compressed_allreduce` cannot take (before communicating)."""
    compressed_strategy(strategy)  # ValueError naming the registered ones
    if not isinstance(pipeline, int) or isinstance(pipeline, bool) or pipeline < 1:
        raise ValueError(f"pipeline must be a positive number of chunks, got {pipeline!r}")
    if op not in ("sum", "mean"):
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if not isinstance(codec, Compressor):
        raise TypeError(f"codec must be a gradsync codec, got {type(codec).__name__}")
    if not tensor.is_floating_point():
        raise TypeError(f"compressed all-reduce needs a floating tensor, got {tensor.dtype}")


def compressed_allreduce(
    tensor: torch.Tensor,
    topology: Topology | None,
    codec: Compressor,
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
    and compression; the codec then selects within each chunk (the HiPress paper's partitioning).
    ``pipeline=1`` is the MSTopK paper's algorithm as printed. On the emulated 2 x 2 cluster at
    100 Mbit/s, 64 MiB took about 240 ms in 1 chunk, 173 ms in 2 and 160 ms in 4; 16 MiB 67 ms in
    1 and 61 ms in 4; but 4 MiB took 21 ms in 1 chunk and 33 ms in 4 chunks of 1 MiB (each
    chunk's fixed costs, three collectives, outweigh the overlap), hence the 4 MiB minimum.
    """
    check_arguments(tensor, codec, strategy, op, pipeline)
    topo = topology.bind() if topology is not None else default_topology()
    if check:
        P.check_same(
            topo.world_group, "compressed_allreduce", numel=tensor.numel(),
            shape=str(tuple(tensor.shape)), dtype=str(tensor.dtype), codec=codec.spec(),
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
    codec: Compressor,
    strategy: str = "allgather",
    local_aggregation: bool = False,
    op: str = "mean",
    key: str = "",
    loss_scale: float = 1.0,
    pipeline: int = 4,
    ws: Workspace | None = None,
    parts: list[tuple[torch.Tensor, str]] | None = None,
    offset: int = 0,
    rehearse: bool = False,
) -> Program:
    """:func:`compressed_allreduce` of the contiguous ``x`` as a step program (arguments checked
    by the caller). ``ws`` holds this program's scratch space. For low-rank codecs ``parts``
    lists the tensors inside ``x`` (views with their own shapes) and their state keys; by default
    ``x`` is one tensor. ``offset``: where ``x`` starts in the caller's tensor (a part of a
    bucket), recorded with error feedback's residuals (``EncodeContext.offset``).

    A world of one rank has nothing to reduce and the program does nothing, unless ``rehearse``
    (:attr:`gradsync.sync.SyncConfig.rehearse`): then it runs as with peers, each collective over
    the one rank the identity, so ``x`` becomes the codec's rendering of itself."""
    ws = ws if ws is not None else topo.workspace
    if topo.world == 1 and not rehearse:
        return None
    coder = Coder(codec, key, loss_scale, offset)
    scale = 1.0 / topo.world if op == "mean" else 1.0
    flat = x.view(-1)
    if coder.codec.lowrank:
        local = local_aggregation and topo.per_node > 1
        return (yield from lowrank_program(flat, parts or [(x, f"{key}/lowrank")], topo, coder, local, scale))
    if local_aggregation and topo.per_node > 1:
        return (yield from _locally_aggregated(flat, topo, coder, strategy, pipeline, scale, ws))
    group = topo.world_group
    level = topo.level_of(group)
    pieces = yield from run_strategy(flat, group, level, coder, strategy, topo.rank, final=True)
    return partial(apply_pieces, pieces, flat, coder.plain, scale)


def hitopk(tensor: torch.Tensor, topology: Topology, codec: Compressor, **kwargs: Any) -> torch.Tensor:
    """The MSTopK paper's hierarchical top-k aggregation (HiTopKComm) with any sparsifying codec;
    ``kwargs`` go to :func:`compressed_allreduce` (``key``, ``loss_scale``, ...)."""
    if not codec.sparse:
        raise ValueError(f"hitopk needs a sparsifying codec (topk, mstopk, dgc, ...), got {codec.name!r}")
    return compressed_allreduce(tensor, topology, codec, "allgather", True, **kwargs)


def _locally_aggregated(
    flat: torch.Tensor,
    topo: Topology,
    coder: Coder,
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
        yield last(partial(P.all_gather, padded, shard, topo.intra_group, "intra"))
        return chain(copy_back, scaled(flat, scale))
    if compressed_strategy(strategy).pipelined:
        pieces = yield from pipelined_allgather(padded, topo, coder, pipeline, scratch, ws)
    else:
        yield partial(P.reduce_scatter, shard, padded, topo.intra_group, "intra", scratch)
        base = topo.local_rank * shard.numel()
        inner = yield from run_strategy(
            shard, topo.inter_group, "inter", coder.shifted(base), strategy, topo.rank
        )
        pieces = [Piece(base + q.offset, q.payload) for q in inner]
    # forward what crossed the nodes to the other ranks of the node (not the dense shard:
    # the MSTopK paper's sparse intra-node all-gather), then everybody decodes all of it. The ranks
    # of a node hold pieces of the same sizes, so a bounded codec's pack fits a fixed slot: one
    # all-gather, no size exchange
    packed = pack_pieces(pieces)
    capacity = packed_capacity([q.payload.numel for q in pieces], coder.codec, flat.dtype)
    if capacity is None:
        blobs = yield last(partial(P.all_gather_bytes, packed, topo.intra_group, "intra"))
    else:
        gathered = yield last(partial(P.all_gather_fixed, packed, capacity, topo.intra_group, "intra"))
        blobs = [b[: packed_length(b)] for b in gathered]

    def finish() -> None:
        everything = [
            q for blob in blobs for q in unpack_pieces(blob, padded.numel(), flat.dtype, coder.plain)
        ]
        apply_pieces(everything, padded, coder.plain, scale)
        copy_back()

    return finish


def encode_numels(
    numel: int,
    strategy: str,
    local_aggregation: bool,
    nodes: int,
    per_node: int,
    pipeline: int = 4,
    itemsize: int = 4,
    rehearse: bool = False,
) -> list[int]:
    """The element counts the codec's encode calls see when :func:`compressed_program` reduces
    a flat tensor of ``numel`` elements (so a codec can refuse a size before anything runs: a
    fixed ``k`` above one of them). Follows the programs' own cuts; low-rank codecs excepted.
    A world of one encodes nothing, unless ``rehearse``: then the whole tensor, once."""
    world = nodes * per_node
    if world == 1:
        return [numel] if rehearse else []
    if local_aggregation and per_node > 1:
        if nodes == 1:
            return []  # dense inside the node
        shard = -(-numel // per_node)
        if compressed_strategy(strategy).pieces:
            return _split_sizes(shard, nodes)
        padded = shard * per_node
        chunks = pipeline_chunks(padded * itemsize, pipeline)
        per_chunk = -(-padded // chunks)
        per_chunk = -(-per_chunk // per_node) * per_node  # as pipelined_allgather cuts
        return sorted({min(per_chunk, padded - start) // per_node for start in range(0, padded, per_chunk)})
    return _split_sizes(numel, world) if compressed_strategy(strategy).pieces else [numel]


def codec_refusal(
    codec: Compressor,
    numel: int,
    strategy: str,
    local_aggregation: bool,
    nodes: int,
    per_node: int,
    itemsize: int = 4,
    rehearse: bool = False,
) -> str | None:
    """Why ``codec`` cannot take the sizes its encode calls would see when a tensor of ``numel``
    elements is reduced this way (the codec's own words, e.g. a ``k`` above one of them), or
    None when it can. Low-rank codecs take any size (what they cannot factor goes dense).
    ``rehearse`` as for :func:`encode_numels`."""
    if codec.lowrank:
        return None
    sizes = encode_numels(
        numel, strategy, local_aggregation, nodes, per_node, itemsize=itemsize, rehearse=rehearse
    )
    for n in sizes:
        try:
            codec.check_numel(n)
        except ValueError as e:
            return str(e)
    return None


def _split_sizes(numel: int, parts: int) -> list[int]:
    """The sizes ``torch.tensor_split`` cuts ``numel`` elements into."""
    return sorted({numel // parts + (1 if i < numel % parts else 0) for i in range(parts)})
