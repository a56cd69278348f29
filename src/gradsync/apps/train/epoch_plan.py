"""What each epoch of a ``gradsync train`` run trains with: the input size, the samples a worker
takes per optimizer step, and so the number of steps.

Without ``--resize-schedule`` every epoch is alike. With it, ``--resize-batch memory`` keeps the
activation memory of a micro-batch about constant across the schedule, as the DAWNBench recipes
of the MSTopK paper do: ``--batch-size`` is the micro-batch at the schedule's largest size, and an
epoch at size ``s`` takes ``floor(batch_size * (largest / s) ** 2)`` samples per micro-batch (never
more than a worker's share of the data), with the same number of micro-batches per step. The global
batch, and so the steps per epoch, then change from stage to stage, and with ``--lr-scaling`` the
learning rate follows each stage's global batch.

Every option given in epochs (the warm-up, ``--dense-warmup``, ``--switch-to-dense-at``,
``--density-schedule``, the schedule's length) becomes a step count through :meth:`EpochPlan.to_steps`,
which counts each epoch's own steps, so a fraction of an epoch means the same share of that
epoch's steps whatever its batch. The plan is a function of the options alone, so a resumed run
rebuilds the very same one.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import math
from dataclasses import dataclass
from functools import cached_property

from gradsync.apps.train.options import batch_plan
from gradsync.apps.train.resize import parse_resize_schedule, size_at


@dataclass(frozen=True)
class EpochPlan:
    """Per epoch (0-based): ``sizes`` (None: the data's own), ``per_worker`` samples per step and
    worker, ``steps``; ``accumulation`` micro-batches per step throughout."""

    sizes: tuple[int | None, ...]
    per_worker: tuple[int, ...]
    steps: tuple[int, ...]
    accumulation: int
    workers: int

    @property
    def epochs(self) -> int:
        return len(self.steps)

    def global_batch(self, epoch: int) -> int:
        return self.per_worker[epoch] * self.workers

    @property
    def global_batches(self) -> list[int]:
        return [b * self.workers for b in self.per_worker]

    @cached_property
    def _ends(self) -> tuple[int, ...]:
        """The step count at the end of each epoch (computed once: the scheduler asks every step)."""
        return tuple(itertools.accumulate(self.steps))

    def steps_before(self, epoch: int) -> int:
        """Optimizer steps in the epochs before ``epoch``."""
        return self._ends[epoch - 1] if epoch > 0 else 0

    @property
    def total_steps(self) -> int:
        return self._ends[-1] if self._ends else 0

    def to_steps(self, epochs: float) -> int:
        """``epochs`` (fractional, >= 0) as a number of optimizer steps: the whole epochs' steps
        plus the fraction of the next epoch's; past the last epoch, that epoch's length goes on."""
        whole = math.floor(epochs)
        if whole >= self.epochs:
            return self.total_steps + round((epochs - self.epochs) * self.steps[-1])
        return self.steps_before(whole) + round((epochs - whole) * self.steps[whole])

    def epoch_of_step(self, step: int) -> int:
        """The epoch that optimizer step ``step`` (0-based) belongs to (the last one past the end)."""
        return min(bisect.bisect_right(self._ends, step), self.epochs - 1)

    @property
    def uniform(self) -> bool:
        return len(set(self.per_worker)) == 1


def memory_batch(micro: int, size: int, largest: int) -> int:
    """The micro-batch at ``size`` whose activations take about the memory that ``micro`` samples
    take at ``largest`` (activations grow with the pixel count)."""
    return max(1, math.floor(micro * (largest / size) ** 2))


def epoch_plan(args: argparse.Namespace, workers: int, share: int, native: int | None) -> EpochPlan:
    """The plan for ``args`` on ``workers`` workers with ``share`` training samples each (the
    sampler's length) and images ``native`` pixels wide (None: not images)."""
    per_worker, accumulation = batch_plan(args, workers)
    stages = parse_resize_schedule(args.resize_schedule, native=native) if args.resize_schedule else None
    memory = stages is not None and args.resize_batch == "memory"
    largest = max(s for _, s in stages) if stages else 0
    micro = per_worker // accumulation
    sizes: list[int | None] = []
    batches: list[int] = []
    for epoch in range(args.epochs):
        size = size_at(stages, epoch) if stages else None
        batch = per_worker
        if memory and size is not None:
            batch = min(memory_batch(micro, size, largest), share // accumulation) * accumulation
        sizes.append(size)
        batches.append(batch)
    steps = tuple(share // b if b > 0 else 0 for b in batches)
    return EpochPlan(tuple(sizes), tuple(batches), steps, accumulation, workers)
