"""LARS: layer-wise adaptive rate scaling (You et al. 2017; Eq. 11 of the MSTopK paper, Eq. 1 of
the ImageNet-in-four-minutes paper).

Per layer (one parameter tensor) ``w`` with gradient ``g``, weight decay ``wd``, coefficient ``c``::

    ratio = c * |w| / (|g| + wd * |w| + eps)     (1 where |w| or |g| is 0)
    v = m * v + lr * ratio * (g + wd * w)
    w = w - v                                   (Nesterov: w - (m * v + lr * ratio * (g + wd * w)))

(computed without materializing ``g + wd * w``: a step allocates nothing for float32 parameters).

The learning rate sits inside the momentum, as in the LARS paper and MLPerf's reference: a
schedule's change of ``lr`` reaches the step gradually. With ``trust_clip`` (LARC's clipping,
as NVIDIA apex's ``LARC(clip=True)`` does it) the trust ratio is itself a learning rate capped
at the global one: a layer's rate is ``min(ratio, lr)`` instead of ``lr * ratio``.

Norms and ratios are float32 (float64 for float64 parameters) whatever the parameter dtype, and a
16-bit parameter's momentum is a float32 buffer (ImageNet-in-four-minutes paper: LARS in FP32 under
mixed precision).

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- ImageNet-in-four-minutes paper: Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gradsync.optim.layerwise import (
    Batch,
    LayerwiseOptimizer,
    Parallel,
    Rate,
    add_scaled_,
    check_hyperparameter,
    per_layer,
)
from gradsync.optim.norms import safe_ratio


class LARS(LayerwiseOptimizer):
    """Momentum SGD with a trust ratio per layer (see the module for the update).

    Args:
        params: parameters or param groups; a group with ``adapt=False`` skips the trust ratio
            (biases and normalization parameters: use
            :func:`~gradsync.optim.layerwise_param_groups`).
        lr: the global learning rate.
        momentum, nesterov: heavy-ball momentum, optionally Nesterov's form.
        weight_decay: L2 coefficient, added to the gradient and to the ratio's denominator.
        trust_coefficient: ``c``, LARS's eta (0.001 in the LARS paper).
        eps: keeps the ratio finite when ``|g| + wd |w|`` is tiny.
        trust_clip: LARC's clipping: the layer's rate is ``min(ratio, lr)`` (see the module).
        parallel: compute the trust ratios with the parallel tensor operator over this process
            group (True: the world); the result equals the local one.
    """

    _float32_state = ("momentum_buffer",)

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 0.1,
        momentum: float = 0.9,
        nesterov: bool = False,
        weight_decay: float = 0.0,
        trust_coefficient: float = 0.001,
        eps: float = 1e-8,
        trust_clip: bool = False,
        parallel: Parallel = None,
    ) -> None:
        check_hyperparameter("momentum", momentum, 0.0, 1.0)
        check_hyperparameter("eps", eps, 0.0)
        if nesterov and momentum == 0:
            raise ValueError("nesterov=True needs a momentum above 0")
        defaults = dict(
            lr=lr, momentum=momentum, nesterov=bool(nesterov), weight_decay=weight_decay,
            trust_coefficient=trust_coefficient, eps=eps, trust_clip=bool(trust_clip),
        )  # fmt: skip
        super().__init__(params, defaults, parallel)

    def _direction(self, batch: Batch, work: list[torch.Tensor]) -> list[torch.Tensor]:
        # the gradient itself (never written to): the weight decay is folded into the update
        # below, so a step allocates nothing (on the CPU a fresh buffer per step costs page faults)
        return batch.work_grads()

    def _norm_inputs(
        self, batch: Batch, work: list[torch.Tensor], direction: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return work, direction  # |w| and the raw |g| (float32 copies of 16-bit ones: exact)

    def _trust(
        self, w_norm: torch.Tensor, x_norm: torch.Tensor, groups: list[dict[str, Any]]
    ) -> torch.Tensor:
        hyper = torch.tensor(
            [[g["trust_coefficient"], g["weight_decay"], g["eps"], g["lr"] if g["trust_clip"] else 0.0]
             for g in groups],
            dtype=w_norm.dtype,
        ).to(w_norm.device, non_blocking=True)  # fmt: skip
        coef, wd, eps, clip_lr = hyper.unbind(1)
        ratio = safe_ratio(coef * w_norm, x_norm + wd * w_norm + eps, (w_norm > 0) & (x_norm > 0))
        clipped = clip_lr > 0  # ratio / lr capped at 1: the layer's rate is min(lr * ratio, lr)
        return torch.where(clipped, torch.clamp(safe_ratio(ratio, clip_lr, clipped), max=1.0), ratio)

    def _apply(
        self, batch: Batch, work: list[torch.Tensor], direction: list[torch.Tensor], rate: Rate
    ) -> None:
        """``d = g + wd w`` is never materialized: with ``r = lr * ratio``,
        ``v = m v + r g + r wd w`` and ``w - r d = w (1 - r wd) - r g``."""
        wd, m = batch.group["weight_decay"], batch.group["momentum"]
        grads, r = direction, per_layer(rate)

        def descend() -> None:  # w -= r d, as w (1 - r wd) - r g
            if wd:
                torch._foreach_mul_(work, per_layer(rate, -wd, 1.0))
            add_scaled_(work, grads, r, -1.0)

        if not m:
            descend()
            return
        states = [self.state[p] for p in batch.params]
        for s, g in zip(states, grads, strict=True):
            if "momentum_buffer" not in s:  # v starts at 0: the first step's v is r d
                s["momentum_buffer"] = torch.zeros_like(g)
        bufs = [s["momentum_buffer"] for s in states]
        torch._foreach_mul_(bufs, m)
        add_scaled_(bufs, grads, r)
        if wd:
            add_scaled_(bufs, work, per_layer(rate, wd))
        if batch.group["nesterov"]:  # w -= r d + m v
            descend()
            torch._foreach_add_(work, bufs, alpha=-m)
        else:
            torch._foreach_sub_(work, bufs)
