"""The outer loop's schedule: its options checked, its outer step by period, its fragments' cut
and staggered meetings. Pure functions of numbers, kept apart from the loop itself
(:mod:`gradsync.outer.loop`) so that the simulator's ``outer@...`` contenders
(:mod:`gradsync.whatif.modes`) follow the very same rules."""

from __future__ import annotations

import math
from collections.abc import Sequence


def check_outer_options(
    *,
    every: int = 100,
    fragments: int = 1,
    delay: int = 0,
    mix: float | None = None,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
) -> float:
    """The options checked (``ValueError`` naming the option and its allowed values); returns
    ``mix`` with its default filled in (0.5 with a delay, else 0). The defaults are
    :class:`gradsync.OuterLoop`'s."""
    _check_int("every", every, 1)
    _check_int("fragments", fragments, 1)
    _check_int("delay", delay, 0)
    if delay >= every:
        raise ValueError(
            f"outer loop: delay must be below every (a fragment's exchange lands before its next "
            f"one starts), got delay={delay} with every={every}"
        )
    mix = (0.5 if delay else 0.0) if mix is None else mix
    _check_real("mix", mix, 0.0, 1.0)
    _check_real("outer_lr", outer_lr, 0.0, math.inf, lo_open=True)
    _check_real("outer_momentum", outer_momentum, 0.0, 1.0, hi_open=True)
    return float(mix)


SHORT_PERIOD = 100
"""Below this many inner steps between meetings, :func:`outer_step_for` averages (lr 1.0) with
a little momentum; from it on, DiLoCo's published step."""


def outer_step_for(every: int) -> tuple[float, float]:
    """The outer SGD's ``(lr, Nesterov momentum)`` for a period of ``every`` inner steps, where
    the user names none (``gradsync train --outer H``).

    Short periods: ``(1.0, 0.3)``, the step that trained best of six at H = 10 on the digits
    default, 2 nodes x 2 ranks, seeds 0-2 (``scripts/outer-step-study.sh``: 99.54 % mean
    validation accuracy against 99.16 % dense, and 96.29 % with DiLoCo's 0.7 / 0.9, which swings
    the shared model too far when it meets that often), and on the text recipe (perplexity 4.147
    against 4.184 for a plain average). From :data:`SHORT_PERIOD` inner steps on: DiLoCo's
    ``(0.7, 0.9)``, its paper's choice for periods in the hundreds (not measured here)."""
    return (1.0, 0.3) if every < SHORT_PERIOD else (0.7, 0.9)


def _check_int(name: str, value: object, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"outer loop: {name} must be an integer >= {lo}, got {value!r}")


def _check_real(
    name: str, value: object, lo: float, hi: float, lo_open: bool = False, hi_open: bool = False
) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
    if ok:
        v = float(value)  # type: ignore[arg-type]
        ok = (v > lo if lo_open else v >= lo) and (v < hi if hi_open else v <= hi)
    if not ok:
        lo_b, hi_b = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"outer loop: {name} must be a number in {lo_b}{lo}, {hi}{hi_b}, got {value!r}")


def split_fragments(sizes: Sequence[int], fragments: int) -> list[list[int]]:
    """Cut tensors of these sizes, in order, into ``fragments`` contiguous groups (each at least
    one tensor) whose largest total is as small as a cut by whole tensors allows: the outer loop's
    fragments (:class:`gradsync.OuterLoop`), and the simulator's of it (:mod:`gradsync.whatif.modes`).

    The largest fragment's exchange is what a streamed loop must hide behind its inner steps, so
    that is the size to keep small. Filling each group up to an equal share instead puts a tensor
    that crosses the share into the group before it: on VGG (one tensor of 16.8 M parameters of
    21.4 M) four fragments came out 21.36 M, 4 k, 41 k and 10 parameters, where the smallest
    largest is the big tensor alone."""
    n = len(sizes)
    if not 1 <= fragments <= n:
        raise ValueError(
            f"outer loop: fragments must be between 1 and the number of trained parameter tensors "
            f"({n}), got {fragments}"
        )

    def fits(cap: int) -> bool:  # greedy: at most ``fragments`` groups of at most ``cap`` each
        groups, filled = 1, 0
        for s in sizes:
            if filled and filled + s > cap:
                groups, filled = groups + 1, 0
            filled += s
        return groups <= fragments

    low, high = max(sizes), sum(sizes)  # the smallest cap that fits, by bisection
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    out: list[list[int]] = [[]]
    filled = 0
    for i, s in enumerate(sizes):
        groups_left = fragments - len(out)  # groups still to open after the current one
        if out[-1] and (filled + s > low or n - i <= groups_left):
            out.append([])
            filled = 0
        out[-1].append(i)
        filled += s
    return out


def fragment_offset(fragment: int, every: int, fragments: int) -> int:
    """The inner step (1-based) after which ``fragment`` of ``fragments`` first meets, then every
    ``every`` steps: the outer loop's staggered schedule (Streaming DiLoCo), shared with its
    simulation."""
    return (fragment + 1) * every // fragments
