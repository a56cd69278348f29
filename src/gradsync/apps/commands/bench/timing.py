"""Timing helpers: medians of repeated calls, interleaved with a reference so ratios survive noise."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Paired:
    """A function and a reference timed alternately in the same loop.

    ``seconds`` and ``reference`` are medians; ``ratio`` is the median of the per-pair ratios,
    each taken between two adjacent calls, which cancels slow drifts of the machine.
    """

    seconds: float
    reference: float
    ratio: float
    reps: int


def _once(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def paired(
    fn: Callable[[], object],
    reference: Callable[[], object],
    min_reps: int = 7,
    max_reps: int = 60,
    budget_s: float = 0.25,
    warmup: int = 2,
) -> Paired:
    """Time ``fn`` and ``reference`` alternately; stop after ``min_reps`` once ``budget_s`` is spent.

    Alternating means a slow phase of the machine (another process, a frequency change) hits
    both sides alike, so the ratio of the two medians is stable even when the absolute times are not.
    """
    for _ in range(warmup):
        fn()
        reference()
    a: list[float] = []
    b: list[float] = []
    spent = 0.0
    while len(a) < max_reps and (len(a) < min_reps or spent < budget_s):
        tb = _once(reference)
        ta = _once(fn)
        a.append(ta)
        b.append(tb)
        spent += ta + tb
        if ta > 1.0 and len(a) >= 3:  # very slow calls: three samples are enough
            break
    ratios = [ta / tb for ta, tb in zip(a, b, strict=True) if tb > 0]
    ratio = statistics.median(ratios) if ratios else float("inf")
    return Paired(statistics.median(a), statistics.median(b), ratio, len(a))
