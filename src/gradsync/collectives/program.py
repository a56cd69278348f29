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

A program marks its last communication step with :func:`last`. The task manager's communication
thread then moves on to the next task as soon as that step returns, instead of waiting until the
compute thread (busy, perhaps, encoding a later bucket) has resumed the program and seen it
return: without the mark, each program's end kept the network idle for up to one encode.

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


class LastStep:
    """A communication step marked as its program's last (see :func:`last`)."""

    __slots__ = ("step",)

    def __init__(self, step: Step) -> None:
        self.step = step

    def __call__(self) -> Any:
        return self.step()


def last(step: Step, final: bool = True) -> Step:
    """``step``, marked as the last communication step of its program when ``final`` (sub-programs
    take ``final`` from their caller, who knows whether anything follows them). Once a marked
    step has returned, the program may only do local work and return its finisher; yielding
    another step is a bug that both drivers raise (:class:`ProgramError`)."""
    return LastStep(step) if final else step


class ProgramError(RuntimeError):
    """A program broke the step-program rules (a bug in gradsync, never in the caller's input)."""


AFTER_LAST = (
    "gradsync: a step program yielded a communication step after the one it marked as its last "
    "(a bug: please report it)"
)


def run(program: Program) -> None:
    """Execute ``program`` inline: every step, then its finisher."""
    try:
        step = next(program)
        while True:
            result = step()
            was_last = isinstance(step, LastStep)
            step = program.send(result)
            if was_last:
                program.close()
                raise ProgramError(AFTER_LAST)
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
