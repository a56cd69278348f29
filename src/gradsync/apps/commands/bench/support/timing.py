"""Timing helpers: medians of repeated calls, interleaved with a reference so ratios survive noise;
whole training steps on the device that runs them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch


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


class StepClock:
    """Times whole steps on ``device``: on a GPU with CUDA events recorded on the current stream
    (a step's kernels, whichever thread queued them on that stream, fall between its two
    events), read after one synchronization at the end, so that timing adds no host wait to any
    step; elsewhere with ``time.perf_counter``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._times: list[tuple[float, float]] = []
        self._start_event: torch.cuda.Event | None = None
        self._start_time = 0.0

    def start(self) -> None:
        if self.cuda:
            self._start_event = torch.cuda.Event(enable_timing=True)
            self._start_event.record()
        else:
            self._start_time = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            assert self._start_event is not None, "StepClock.stop() without start()"
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._start_event, end))
            self._start_event = None
        else:
            self._times.append((self._start_time, time.perf_counter()))

    def seconds(self) -> list[float]:
        """Every step timed since the last call, in seconds (waits for the device once)."""
        events, self._events = self._events, []
        times, self._times = self._times, []
        if not self.cuda:
            return [b - a for a, b in times]
        torch.cuda.synchronize()
        return [a.elapsed_time(b) / 1e3 for a, b in events]
