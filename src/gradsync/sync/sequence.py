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

``step`` counts synchronized steps. The second counter is the caller's:

- the DDP hook sends the forward passes that built a graph (train mode, gradients enabled), which
  exposes a rank that ran a forward pass without its backward;
- :func:`gradsync.wrap`'s engine sends :class:`EngineWords` instead: the *backward* passes that
  reached its parameters (micro-batches under ``no_sync()`` included) and which parameters are
  frozen. A forward pass without backward (a look at the predictions on one rank) is then no
  error, as with DDP; a rank that accumulated another number of micro-batches, or that froze
  other parameters, is. (A rank that dropped a batch after its forward pass cannot be told
  from one that took a look: it shows when the ranks run out of batches at different steps.)
  The engine's words also carry one flag, MAX-reduced: whether some rank had a parameter
  without a gradient in an earlier step (the engine then agrees on the used parameters at every
  step, see :mod:`gradsync.integrate.engine`). Forward counts that differ are reported back (the
  engine warns once), not refused.

A rank that takes part without data (it has joined under ``torch.distributed.algorithms.Join``)
sends neutral counts.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from gradsync.codecs.ops.backend import expected_host_read
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


@dataclass
class EngineWords:
    """What the engine's step check carries besides the step (see the module). ``any_missed``
    is the result: set once the check has run, the same on every rank."""

    passes: int | None
    """Backward passes that reached the engine's parameters so far (None: joined, no data)."""
    frozen: int
    """A signature of the parameters frozen (``requires_grad`` off) at this step."""
    missed: bool
    """This rank had a parameter without a gradient in an earlier step."""
    any_missed: bool = False
    forwards_apart: tuple[int, int] | None = None
    """Result: the fewest and the most forward passes of the ranks, when they differ (the
    engine warns: fine after a look at the predictions, not after a dropped batch)."""


STEP_CHECK = "the step check"
"""How an audit of host reads (:mod:`gradsync.sync.host_reads`) names the step check's upload
and read (once per step, on the compute thread, before the first bucket communicates)."""


def warn_forwards_apart(words: EngineWords | None, where: str) -> bool:
    """Warn when the last step check found the ranks' training-mode forward counts apart (the
    check compares backward passes: a look at the predictions on one rank is fine, and a batch
    dropped after its forward pass looks the same). True when it warned; the caller warns once."""
    apart = None if words is None else words.forwards_apart
    if apart is None:
        return False
    warnings.warn(
        f"gradsync: by {where} the ranks ran different numbers of training-mode forward passes "
        f"({apart[0]} to {apart[1]}). Fine for forward passes without backward (a look at the "
        "predictions); but a rank that dropped a batch after its forward pass now averages its "
        "gradients with other batches than the other ranks', and will run out of data at another step",
        RuntimeWarning,
        stacklevel=3,
    )
    return True


def _pair(value: int | None) -> list[int]:
    """``[v, -v]`` for a MAX all-reduce that yields both extremes; neutral for None."""
    return [NEUTRAL, NEUTRAL] if value is None else [value, -value]


def _agree(hi: int, neg_lo: int) -> bool:
    return hi == NEUTRAL or hi == -neg_lo


def sequence_program(
    topo: Topology,
    step: int,
    forwards: int | None,
    clock: LagClock | None = None,
    words: EngineWords | None = None,
) -> Program:
    """The step check as a step program over ``topo.world_group`` (``forwards`` None: this rank
    takes part without data). ``clock`` carries the waits from one step to the next. Without
    ``words`` the forward counts must agree; with them (the engine) the backward passes and the
    frozen parameters must, and ``words.any_missed`` receives the agreed flag."""
    waited = -1 if clock is None or clock.wait_s is None else round(clock.wait_s * 1e6)
    values = [*_pair(step), *_pair(forwards), waited]
    if words is not None:
        frozen = None if words.passes is None else words.frozen
        values += [*_pair(words.passes), *_pair(frozen), int(words.missed)]
    with expected_host_read(STEP_CHECK):
        mine = torch.tensor(values, dtype=torch.int64, device="cpu")
        reduced = mine.to(topo.comm_device, copy=True)  # mine stays this rank's own numbers

    def check() -> None:
        t0 = time.perf_counter()
        P.all_reduce(reduced, topo.world_group, "world", op=dist.ReduceOp.MAX)
        if clock is not None:
            clock.wait_s = time.perf_counter() - t0

    yield check
    with expected_host_read(STEP_CHECK):
        r = reduced.tolist()
    if clock is not None:
        clock.lag_s = r[4] / 1e6 if r[4] >= 0 else None
    agree = _agree(r[0], r[1])
    if words is None:
        agree = agree and _agree(r[2], r[3])
    else:
        agree = agree and _agree(r[5], r[6]) and _agree(r[7], r[8])
        words.any_missed = r[9] > 0
        if not _agree(r[2], r[3]):
            words.forwards_apart = (-r[3], r[2])
    if agree:
        return None
    # every rank saw the same reduced numbers, so every rank gathers the details here together
    table = torch.empty(topo.world * mine.numel(), dtype=torch.int64, device=topo.comm_device)
    yield partial(P.all_gather, table, mine.to(topo.comm_device), topo.world_group, "world")
    rows = table.view(topo.world, mine.numel()).tolist()
    raise OutOfStepError(_out_of_step(rows, words is not None))


def _out_of_step(rows: Sequence[Sequence[int]], engine: bool) -> str:
    parts = []
    for r, row in enumerate(rows):
        text = f"rank {r}: step {row[0]}"
        if row[2] == NEUTRAL:
            text += ", joined (no data)"
        elif engine:
            text += f", {row[5]} backward passes"
        else:
            text += f", {row[2]} forward passes"
        parts.append(text)
    frozen = engine and len({row[7] for row in rows if row[7] != NEUTRAL}) > 1
    if frozen:
        why = "The ranks froze different parameters (requires_grad_(False) on some ranks only)"
    elif engine:
        why = (
            "A rank skipped or repeated a backward pass (or accumulated another number of "
            "micro-batches under no_sync()), so its gradients would be averaged with another step's"
        )
    else:
        why = (
            "A rank skipped or repeated a backward pass, or ran a forward pass without its backward, "
            "so its gradients would be averaged with another step's"
        )
    return f"gradsync: the ranks are out of step ({'; '.join(parts)}). {why}; {UNEVEN_HINT}"
