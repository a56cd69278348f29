"""Collective algorithms as step programs: communication made explicit, so it can be scheduled.

Every algorithm in this package is written as a *program*: a generator that does its local work
(packing, encoding, merging) between ``yield`` statements and yields each communication step as
a zero-argument callable. Whoever runs the program calls that callable and sends its result back
into the generator. When the program has issued its last communication step it returns a
*finisher*: the local work left after the last transfer (decoding, scaling), or ``None``.

Two drivers exist:

- :func:`run` (here) executes a program inline: the synchronous API
  (:func:`gradsync.collectives.allreduce` and friends) is ``run(program)``;
- the sync engine's task manager (``gradsync.sync.tasks``) executes the communication steps of
  many programs on one communication thread, strictly in submission order (so every rank issues
  its collectives in the same order), and their local work on a compute thread, so that one
  bucket's encoding overlaps another bucket's transfer and the backward pass.

Nothing a program keeps between two of its steps may be shared with another program that can
run at the same time: scratch space comes from the :class:`~gradsync.codecs.ops.Workspace` the
caller passes in, one per concurrently running program.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import torch

Step = Callable[[], Any]
"""One communication step: issue the collective(s), return what the program needs back."""

Finisher = Callable[[], object]
"""Local work after a program's last communication step (what it returns is ignored)."""

Program = Generator[Step, Any, "Finisher | None"]


def run(program: Program) -> None:
    """Execute ``program`` inline: every step, then its finisher."""
    try:
        step = next(program)
        while True:
            step = program.send(step())
    except StopIteration as stop:
        finisher = stop.value
    if finisher is not None:
        finisher()


def chain(*finishers: Finisher | None) -> Finisher | None:
    """One finisher that runs the given ones in order (``None`` entries are skipped)."""
    todo = [f for f in finishers if f is not None]
    if not todo:
        return None
    if len(todo) == 1:
        return todo[0]

    def finish() -> None:
        for f in todo:
            f()

    return finish


def scaled(flat: torch.Tensor, scale: float) -> Finisher | None:
    """A finisher that multiplies ``flat`` by ``scale`` in place (``None`` when the scale is 1)."""
    if scale == 1.0:
        return None

    def finish() -> None:
        flat.mul_(scale)

    return finish
