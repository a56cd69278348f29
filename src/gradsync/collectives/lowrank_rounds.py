"""PowerSGD inside a collective: the low-rank factors summed in two all-reduce rounds.

A codec with the ``lowrank`` trait is not sent as payloads: every matrix of a bucket is
projected (``P = M Q``), the P factors of all of them go into one all-reduce (the bucket's
tensors that are sent dense ride along), the summed P is orthonormalized and projected back
(``Q = M^T P``), and the Q factors go into a second all-reduce. With local aggregation the node
first reduces onto its leader, only the leaders run the two rounds across nodes, and the leader
broadcasts the result inside the node.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from gradsync.codecs.lowrank import lowrank_codec, matrix_shape
from gradsync.collectives import primitives as P
from gradsync.collectives.program import Program, chain, last, scaled
from gradsync.collectives.strategies import Coder
from gradsync.collectives.topology import Topology


def lowrank_program(
    flat: torch.Tensor,
    parts: list[tuple[torch.Tensor, str]],
    topo: Topology,
    coder: Coder,
    local: bool,
    scale: float,
) -> Program:
    """PowerSGD over the tensors ``parts`` (views into the contiguous ``flat``, with state keys).

    Without local aggregation the two rounds run over the world. With it the node reduces onto
    its leader, the leaders run the rounds across nodes, and the leader broadcasts the result."""
    if local:
        yield partial(P.reduce, flat, topo.leader, topo.intra_group, "intra")
        if topo.local_rank == 0 and topo.nodes > 1:
            tail = yield from lowrank_rounds(parts, topo.inter_group, "inter", coder)
            if tail is not None:
                tail()  # the leader reconstructs before it broadcasts
        yield last(partial(P.broadcast, flat, topo.leader, topo.intra_group, "intra"))
        return scaled(flat, scale)
    group = topo.world_group
    tail = yield from lowrank_rounds(parts, group, topo.level_of(group), coder, final=True)
    return chain(tail, scaled(flat, scale))


def lowrank_rounds(
    parts: list[tuple[torch.Tensor, str]],
    group: dist.ProcessGroup | None,
    level: str,
    coder: Coder,
    final: bool = False,
) -> Program:
    """Sum the tensors over ``group`` through PowerSGD's factors, every matrix of ``parts`` in the
    same two all-reduces (P, then Q); tensors the codec sends dense ride along with P. Each
    matrix's state (factors, error feedback) is its own stream, keyed by its key, and its
    residual's offsets count from the matrix's first element. ``final``: nothing follows the rounds
    in the caller's program (the last all-reduce is marked last)."""
    codec = lowrank_codec(coder.codec)
    feedback = coder.codec if coder.codec.error_feedback else None
    dense = [x for x, _ in parts if not codec.compresses(x.shape)]
    mats = []
    first_parts = [x.reshape(-1).float() for x in dense]
    for x, key in parts:
        if not codec.compresses(x.shape):
            continue
        v = coder.codec.accumulate(x, key, coder.loss_scale)
        m = v.view(matrix_shape(x.shape)).float()
        stream = codec.stream(key)
        p = codec.project(m, stream)
        mats.append((x, key, m, stream, p.shape, stream.p))  # stream.p: restored if the sums overflow
        first_parts.append(p.reshape(-1))
    if not first_parts:
        return None
    first = torch.cat(first_parts)
    yield last(partial(P.all_reduce, first, group, level), final and not mats)
    pos = sum(x.numel() for x in dense)
    q_locals = []
    for _, _, m, stream, shape, _ in mats:
        n = shape.numel()
        q_locals.append(codec.reproject(m, first[pos : pos + n].view(shape), stream).contiguous())
        pos += n
    second = torch.cat([q.reshape(-1) for q in q_locals]) if q_locals else first.new_empty(0)
    if mats:
        yield last(partial(P.all_reduce, second, group, level), final)

    def finish() -> None:
        # any rank's inf/NaN reaches the summed factors (and stays there: never hidden); in
        # resident mode the test stays on the device and every branch below becomes a where
        finite_t = torch.isfinite(first).all() & torch.isfinite(second).all()
        resident = codec.resident
        finite = True if resident else bool(finite_t)
        pos = 0
        for x in dense:
            x.copy_(first[pos : pos + x.numel()].view(x.shape))
            pos += x.numel()
        qpos = 0
        for (x, key, _, stream, _, old_p), q_local in zip(mats, q_locals, strict=True):
            q_sum = second[qpos : qpos + q_local.numel()].view(q_local.shape)
            qpos += q_local.numel()
            assert stream.p is not None  # reproject() kept orth(sum P) in the stream
            old_q = stream.q
            if feedback is not None:
                if finite:  # what this rank's data contributed to the sum
                    feedback.commit(key, factors=(stream.p, q_local))
                    if resident:
                        feedback.keep_if(~finite_t, key)
                else:
                    feedback.discard(key)
            if not finite:  # keep the factors finite (a skipped step); the NaN result makes it skip
                stream.p = old_p
                x.fill_(float("nan"))
                continue
            out = x.view(matrix_shape(x.shape)) if x.dtype == torch.float32 and x.is_contiguous() else None
            result = codec.reconstruct(q_sum, stream, out=out)
            if out is None:
                x.copy_(result.view(x.shape))
            if resident:
                x.masked_fill_(~finite_t, float("nan"))
                if old_p is not None:
                    stream.p = torch.where(finite_t, stream.p, old_p)
                if old_q is not None and stream.q is not None:
                    stream.q = torch.where(finite_t, stream.q, old_q)

    return finish
