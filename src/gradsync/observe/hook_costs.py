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

:func:`powersgd_hook_rate` times the hook itself: DDP on a process group of this one rank, each
call of the hook from its start to its future's completion; that work per bucket byte is the rate
the simulator charges (:func:`gradsync.whatif.contenders.build_program`'s ``hook_rate``). What
the hook sends is not timed but modelled from the tensors' shapes
(:func:`gradsync.collectives.cost.powersgd_hook_split`), and checked against the hook's own
counters in a run (:func:`powersgd_hook_sent`).
"""
# (no ``from __future__ import annotations``: DDP reads the timing hook's annotations at run time)

import contextlib
import copy
import gc
import math
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


HOOK_WARMUP_STEPS = 3
"""Steps before the hook is timed: its dense warm-up (``start_powerSGD_iter`` = 2, the least PyTorch
allows with error feedback) and its first compressed step, which allocates its factors' and
residual's buffers."""


def _busy_seconds(spans: list[tuple[float, float]]) -> float:
    """The time during which at least one of the ``(start, end)`` intervals is open."""
    total, end = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def powersgd_hook_rate(
    base: nn.Module,
    loss_of: LossOf,
    rank: int,
    bucket_mb: float | None,
    device: torch.device | None = None,
    steps: int = 12,
) -> float:
    """Seconds per byte of gradient that PyTorch's PowerSGD hook (``rank``, error feedback and
    warm start as by default) works in a forward and backward pass of ``base`` (``loss_of``), on
    ``device`` (default: where ``base`` is), in DDP buckets of ``bucket_mb`` (None: DDP's
    default). Run by one rank alone: it makes a process group of itself (no other rank takes part),
    so the hook's collectives move nothing and what is timed is the hook's own work: from each call
    of the hook to the completion of the future it returns (its callbacks included), the
    intervals of a step's buckets counted once where they overlap, the median over ``steps``
    steps after :data:`HOOK_WARMUP_STEPS`. Needs an initialized process group
    (:func:`one_rank_world` makes one in a single process).

    Until issue 64 this was the difference between the median step with and without the hook.
    The hook's work is a few milliseconds on a small model, a step's noise on this project's
    busy 2-core machine tens: on the CIFAR ResNet (0.7 MB) five such differences read 0.0-7.9 ms
    while the hook timed itself at 2.8-3.7 ms; a stored ``bench whatif`` run had read 0.0 and
    another 11.3 ms (docs/whatif.md, issue 64's section)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    me = dist.get_rank()
    alone = dist.new_group([me], use_local_synchronization=True)
    params = list(base.parameters())
    device = device or (params[0].device if params else torch.device("cpu"))
    ids = [device.index] if device.type == "cuda" else None
    # find_unused_parameters: a model may leave parameters without a gradient
    kw: dict[str, Any] = {"find_unused_parameters": True}
    if bucket_mb is not None:
        kw["bucket_cap_mb"] = bucket_mb
    model = DDP(copy.deepcopy(base).to(device), process_group=alone, device_ids=ids, **kw)
    state = psgd.PowerSGDState(process_group=alone, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    spans: list[tuple[float, float]] = []

    def timed(state: psgd.PowerSGDState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        synchronize(device)  # the backward pass's queued kernels are not the hook's work
        t0 = time.perf_counter()

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            synchronize(device)
            spans.append((t0, time.perf_counter()))
            return fut.value()

        return psgd.powerSGD_hook(state, bucket).then(done)

    model.register_comm_hook(state, timed)
    busy = []
    for step in range(HOOK_WARMUP_STEPS + steps):
        spans.clear()
        loss_of(model).backward()  # DDP waits for every bucket's future before it returns
        model.zero_grad(set_to_none=True)
        if step >= HOOK_WARMUP_STEPS:
            busy.append(_busy_seconds(spans))
    # the DDP wrapper (its reducer holds the group) goes first; the one-rank group itself stays
    # until the world is destroyed: destroying it here, under a live reducer, can abort the
    # process ("Resource deadlock avoided")
    del model, state
    gc.collect()
    return statistics.median(busy) / max(gradient_bytes(base), 1)


def powersgd_hook_sent(state: Any, numel: int) -> dict[str, float]:
    """What PyTorch's PowerSGD hook sent so far, by its own counters (``PowerSGDState``'s
    ``compression_stats()``, summed over the steps it compressed): ``compressed_steps``, its
    elements before compression over the model's ``numel`` (the steps past its dense warm-up,
    ``start_powerSGD_iter``), and ``sent_fraction``, the elements it sent (the tensors it left
    uncompressed and the P and Q factors) over those before compression. The simulator's
    :func:`gradsync.collectives.cost.powersgd_hook_split` predicts the fraction from the shapes."""
    _, before, after = state.compression_stats()
    return {
        "compressed_steps": before / max(numel, 1),
        "sent_fraction": after / before if before else 1.0,
    }


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
