"""Optimizer and learning-rate schedule for ``gradsync train``.

Weight decay applies to weight matrices and convolution kernels only: biases and normalization
weights (every parameter with fewer than two dimensions) are left undecayed, as paper 03 does.
The schedule is per optimizer step: a linear warm-up from lr/10, then cosine to zero, a step
decay (x0.1 at 50 % and 75 % of the run) or a constant rate.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

DEFAULT_LR = {"sgd": 0.1, "adamw": 0.002}


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, object]]:
    decay: list[nn.Parameter] = []
    plain: list[nn.Parameter] = []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else plain).append(p)
    groups: list[dict[str, object]] = [{"params": decay, "weight_decay": weight_decay}]
    if plain:
        groups.append({"params": plain, "weight_decay": 0.0})
    return groups


def build_optimizer(
    model: nn.Module, name: str, lr: float | None, momentum: float, nesterov: bool, weight_decay: float
) -> torch.optim.Optimizer:
    groups = param_groups(model, weight_decay)
    rate = lr if lr is not None else DEFAULT_LR[name]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=rate, momentum=momentum, nesterov=nesterov)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=rate)
    raise ValueError(f"--optimizer must be one of {', '.join(DEFAULT_LR)}, got {name!r}")


def lr_factor(schedule: str, warmup_steps: int, total_steps: int) -> Callable[[int], float]:
    """The multiplier of the peak learning rate at optimizer step ``s`` (0-based)."""
    total = max(total_steps, 1)

    def factor(s: int) -> float:
        if s < warmup_steps:
            return 0.1 + 0.9 * s / warmup_steps
        if schedule == "constant":
            return 1.0
        frac = (s - warmup_steps) / max(total - warmup_steps, 1)
        if schedule == "step":
            return 0.01 if frac >= 0.75 else 0.1 if frac >= 0.5 else 1.0
        return 0.5 * (1.0 + math.cos(math.pi * min(frac, 1.0)))

    return factor


def build_scheduler(
    optimizer: torch.optim.Optimizer, schedule: str, warmup_steps: int, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(schedule, warmup_steps, total_steps))
