"""LAMB: Adam's direction with a trust ratio per layer (You et al. 2020, "Large batch optimization
for deep learning: training BERT in 76 minutes"; the MSTopK paper applies PTO to it as to LARS).

Per layer ``w`` with gradient ``g`` at step ``t``::

    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w      (no bias correction: m, v)
    ratio = c * |w| / |u|                                              (1 where |w| or |u| is 0)
    w = w - lr * ratio * u

``max_trust_ratio`` caps the ratio (the paper's clipping function phi, upper bound only); the
fallback 1 of a zero norm is not capped.
Moments, norms and ratios are float32 for bf16 and fp16 parameters. Besides the two moments, the
optimizer keeps two work buffers per parameter (the denominator and ``u``) from step to step, so
that a step allocates nothing.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from __future__ import annotations

import math
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
    work_dtype,
)
from gradsync.optim.norms import safe_ratio


class LAMB(LayerwiseOptimizer):
    """Layer-wise adaptive moments (see the module for the update).

    Args:
        params: parameters or param groups (``adapt=False``: trust ratio 1, i.e. AdamW).
        lr: the global learning rate.
        betas: decay of the first and second moment.
        eps: added to the second moment's root.
        weight_decay: decoupled, added to the Adam direction before the trust ratio.
        trust_coefficient: ``c`` (1 in the LAMB paper).
        max_trust_ratio: cap of the ratio, or None for none.
        bias_correction: divide the moments by ``1 - beta^t``.
        parallel: trust ratios through the parallel tensor operator (see :class:`LARS`).
    """

    _float32_state = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        trust_coefficient: float = 1.0,
        max_trust_ratio: float | None = None,
        bias_correction: bool = True,
        parallel: Parallel = None,
    ) -> None:
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        check_hyperparameter("betas[0]", betas[0], 0.0, 1.0)
        check_hyperparameter("betas[1]", betas[1], 0.0, 1.0)
        check_hyperparameter("eps", eps, 0.0)
        if max_trust_ratio is not None:
            check_hyperparameter("max_trust_ratio", max_trust_ratio, 0.0, low_open=True)
        defaults = dict(
            lr=lr, betas=(float(betas[0]), float(betas[1])), eps=eps, weight_decay=weight_decay,
            trust_coefficient=trust_coefficient, max_trust_ratio=max_trust_ratio,
            bias_correction=bool(bias_correction),
        )  # fmt: skip
        super().__init__(params, defaults, parallel)

    def _direction(self, batch: Batch, work: list[torch.Tensor]) -> list[torch.Tensor]:
        group = batch.group
        b1, b2 = group["betas"]
        grads = batch.work_grads()
        states = [self.state[p] for p in batch.params]
        for s, g in zip(states, grads, strict=True):
            if "step" not in s:
                s["step"] = torch.tensor(0.0)  # on the host, as torch's Adam keeps it
                s["exp_avg"] = torch.zeros_like(g)
                s["exp_avg_sq"] = torch.zeros_like(g)
        steps = [s["step"] for s in states]
        m = [s["exp_avg"] for s in states]
        v = [s["exp_avg_sq"] for s in states]
        torch._foreach_add_(steps, 1.0)
        torch._foreach_lerp_(m, grads, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, grads, grads, value=1.0 - b2)
        # u = wd w + (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps), written as
        # u = wd w + c m / (sqrt(v) + eps'), c = sqrt(1 - b2^t) / (1 - b1^t), eps' = eps sqrt(1 - b2^t),
        # into two buffers kept from step to step (a fresh one per step costs page faults on the CPU)
        corrected = group["bias_correction"]
        t = [float(s.item()) for s in steps] if corrected else []  # host tensors: no device sync
        root2 = [math.sqrt(1.0 - b2**k) for k in t] if corrected else [1.0] * len(m)
        scale = [r / (1.0 - b1**k) for r, k in zip(root2, t, strict=True)] if corrected else root2
        dtype = work_dtype(batch.params[0].dtype)
        denom = self.workspace(batch.params, "denominator", dtype)
        direction = self.workspace(batch.params, "update", dtype)
        torch._foreach_copy_(denom, v)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, [group["eps"] * r for r in root2])
        wd = group["weight_decay"]
        if wd:
            torch._foreach_copy_(direction, work)
            torch._foreach_mul_(direction, wd)
        else:
            torch._foreach_zero_(direction)
        torch._foreach_addcdiv_(direction, m, denom, scale)
        return direction

    def _norm_inputs(
        self, batch: Batch, work: list[torch.Tensor], direction: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return work, direction

    def _trust(
        self, w_norm: torch.Tensor, x_norm: torch.Tensor, groups: list[dict[str, Any]]
    ) -> torch.Tensor:
        inf = math.inf
        hyper = torch.tensor(
            [
                [g["trust_coefficient"], inf if g["max_trust_ratio"] is None else g["max_trust_ratio"]]
                for g in groups
            ],
            dtype=w_norm.dtype,
        ).to(w_norm.device, non_blocking=True)
        coef, cap = hyper.unbind(1)
        valid = (w_norm > 0) & (x_norm > 0)
        ratio = safe_ratio(coef * w_norm, x_norm, valid)
        return torch.where(valid, torch.minimum(ratio, cap), ratio)  # the fallback 1 is not capped

    def _apply(
        self, batch: Batch, work: list[torch.Tensor], direction: list[torch.Tensor],
        rate: Rate,
    ) -> None:  # fmt: skip
        add_scaled_(work, direction, per_layer(rate), -1.0)  # w -= lr ratio u
