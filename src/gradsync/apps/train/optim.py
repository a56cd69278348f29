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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from gradsync.collectives import Topology
from gradsync.optim import LAMB, LARS, OneBitAdam, OneBitLamb, ZeroOneAdam, layerwise_param_groups
from gradsync.optim.layerwise import Parallel


@dataclass(frozen=True)
class OptimizerOptions:
    """What ``gradsync train`` hands an optimizer's builder besides its parameter groups."""

    momentum: float = 0.0
    nesterov: bool = False
    trust_coefficient: float | None = None
    parallel: Parallel = None
    compressed: dict[str, Any] | None = None
    topology: Topology | None = None


@dataclass(frozen=True)
class OptimizerKind:
    """One ``--optimizer`` choice: its default peak learning rate, how to build it, and what it
    takes. ``momentum``: it takes ``--momentum`` and ``--nesterov``. ``trust``: a layer-wise
    optimizer's default trust coefficient (it takes ``--trust-coefficient`` and ``--pto``); None
    for the others. ``warmup``: an optimizer that synchronizes the model itself (compressed
    momentum, so gradsync's own synchronization is off) and its default warm-up options, as
    shares of the run's steps; None for the others."""

    name: str
    lr: float
    build: Callable[[list[dict[str, Any]], float, OptimizerOptions], torch.optim.Optimizer]
    momentum: bool = False
    trust: float | None = None
    warmup: dict[str, float] | None = None

    @property
    def layerwise(self) -> bool:
        return self.trust is not None

    @property
    def self_syncing(self) -> bool:
        return self.warmup is not None


_KINDS: dict[str, OptimizerKind] = {}


def register_optimizer(kind: OptimizerKind) -> OptimizerKind:
    """Make ``kind`` a ``--optimizer`` choice (a name can be registered once) and return it."""
    if not kind.name or kind.name in _KINDS:
        raise ValueError(f"optimizer name must be new and non-empty, got {kind.name!r}")
    _KINDS[kind.name] = kind
    return kind


def optimizer_kind(name: str) -> OptimizerKind:
    """The registered ``--optimizer`` choice ``name``; ``ValueError`` naming them all."""
    try:
        return _KINDS[name]
    except (KeyError, TypeError):
        raise ValueError(f"--optimizer must be one of {', '.join(_KINDS)}, got {name!r}") from None


def optimizer_names() -> tuple[str, ...]:
    """Every ``--optimizer`` choice, in registration order."""
    return tuple(_KINDS)


def build_optimizer(
    model: nn.Module, name: str, lr: float | None, weight_decay: float, options: OptimizerOptions
) -> torch.optim.Optimizer:
    """``--optimizer NAME`` over ``model``'s parameters, with weight decay on the weights only
    (:func:`gradsync.optim.layerwise_param_groups`) and the kind's default rate when ``lr`` is
    None. ``options.parallel``: the process group over which LARS/LAMB compute their trust ratios
    by the parallel tensor operator (``--pto``); ``options.compressed``: the options of an
    optimizer that synchronizes itself over ``options.topology`` (:func:`compressed_options`)."""
    kind = optimizer_kind(name)
    return kind.build(layerwise_param_groups(model, weight_decay), lr if lr is not None else kind.lr, options)


def _trust(kind: str, o: OptimizerOptions) -> float:
    return o.trust_coefficient if o.trust_coefficient is not None else DEFAULT_TRUST[kind]


def _self_syncing(
    cls: Any,
) -> Callable[[list[dict[str, Any]], float, OptimizerOptions], torch.optim.Optimizer]:
    """Decoupled weight decay on the weights, as adamw; the exchange over ``options.topology``."""

    def build(groups: list[dict[str, Any]], lr: float, o: OptimizerOptions) -> torch.optim.Optimizer:
        return cls(groups, lr=lr, topology=o.topology, **(o.compressed or {}))

    return build


DEFAULT_TRUST = {"lars": 0.001, "lamb": 1.0}  # LARS paper's eta; LAMB paper's ratio as it is
ZEROONE_DEFAULTS = {"freeze_step": 0.02, "var_freeze_step": 0.60, "sync_growth": 0.065}
"""zeroone-adam's defaults, as shares of the run's steps."""
ONEBIT_DEFAULTS = {"freeze_step": 0.03}
LAMB_DEFAULTS = {"freeze_step": 0.10}

# fmt: off
register_optimizer(OptimizerKind(
    "sgd", 0.1, lambda g, lr, o: torch.optim.SGD(g, lr=lr, momentum=o.momentum, nesterov=o.nesterov),
    momentum=True,
))
register_optimizer(OptimizerKind("adamw", 0.002, lambda g, lr, o: torch.optim.AdamW(g, lr=lr)))
register_optimizer(OptimizerKind(
    "lars", 2.0,
    lambda g, lr, o: LARS(g, lr=lr, momentum=o.momentum, nesterov=o.nesterov,
                          trust_coefficient=_trust("lars", o), parallel=o.parallel),
    momentum=True, trust=DEFAULT_TRUST["lars"],
))
register_optimizer(OptimizerKind(
    "lamb", 0.005, lambda g, lr, o: LAMB(g, lr=lr, trust_coefficient=_trust("lamb", o), parallel=o.parallel),
    trust=DEFAULT_TRUST["lamb"],
))
register_optimizer(OptimizerKind("onebit-adam", 0.002, _self_syncing(OneBitAdam), warmup=ONEBIT_DEFAULTS))
register_optimizer(OptimizerKind("zeroone-adam", 0.002, _self_syncing(ZeroOneAdam), warmup=ZEROONE_DEFAULTS))
register_optimizer(OptimizerKind("onebit-lamb", 0.005, _self_syncing(OneBitLamb), warmup=LAMB_DEFAULTS))
# fmt: on


def compressed_options(args: argparse.Namespace, total_steps: int) -> dict[str, Any]:
    """The constructor options of ``--optimizer onebit-adam|zeroone-adam|onebit-lamb``, the
    defaults as fractions of the run's ``total_steps``: a dense warm-up of 3 % for onebit-adam
    (what a 16x saving over the whole run allows: 1 / (0.03 + 0.97 / 32) is 16.6); 10 % for
    onebit-lamb, whose trust ratios freeze at the end of the warm-up and need a model that has
    started training (docs/optimizers.md: +117 % perplexity after a 3 % warm-up, 6.4 % below
    AdamW after a 10 % one, at 7.9x); for zeroone-adam ZEROONE_DEFAULTS (docs/benchmarks.md,
    the Transformer LM with the Adam family)."""
    share = optimizer_kind(args.optimizer).warmup or ONEBIT_DEFAULTS

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
