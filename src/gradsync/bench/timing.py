"""Timing helpers: medians of repeated calls, interleaved with a reference so ratios survive noise."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Paired:
    """Median seconds of a function and of a reference timed alternately in the same loop."""

    seconds: float
    reference: float
    reps: int

    @property
    def ratio(self) -> float:
        return self.seconds / self.reference if self.reference > 0 else float("inf")


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
    return Paired(statistics.median(a), statistics.median(b), len(a))
