"""Step agreement: every synchronization carries the step it belongs to.

Ranks that fall out of step still issue collectives of the same sizes, so nothing in the
transport notices: a rank that skipped a backward pass would average its step-3 gradients with
another rank's step-2 ones, silently. So each synchronized step starts with one tiny all-reduce
(MAX over ``[step, -step, forwards, -forwards]``: its result holds both the largest and the
smallest value of each counter, so a single collective tells whether every rank agrees). It is
queued before the step's first bucket, so it runs while the backward pass computes, and the
buckets' collectives are only issued once it has passed: on a mismatch every rank (they all see
the same reduced numbers) gathers the counters, and raises :class:`OutOfStepError` naming them.

``step`` counts synchronized steps; ``forwards`` counts forward passes that build a graph (train
mode, gradients enabled), which is what exposes a rank that ran a forward pass without its
backward. A rank that takes part without data (it has joined under
``torch.distributed.algorithms.Join``) sends a neutral forward count.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from gradsync.collectives import primitives as P
from gradsync.collectives.program import Program
from gradsync.collectives.topology import Topology

NEUTRAL = -(2**62)  # the MAX-neutral value a joined rank sends for its forward count

UNEVEN_HINT = (
    "if the ranks have different numbers of batches (uneven inputs), give every rank the same "
    "number (DistributedSampler(..., drop_last=True) or a fixed step count) or train inside "
    "torch.distributed.algorithms.Join([model])"
)


class OutOfStepError(P.MismatchError):
    """Ranks tried to synchronize different steps."""


def sequence_program(topo: Topology, step: int, forwards: int | None) -> Program:
    """The step check as a step program over ``topo.world_group`` (``forwards`` None: this rank
    takes part without data)."""
    fwd = NEUTRAL if forwards is None else forwards
    mine = torch.tensor(
        [step, -step, fwd, NEUTRAL if forwards is None else -fwd], dtype=torch.int64, device="cpu"
    )
    reduced = mine.to(topo.comm_device, copy=True)  # mine stays this rank's own numbers
    yield partial(P.all_reduce, reduced, topo.world_group, "world", op=dist.ReduceOp.MAX)
    hi_step, neg_lo_step, hi_fwd, neg_lo_fwd = reduced.tolist()
    fwd_agree = hi_fwd == NEUTRAL or hi_fwd == -neg_lo_fwd
    if hi_step == -neg_lo_step and fwd_agree:
        return None
    # every rank saw the same reduced numbers, so every rank gathers the details here together
    table = torch.empty(topo.world * 4, dtype=torch.int64, device=topo.comm_device)
    yield partial(P.all_gather, table, mine.to(topo.comm_device), topo.world_group, "world")
    rows = table.view(topo.world, 4).tolist()
    parts = []
    for r, (s, _, f, _) in enumerate(rows):
        text = f"rank {r}: step {s}"
        text += ", joined (no data)" if f == NEUTRAL else f", {f} forward passes"
        parts.append(text)
    raise OutOfStepError(
        "gradsync: the ranks are out of step (" + "; ".join(parts) + "). A rank skipped or repeated "
        "a backward pass, or ran a forward pass without its backward, so its gradients would be "
        f"averaged with another step's; {UNEVEN_HINT}"
    )
