"""hitopk's pipeline (the MSTopK paper's Algorithm 2, with the HiPress paper's partitioning).

Inside hitopk, each node first reduce-scatters the tensor over its fast links, every rank
compresses its shard, and the shards cross the nodes in a packed all-gather. Cut into chunks,
the inter-node all-gather of one chunk (the slow network) overlaps the reduce-scatter and the
compression of the next (the node's own links and the CPU). Each chunk holds at least 4 MiB:
below that a chunk's fixed costs (three collectives) outweigh what the overlap saves.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- HiPress paper: Wu et al., "A Generic, High-Performance, Compression-Aware Framework for Data
  Parallel DNN Training", IEEE TPDS (HiPress, CaSync, CompLL).
"""

from __future__ import annotations

from functools import partial

import torch

from gradsync.codecs.ops import Workspace
from gradsync.collectives import primitives as P
from gradsync.collectives.pieces import Piece, fixed_capacity, trimmed
from gradsync.collectives.strategies import Coder, Pieces
from gradsync.collectives.topology import Topology

_MIN_CHUNK_BYTES = 4 << 20


def pipeline_chunks(nbytes: int, pipeline: int) -> int:
    """How many chunks hitopk's pipeline cuts ``nbytes`` into: ``pipeline``, but none under
    4 MiB (so at least one)."""
    return max(1, min(pipeline, nbytes // _MIN_CHUNK_BYTES))


def pipelined_allgather(
    padded: torch.Tensor, topo: Topology, coder: Coder, pipeline: int, scratch: torch.Tensor, ws: Workspace
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
        offset = start + topo.local_rank * sub
        payload = coder.encode(shard, f"allgather@{start}", at=offset)
        capacity = fixed_capacity(codec, sub, padded.dtype)
        if capacity is None:
            # a variable-size codec with a loose bound: exchange the sizes instead (no overlap)
            bufs = yield partial(P.all_gather_bytes, payload.data, topo.inter_group, "inter")
            pending.append((offset, sub, None, bufs))
        else:
            gather = yield partial(
                P.start_all_gather_fixed, payload.data, capacity, topo.inter_group, "inter"
            )
            pending.append((offset, sub, gather, None))
    # one step waits for every chunk still in flight (a step per chunk would hand the program
    # back and forth between the engine's threads for nothing)
    arrived = yield partial(_wait_all, [gather for _, _, gather, _ in pending])
    pieces = []
    for (offset, sub, _, bufs), got in zip(pending, arrived, strict=True):
        for buf in got if got is not None else bufs:
            pieces.append(Piece(offset, trimmed(codec, buf, sub, padded.dtype)))
    return pieces


def _wait_all(gathers: list[P.PendingGather | None]) -> list[list[torch.Tensor] | None]:
    return [None if g is None else g.wait() for g in gathers]
