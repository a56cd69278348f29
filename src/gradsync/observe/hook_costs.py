"""What PyTorch's PowerSGD communication hook costs as it runs, for the what-if simulator
(``gradsync bench whatif`` times it in its run, ``gradsync profile --powersgd-hook-ranks`` into
the profile that ``gradsync whatif`` reads).

The simulator's DDP PowerSGD contender used to charge the hook gradsync's own PowerSGD codec's
timing: one pass of products over the matrices. The hook does more: error feedback (add the
residual, copy the input, subtract the approximation), a product, an orthogonalization and a
copy per matrix, the batched factors' buffers, its futures' callbacks. On VGG (85.6 MB, rank 1,
this project's CPU) that is 129-150 ms a step against the codec's 14-17 ms (the same
``bench whatif`` runs, docs/whatif.md), all of it after the backward pass (the hook sees the
whole model's bucket), so the prediction came out 9-45 % fast.

:func:`powersgd_hook_rate` times the hook itself: DDP on a process group of this one rank, with
and without the hook, in alternating passes; the difference per bucket byte is the rate the
simulator charges (:func:`gradsync.whatif.contenders.build_program`'s ``hook_rate``).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.collectives.cost import synchronize
from gradsync.observe.profiler import default_loss


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s gradients (the parameters that take one): what the rate is per."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


LossOf = Callable[[nn.Module], torch.Tensor]
"""``loss_of(model)``: one forward pass of ``model`` (a DDP wrapper) on a fixed batch, the loss."""


def cross_entropy_of(x: torch.Tensor, y: torch.Tensor) -> LossOf:
    """The loss of a classifier on ``x`` against labels ``y`` (or of a language model against the
    next tokens ``y``: :func:`gradsync.observe.profiler.default_loss`)."""
    return lambda model: default_loss(model(x), y)


def _step_seconds(model: nn.Module, loss_of: LossOf, device: torch.device, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        synchronize(device)
        t0 = time.perf_counter()
        loss_of(model).backward()
        synchronize(device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return times


def powersgd_hook_rate(
    base: nn.Module,
    loss_of: LossOf,
    rank: int,
    bucket_mb: float | None,
    device: torch.device | None = None,
    passes: int = 5,
) -> float:
    """Seconds per byte of gradient that PyTorch's PowerSGD hook (``rank``, error feedback and
    warm start as by default) adds to a forward and backward pass of ``base`` (``loss_of``), on
    ``device`` (default: where ``base`` is), in DDP buckets of ``bucket_mb`` (None: DDP's
    default). Run by one rank alone: it makes a process group of itself (no other rank takes
    part), so the hook's collectives move nothing. Over ``passes`` alternating passes of 4 steps
    each (after 3 warm-up steps, which also end the hook's dense start), the median over the
    passes of each pass's median step with the hook minus its median without. Needs an
    initialized process group (:func:`one_rank_world` makes one in a single process)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    me = dist.get_rank()
    alone = dist.new_group([me], use_local_synchronization=True)
    params = list(base.parameters())
    device = device or (params[0].device if params else torch.device("cpu"))
    ids = [device.index] if device.type == "cuda" else None

    def wrapped() -> DDP:
        # find_unused_parameters: a model may leave parameters without a gradient; both wrappers
        # pay the same search, which the difference cancels
        model = copy.deepcopy(base).to(device)
        kw: dict[str, Any] = {"find_unused_parameters": True}
        if bucket_mb is not None:
            kw["bucket_cap_mb"] = bucket_mb
        return DDP(model, process_group=alone, device_ids=ids, **kw)

    plain, hooked = wrapped(), wrapped()
    state = psgd.PowerSGDState(process_group=alone, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    hooked.register_comm_hook(state, psgd.powerSGD_hook)
    _step_seconds(plain, loss_of, device, 3)
    _step_seconds(hooked, loss_of, device, 3)
    # each pass's difference of medians, then their median: a stretch of a busy machine slows
    # the passes it falls in, not the estimate (over all steps at once, one run of the bench
    # read twice the work of six others)
    differences = []
    for _ in range(passes):
        without = _step_seconds(plain, loss_of, device, 4)
        with_hook = _step_seconds(hooked, loss_of, device, 4)
        differences.append(statistics.median(with_hook) - statistics.median(without))
    extra = max(statistics.median(differences), 0.0)
    # the DDP wrappers (their reducers hold the group) go first; the one-rank group itself stays
    # until the world is destroyed: destroying it here, under a live reducer, can abort the
    # process ("Resource deadlock avoided")
    del plain, hooked, state
    gc.collect()
    return extra / max(gradient_bytes(base), 1)


@contextlib.contextmanager
def one_rank_world() -> Iterator[None]:
    """A gloo process group of this process alone, for :func:`powersgd_hook_rate` outside a
    launched world (``gradsync profile``); nothing when a group exists already. Destroyed on exit."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # the DDP wrappers' reducers go before the group
        # gloo's worker threads drop a finished collective's work (and its tensors, which need
        # the GIL) a moment after the caller has moved on; destroying the group meanwhile can
        # abort the process (pytorch/pytorch#190489). Give them that moment.
        time.sleep(0.2)
        dist.destroy_process_group()
