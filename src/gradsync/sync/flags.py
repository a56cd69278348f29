"""The flags a synchronized step ends with, agreed by every rank in one tiny all-reduce: whether
any rank's gradients overflowed (inf/NaN), and which parameters some rank used. The engine and
the DDP hook both issue it after their last bucket; what a round does with the result is
:class:`~gradsync.sync.round.Round`'s (an overflow anywhere: every rank skips the step and rolls
the round back; a parameter no rank used: its residual comes back).

Also here: the rescaling under ``Join(divide_by_initial_world_size=False)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync.codecs.ops.backend import expected_host_read
from gradsync.collectives import primitives as P
from gradsync.collectives.program import Program
from gradsync.collectives.topology import Topology
from gradsync.sync.buckets import Slot

STEP_FLAGS = "the step's flags"
"""How an audit of host reads (:mod:`gradsync.sync.host_reads`) names the one read of the agreed
flags a step makes (and, when the step agrees which parameters were used, their upload)."""


def read_flags(flags: torch.Tensor) -> list[float]:
    """The agreed flags as numbers: the step's one intended host read."""
    with expected_host_read(STEP_FLAGS):
        return flags.tolist()


def flags_program(
    topo: Topology,
    nonfinite: list[torch.Tensor],
    used: Callable[[], list[float]] | None,
    count: int = 0,
) -> tuple[Program, torch.Tensor]:
    """The flag all-reduce as a step program, and the host tensor that holds the agreed flags
    once it ran: ``[overflow, used_0, ..., used_{count-1}]`` (maxima over the ranks).

    ``nonfinite``: the buckets' device flags (:func:`~gradsync.sync.bucket_sync.nonfinite_flag`),
    read when the program runs, after every bucket was packed (the task manager runs the tasks'
    first segments in order); ``used()`` gives ``count`` values, 1.0 for each parameter this rank
    used (None: the use is not agreed)."""
    host = torch.zeros(1 + count, dtype=torch.float32, device="cpu")
    out = host.to(topo.comm_device)

    def program() -> Program:
        if used is not None:
            with expected_host_read(STEP_FLAGS):
                host[1:] = torch.tensor(used(), dtype=torch.float32, device=host.device)
                out.copy_(host)
        if nonfinite:  # device flags: no host synchronization per bucket
            out[:1].copy_(torch.stack([f.to(out.device) for f in nonfinite]).any().reshape(1))
        yield lambda: P.all_reduce(out, topo.world_group, "world", op=dist.ReduceOp.MAX)
        return lambda: host.copy_(out)

    return program(), host


def rescale_for_join(
    work: Any, divide_by_world: bool, shadow: bool, slots: Sequence[Slot], world: int
) -> None:
    """Under ``Join(..., divide_by_initial_world_size=False)``: a mean over the ranks that still
    train, not over the whole world (the joined ranks contributed zeros). ``work``: Join's
    all-reduce of the ranks still training, this step."""
    work.wait()
    if divide_by_world or shadow:
        return
    active = int(work.result()[0].item())
    if 0 < active < world:
        for s in slots:
            if s.param.grad is not None:
                s.param.grad.mul_(world / active)
