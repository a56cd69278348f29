"""PowerSGD inside a collective: its rounds of sums, each an all-reduce.

A codec with the ``lowrank`` trait is not sent as payloads: it synchronizes in rounds whose
tensors are summed over the ranks (PowerSGD's: the P factors, then the Q factors; what each
round holds and what is done between them is the codec's, :func:`gradsync.codecs.lowrank.summed_rounds`).
This module only moves them: one all-reduce per round, and with local aggregation the node's
reduce onto its leader first, the rounds among the leaders across nodes, and the leader's
broadcast inside the node after.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist

from gradsync.codecs.lowrank import summed_rounds
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
    """Sum the tensors over ``group`` through PowerSGD's rounds: the codec says what each round
    sums (:func:`gradsync.codecs.lowrank.summed_rounds`), this program all-reduces it. ``final``:
    nothing follows the rounds in the caller's program (the last all-reduce is marked last)."""
    rounds = summed_rounds(coder.codec, parts, coder.loss_scale)
    try:
        tensor, is_last = next(rounds)
        while True:
            yield last(partial(P.all_reduce, tensor, group, level), final and is_last)
            tensor, is_last = next(rounds)
    except StopIteration as done:
        finisher: Callable[[], None] | None = done.value
        return finisher
