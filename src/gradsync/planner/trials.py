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
one codec alone (a *family*: the codec on every strategy ``auto`` may run it on, each bucket
taking the family member the model prices cheapest, or dense), each for ``replan_steps`` steps
like any plan, and keeps whichever plan measured the shortest span: the plan it had, or a trial.
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

from gradsync.planner.closed_loop import same_plan
from gradsync.planner.plan import Plan

MAX_TRIAL_STEPS = 30
"""The most steps a trial (and the plan it must beat) is measured for, however noisy the steps."""


def trial_steps(spread: float, gain: float, least: int) -> int:
    """Steps to measure each trial and the plan it must beat for, given the spans' relative
    ``spread`` (:func:`gradsync.planner.closed_loop.relative_spread`): enough that the
    difference of the two medians has a standard deviation of at most ``gain / 2`` (a median of
    n steps is off by about 1.25 spread / sqrt(n)), so that a plan ``gain`` faster wins about
    49 times in 50; at least ``least``, at most :data:`MAX_TRIAL_STEPS`."""
    if gain <= 0:
        return MAX_TRIAL_STEPS
    n = math.ceil(2 * (2.5 * spread / gain) ** 2)
    return max(least, min(n, MAX_TRIAL_STEPS))


def codec_families(specs: Sequence[str], candidates: Sequence[int]) -> dict[str, tuple[int, ...]]:
    """The codec ids of each codec (``specs``: each codec id's spec, the engine's codecs in
    order), for a scheme with ``candidates``; empty where there is nothing to try (no
    candidates, or all of one codec)."""
    if not candidates:
        return {}
    out: dict[str, list[int]] = {}
    for cid, spec in enumerate(specs):
        out.setdefault(spec, []).append(cid)
    return {spec: tuple(ids) for spec, ids in out.items()} if len(out) > 1 else {}


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
