"""Optimizer and learning-rate schedule for ``gradsync train``.

Weight decay applies to weight matrices, embeddings and convolution kernels only: biases and
normalization parameters are left undecayed, as the ImageNet-in-four-minutes paper does, and out of
LARS's and LAMB's trust ratios (:func:`gradsync.optim.layerwise_param_groups`).
The schedule is per optimizer step: a linear warm-up from lr/10, then cosine to zero, a step
decay (x0.1 at 50 % and 75 % of the run) or a constant rate.

References:

- ImageNet-in-four-minutes paper: Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradsync.collectives import Topology
from gradsync.optim import LAMB, LARS, OneBitAdam, OneBitLamb, ZeroOneAdam, layerwise_param_groups
from gradsync.optim.layerwise import Parallel

DEFAULT_LR = {
    "sgd": 0.1, "adamw": 0.002, "lars": 2.0, "lamb": 0.005,
    "onebit-adam": 0.002, "zeroone-adam": 0.002, "onebit-lamb": 0.005,
}  # fmt: skip
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
    compressed: dict[str, Any] | None = None,
    topology: Topology | None = None,
) -> torch.optim.Optimizer:
    """``--optimizer NAME`` over ``model``'s parameters; ``parallel``: the process group over
    which LARS/LAMB compute their trust ratios by the parallel tensor operator (``--pto``).
    ``compressed``: the options of onebit-adam, zeroone-adam and onebit-lamb
    (:func:`compressed_options`), which synchronize over ``topology`` themselves."""
    groups = layerwise_param_groups(model, weight_decay)
    rate = lr if lr is not None else DEFAULT_LR[name]
    if name == "sgd":
        return torch.optim.SGD(groups, lr=rate, momentum=momentum, nesterov=nesterov)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=rate)
    if name in SELF_SYNCING_CLASSES:  # decoupled weight decay on the weights, as adamw
        return SELF_SYNCING_CLASSES[name](groups, lr=rate, topology=topology, **(compressed or {}))
    trust = trust_coefficient if trust_coefficient is not None else DEFAULT_TRUST[name]
    if name == "lars":
        return LARS(groups, lr=rate, momentum=momentum, nesterov=nesterov, trust_coefficient=trust,
                    parallel=parallel)  # fmt: skip
    if name == "lamb":
        return LAMB(groups, lr=rate, trust_coefficient=trust, parallel=parallel)
    raise ValueError(f"--optimizer must be one of {', '.join(DEFAULT_LR)}, got {name!r}")


ZEROONE_DEFAULTS = {"freeze_step": 0.02, "var_freeze_step": 0.60, "sync_growth": 0.065}
ONEBIT_DEFAULTS = {"freeze_step": 0.03}
LAMB_DEFAULTS = {"freeze_step": 0.10}
"""zeroone-adam's defaults, as shares of the run's steps."""

SELF_SYNCING_CLASSES: dict[str, Any] = {
    "onebit-adam": OneBitAdam,
    "zeroone-adam": ZeroOneAdam,
    "onebit-lamb": OneBitLamb,
}


def compressed_options(args: argparse.Namespace, total_steps: int) -> dict[str, Any]:
    """The constructor options of ``--optimizer onebit-adam|zeroone-adam|onebit-lamb``, the
    defaults as fractions of the run's ``total_steps``: a dense warm-up of 3 % for onebit-adam
    (what a 16x saving over the whole run allows: 1 / (0.03 + 0.97 / 32) is 16.6); 10 % for
    onebit-lamb, whose trust ratios freeze at the end of the warm-up and need a model that has
    started training (docs/optimizers.md: +117 % perplexity after a 3 % warm-up, 6.4 % below
    AdamW after a 10 % one, at 7.9x); for zeroone-adam ZEROONE_DEFAULTS (docs/benchmarks.md,
    the Transformer LM with the Adam family)."""
    share = {"zeroone-adam": ZEROONE_DEFAULTS, "onebit-lamb": LAMB_DEFAULTS}.get(
        args.optimizer, ONEBIT_DEFAULTS
    )

    def given(value: int | None, name: str, least: int = 1) -> int:
        return value if value is not None else max(least, round(share[name] * total_steps))

    freeze = given(args.freeze_step, "freeze_step")
    out: dict[str, Any] = {"freeze_step": freeze, "codec": args.momentum_codec}
    if args.optimizer == "zeroone-adam":
        out["var_freeze_step"] = given(args.var_freeze_step, "var_freeze_step", freeze)
        out["sync_growth"] = given(args.sync_growth, "sync_growth")
        out["max_sync_interval"] = args.max_sync_interval
    return out


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
