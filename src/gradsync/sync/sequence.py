"""Step agreement: every synchronization carries the step it belongs to.

Ranks that fall out of step still issue collectives of the same sizes, so nothing in the
transport notices: a rank that skipped a backward pass would average its step-3 gradients with
another rank's step-2 ones, silently. So each synchronized step starts with one tiny all-reduce
(MAX over ``[step, -step, forwards, -forwards]``: its result holds both the largest and the
smallest value of each counter, so a single collective tells whether every rank agrees). It is
queued before the step's first bucket, so it runs while the backward pass computes, and the
buckets' collectives are only issued once it has passed: on a mismatch every rank (they all see
the same reduced numbers) gathers the counters, and raises :class:`OutOfStepError` naming them.

The same all-reduce carries one more word: how long this rank waited in the previous step's
check (microseconds). Its MAX is the previous step's lag of the slowest rank behind the fastest
(the fastest rank waits longest), a telemetry figure that costs no collective of its own.

``step`` counts synchronized steps; ``forwards`` counts forward passes that build a graph (train
mode, gradients enabled), which is what exposes a rank that ran a forward pass without its
backward. A rank that takes part without data (it has joined under
``torch.distributed.algorithms.Join``) sends a neutral forward count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
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


@dataclass
class LagClock:
    """What the step check measures across steps: this rank's wait in the last check, and the
    largest wait over all ranks of the check before it (both None until known)."""

    wait_s: float | None = None
    lag_s: float | None = None


def sequence_program(
    topo: Topology, step: int, forwards: int | None, clock: LagClock | None = None
) -> Program:
    """The step check as a step program over ``topo.world_group`` (``forwards`` None: this rank
    takes part without data). ``clock`` carries the waits from one step to the next."""
    fwd = NEUTRAL if forwards is None else forwards
    waited = -1 if clock is None or clock.wait_s is None else round(clock.wait_s * 1e6)
    mine = torch.tensor(
        [step, -step, fwd, NEUTRAL if forwards is None else -fwd, waited], dtype=torch.int64, device="cpu"
    )
    reduced = mine.to(topo.comm_device, copy=True)  # mine stays this rank's own numbers

    def check() -> None:
        t0 = time.perf_counter()
        P.all_reduce(reduced, topo.world_group, "world", op=dist.ReduceOp.MAX)
        if clock is not None:
            clock.wait_s = time.perf_counter() - t0

    yield check
    hi_step, neg_lo_step, hi_fwd, neg_lo_fwd, hi_wait = reduced.tolist()
    if clock is not None:
        clock.lag_s = hi_wait / 1e6 if hi_wait >= 0 else None
    fwd_agree = hi_fwd == NEUTRAL or hi_fwd == -neg_lo_fwd
    if hi_step == -neg_lo_step and fwd_agree:
        return None
    # every rank saw the same reduced numbers, so every rank gathers the details here together
    table = torch.empty(topo.world * mine.numel(), dtype=torch.int64, device=topo.comm_device)
    yield partial(P.all_gather, table, mine.to(topo.comm_device), topo.world_group, "world")
    rows = table.view(topo.world, mine.numel()).tolist()
    parts = []
    for r, (s, _, f, *_) in enumerate(rows):
        text = f"rank {r}: step {s}"
        text += ", joined (no data)" if f == NEUTRAL else f", {f} forward passes"
        parts.append(text)
    raise OutOfStepError(
        "gradsync: the ranks are out of step (" + "; ".join(parts) + "). A rank skipped or repeated "
        "a backward pass, or ran a forward pass without its backward, so its gradients would be "
        f"averaged with another step's; {UNEVEN_HINT}"
    )
