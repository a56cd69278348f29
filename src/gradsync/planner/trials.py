"""The closed loop's trials: plans that run one codec alone, measured in the running engine.

``auto`` picks a codec per bucket among its candidates by the cost model, and the closed loop
re-plans by the same model, refitted. Where the model misses something that depends on the
whole plan, neither sees it. On the emulated 2 x 1 cluster at 200 Mbit/s with VGG (issue 44,
twelfth session, three runs) the first plan put the two large classifier layers under PowerSGD
and the rest under top-k; its re-plans changed nothing that lasted, and the run measured
0.885-0.967x the step of ``hitopk``, top-k on every bucket. The simulator ranked that plan first
in all three runs: it runs PowerSGD's projections as work that shares the cores with the
backward pass, where the planner's order of work (:func:`gradsync.planner.recut.span`) gives
each thread its own core. The closed loop's own measurement said the same: the span of
``hitopk``'s steps was 4-6 % below that of ``auto``'s first plan in each run.

So once its re-plans are done, the closed loop measures up to ``replan_trials`` plans that use
one codec alone, on the strategy it was named with (:func:`codec_families`; each bucket
compressed with it or dense, as the model prices cheaper). Each trial is a :class:`Duel`
with the fastest plan so far, the two run in turns (:data:`DUEL_BLOCKS`) for as many steps as
the spread of the steps needs (:func:`trial_steps`), and the loop settles on the last winner.
The families are tried in the order the model predicts them; a family whose plan is one the loop
already measured is passed over. A trial switches every rank at the same step, and a switch
carries what the ended streams owed (:mod:`gradsync.sync.carry`), so a trial loses nothing.

:func:`codec_families` says which families a scheme has and :func:`trial_plans` which plans to
try; the engine (:class:`gradsync.planner.replan.Replanner`) and the simulator
(:mod:`gradsync.whatif.contenders`, which predicts ``auto`` as the fastest of its first plan and
its trials) both call them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradsync.planner.plan import Plan, same_plan

MAX_TRIAL_STEPS = 30
"""The most steps a trial (and the plan it must beat) is measured for, however noisy the steps."""


def trial_steps(spread: float, gain: float, least: int) -> int:
    """Steps to measure each trial and the plan it must beat for, given the spans' relative
    ``spread`` (:func:`gradsync.planner.closed_loop.pooled_spread`): enough that the
    difference of the two medians has a standard deviation of at most ``gain / 2`` (a median of
    n steps is off by about 1.25 spread / sqrt(n)), so that a plan ``gain`` faster wins about
    49 times in 50; at least ``least``, at most :data:`MAX_TRIAL_STEPS`."""
    if gain <= 0:
        return MAX_TRIAL_STEPS
    n = math.ceil(2 * (2.5 * spread / gain) ** 2)
    return max(least, min(n, MAX_TRIAL_STEPS))


DUEL_BLOCKS: tuple[tuple[str, int], ...] = (("a", 1), ("b", 2), ("a", 2), ("b", 2), ("a", 1))
"""A duel's blocks in order: which side runs ("a", the plan to beat; "b", the trial) and for how
many units of steps. Each side runs 4 units, and the middles of their steps coincide (both at
4 units from the start), so a speed that drifts linearly over the duel weighs on both alike."""


def duel_block_steps(length: int) -> int:
    """The steps of one unit of a duel's blocks, for sides measured over at least ``length``
    steps each (:func:`trial_steps`): each side runs 4 units."""
    per_side = sum(units for side, units in DUEL_BLOCKS if side == "a")
    return max(1, math.ceil(length / per_side))


@dataclass
class Duel:
    """A trial measured against the plan it must beat, in turns (:data:`DUEL_BLOCKS`).

    Measured one after the other, two plans are measured at different moments, and the
    machine's speed moves between them: in a 2 x 1 run on the emulated cluster (issue 44,
    thirteenth session) the spans fell phase by phase (225, 208, 192 ms) and each later plan was
    kept. In turns, a slow stretch falls on both sides more often than on one, and a steady
    drift cancels. The block in
    progress is :attr:`block`; :attr:`spans` holds each finished block's measured span."""

    a: Plan
    b: Plan
    block: int = 0
    spans: list[float] = field(default_factory=list)

    @property
    def side(self) -> str:
        return DUEL_BLOCKS[self.block][0]

    @property
    def plan(self) -> Plan:
        """The plan the block in progress runs."""
        return self.a if self.side == "a" else self.b

    def steps(self, unit: int) -> int:
        """Measured steps of the block in progress (``unit``: :func:`duel_block_steps`)."""
        return DUEL_BLOCKS[self.block][1] * unit

    def record(self, span: float) -> bool:
        """The block in progress measured ``span`` (seconds; 0 or less: nothing measured); True
        when it was the last block."""
        self.spans.append(span)
        self.block += 1
        return self.block == len(DUEL_BLOCKS)

    def means(self) -> tuple[float, float]:
        """Each side's span (a, b): the mean of its blocks' spans weighted by their length; a
        side with nothing measured has an infinite span."""
        out = []
        for want in ("a", "b"):
            pairs = [
                (units, span)
                for (side, units), span in zip(DUEL_BLOCKS, self.spans, strict=False)
                if side == want and span > 0
            ]
            weight = sum(u for u, _ in pairs)
            out.append(sum(u * s for u, s in pairs) / weight if weight else math.inf)
        return out[0], out[1]

    def to_state(self) -> dict[str, Any]:
        plans = {"a": self.a.to_state(), "b": self.b.to_state()}
        return {**plans, "block": self.block, "spans": list(self.spans)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Duel:
        return cls(
            Plan.from_state(state["a"]), Plan.from_state(state["b"]), int(state["block"]),
            [float(v) for v in state["spans"]],
        )  # fmt: skip


def codec_families(specs: Sequence[str], candidates: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The codec id a trial of each codec runs (``specs``: each codec id's spec, the engine's
    codecs in order), for a scheme with ``candidates``; empty where there is nothing to try (no
    candidates, or all of one codec).

    A codec's first id is the scheme it was named with (the scheme's own, then the named
    candidates, then the other strategies ``auto`` may run each on: :meth:`Scheme.alternatives`),
    and a trial runs that one alone: the plan a fixed scheme of the codec runs, on the buckets
    ``auto`` cut. The other strategies are left to the re-plans, whose switches the revert guard
    checks. A trial of the strategies the refitted model prices cheapest put VGG's large layers on
    the compressed ring in a 2 x 1 run (issue 44, fourteenth session), a collective the refit had
    never measured; it ran 37 % slower than the plan it had to beat, where the same codec on its
    all-gather matched that plan."""
    if not candidates:
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for cid, spec in enumerate(specs):
        out.setdefault(spec, (cid,))
    return out if len(out) > 1 else {}


def trial_plans(
    families: dict[str, tuple[int, ...]],
    make: Callable[[tuple[int, ...]], Plan],
    price: Callable[[Plan], float],
    measured: Sequence[Plan],
    tried: Collection[str] = (),
    count: int = 1,
) -> list[tuple[str, Plan, float]]:
    """Up to ``count`` trials, fastest predicted first: (family, its plan, predicted seconds).
    ``make(ids)`` plans with only those codec ids; ``price`` predicts a plan. A family already
    ``tried``, or whose plan equals one of ``measured`` (or an earlier family's), is passed
    over."""
    options = []
    for family, ids in families.items():
        if family in tried:
            continue
        plan = make(ids)
        if any(same_plan(plan, m) for m in measured):
            continue
        options.append((price(plan), family, plan))
    options.sort(key=lambda o: (o[0], o[1]))
    out: list[tuple[str, Plan, float]] = []
    for seconds, family, plan in options:
        if len(out) < count and not any(same_plan(plan, p) for _, p, _ in out):
            out.append((family, plan, seconds))
    return out
