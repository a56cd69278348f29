"""Optimizer and learning-rate schedule for ``gradsync train``.

Weight decay applies to weight matrices, embeddings and convolution kernels only: biases and
normalization parameters are left undecayed, as paper 03 does, and out of LARS's and LAMB's
trust ratios (:func:`gradsync.optim.layerwise_param_groups`).
The schedule is per optimizer step: a linear warm-up from lr/10, then cosine to zero, a step
decay (x0.1 at 50 % and 75 % of the run) or a constant rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from gradsync.optim import LAMB, LARS, layerwise_param_groups
from gradsync.optim.layerwise import Parallel

DEFAULT_LR = {"sgd": 0.1, "adamw": 0.002, "lars": 2.0, "lamb": 0.005}
DEFAULT_TRUST = {"lars": 0.001, "lamb": 1.0}  # LARS paper's eta; LAMB paper's ratio as it is


def build_optimizer(
    model: nn.Module,
    name: str,
    lr: float | None,
    momentum: float,
    nesterov: bool,
    weight_decay: float,
    trust_coefficient: float | None = None,
    parallel: Parallel = None,
) -> torch.optim.Optimizer:
    """``--optimizer NAME`` over ``model``'s parameters; ``parallel``: the process group over
    which LARS/LAMB compute their trust ratios by the parallel tensor operator (``--pto``)."""
    groups = layerwise_param_groups(model, weight_decay)
    rate = lr if lr is not None else DEFAULT_LR[name]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=rate, momentum=momentum, nesterov=nesterov)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=rate)
    trust = trust_coefficient if trust_coefficient is not None else DEFAULT_TRUST[name]
    if name == "lars":
        return LARS(groups, lr=rate, momentum=momentum, nesterov=nesterov, trust_coefficient=trust,
                    parallel=parallel)  # fmt: skip
    if name == "lamb":
        return LAMB(groups, lr=rate, trust_coefficient=trust, parallel=parallel)
    raise ValueError(f"--optimizer must be one of {', '.join(DEFAULT_LR)}, got {name!r}")


def lr_factor(
    schedule: str, warmup_steps: int, total_steps: int, power: float = 2.0
) -> Callable[[int], float]:
    """The multiplier of the peak learning rate at optimizer step ``s`` (0-based); ``poly``:
    ``(1 - progress) ** power`` after the warm-up (MLPerf's large-batch schedule uses power 2)."""
    total = max(total_steps, 1)

    def factor(s: int) -> float:
        if s < warmup_steps:
            return 0.1 + 0.9 * s / warmup_steps
        if schedule == "constant":
            return 1.0
        frac = (s - warmup_steps) / max(total - warmup_steps, 1)
        if schedule == "step":
            return 0.01 if frac >= 0.75 else 0.1 if frac >= 0.5 else 1.0
        if schedule == "poly":
            return (1.0 - min(frac, 1.0)) ** power
        return 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    schedule: str,
    warmup_steps: int,
    total_steps: int,
    power: float = 2.0,
    batch_factor: Callable[[int], float] | None = None,
) -> torch.optim.lr_scheduler.LambdaLR:
    """The learning-rate schedule, times ``batch_factor(step)`` where given (the learning rate of
    a step's batch over the optimizer's own, when the batch changes with ``--resize-batch``)."""
    factor = lr_factor(schedule, warmup_steps, total_steps, power)
    if batch_factor is None:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    scaled = batch_factor
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: factor(s) * scaled(s))
