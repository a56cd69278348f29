"""1-bit LAMB (Li et al. 2021, arXiv 2104.06069): LAMB whose momentum is exchanged compressed
after a warm-up, with the trust ratios frozen at the end of the warm-up and rescaled by how far
a fresh variance estimate has moved from the frozen one.

**Warm-up** (steps ``1 .. freeze_step``): LAMB on the gradient averaged by a plain float32
all-reduce. Per layer (parameter tensor) ``w`` of a group with ``adapt`` (default True)::

    u = (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + wd * w
    r = |w| / |u|            (1 where either norm is 0; groups with adapt=False: 1)
    w = w - lr * r * u

and each layer keeps a running mean ``R`` of its trust ratio ``r`` (decay ``b1``, bias-corrected).
At the end of the warm-up three things are fixed: ``v`` (as in 1-bit Adam), the layers' trust
ratios ``R``, and a momentum scale per layer, ``s = mean_k rms(m_k) / rms(m)`` (the mean over
the layers of their momentum's root mean square, over this layer's): the momentum travels
multiplied by ``s``, so that the onebit codec's one magnitude per sign and partition meets
layers of comparable size (divided again on arrival). A fresh variance ``v'`` starts as a copy
of ``v``.

**Compression stage** (every later step), per layer::

    m  = b1 * m + (1 - b1) * g_local;  m = compressed_mean(m * s) / s     (error feedback)
    g~ = (m - b1 * m_previous) / (1 - b1)     the averaged gradient this momentum implies
    v' = b2 * v' + (1 - b2) * g~^2             the fresh variance (v stays frozen)
    d  = sqrt(v / (1 - b2^freeze_step)) + eps;  d' = sqrt(v' / (1 - b2^t)) + eps
    u0 = (m / (1 - b1^t)) / d;  u = u0 + wd * w
    f  = max over the layer's elements of d / d'
    f  = q * f + (1 - q),  q = min(1, |u0| / |u|)       (only with weight decay)
    f  = clip(f, lower, upper), then within (1 -+ ratio_change) of the layer's previous f
    w  = w - lr * R * f * u

``f`` says how much the frozen denominator overstates the current one: where the gradients have
shrunk since the warm-up (``v'`` below ``v``) the frozen-variance step is too short, and the
layer's frozen trust ratio is raised to make up for it. The weight-decay blend applies ``f`` to
the share of the update that comes from the moments only; ``ratio_bounds = (lower, upper)`` and
``ratio_change`` keep one noisy estimate (the reconstructed gradient carries the compression's
error) from moving the ratio far. Everything here is computed from the averaged momentum and
agreed values, so every rank gets the same ratios and parameters.

The frozen ratios are only as good as the warm-up they come from: the paper warms up for long.
On the benchmark's Transformer LM a warm-up of 3 % of the run froze ratios of a model that had
barely started, and the run stalled (+117 % perplexity against dense AdamW); with 10 % it ended
6 % below dense AdamW, at 7.9x less traffic instead of 16.7x (docs/optimizers.md, "Measured").
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from gradsync.collectives import Topology
from gradsync.optim.compressed_momentum import DEFAULT_CODEC, CompressedMomentumOptimizer, check_number


class OneBitLamb(CompressedMomentumOptimizer):
    """1-bit LAMB (see the module).

    Args: as :class:`~gradsync.optim.OneBitAdam`, and
        ratio_bounds: ``(lower, upper)`` bounds of the fresh-variance factor ``f`` that scales
            each layer's frozen trust ratio, ``0 < lower <= 1 <= upper``.
        ratio_change: the most ``f`` may change from one step to the next, as a fraction of its
            previous value (>= 0; 0 keeps ``f = 1``, the frozen ratios as they are).
    """

    kind = "onebit-lamb"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.0,
        freeze_step: int = 100,
        ratio_bounds: tuple[float, float] = (0.5, 4.0),
        ratio_change: float = 0.1,
        codec: str = DEFAULT_CODEC,
        strategy: str = "ps",
        topology: Topology | None = None,
        precondition: bool = False,
    ) -> None:
        if not isinstance(ratio_bounds, (tuple, list)) or len(ratio_bounds) != 2:
            raise ValueError(f"ratio_bounds must be a pair (lower, upper), got {ratio_bounds!r}")
        lower = check_number("ratio_bounds[0]", ratio_bounds[0], 0.0, 1.0, high_open=False)
        upper = check_number("ratio_bounds[1]", ratio_bounds[1], 1.0)
        if lower == 0.0:
            raise ValueError(f"ratio_bounds[0] must be > 0 and <= 1, got {ratio_bounds[0]!r}")
        self.ratio_bounds = (lower, upper)
        self.ratio_change = check_number("ratio_change", ratio_change, 0.0)
        super().__init__(
            params, lr, betas, eps, weight_decay, freeze_step, codec, strategy, topology, precondition
        )

    def _build_state(self) -> None:
        super()._build_state()
        layers, dev = len(self.flat.params), self.flat.device
        self.adapt = torch.tensor(
            [bool(g.get("adapt", True)) for g in self.param_groups for _ in g["params"]], device=dev
        )
        self.ratio_mean = torch.zeros(layers, dtype=torch.float32, device=dev)
        """Running mean of each layer's trust ratio over the warm-up (not bias-corrected)."""
        self.momentum_scale = torch.ones(layers, dtype=torch.float32, device=dev)
        """Each layer's momentum scale ``s`` in the exchange (set at the freeze step)."""
        self.last_factor = torch.ones(layers, dtype=torch.float32, device=dev)
        """Each layer's fresh-variance factor ``f`` of its last step."""
        self.exp_avg_sq_fresh = self.flat.zeros()
        """The fresh variance ``v'`` (a copy of ``v`` at the freeze step, then updated)."""
        self.last_ratio = torch.ones(layers, dtype=torch.float32, device=dev)
        """The trust ratios of the last step (telemetry)."""
        self._u = self.flat.zeros()
        self._prev = self.flat.zeros()
        self._work = self.flat.zeros()

    def _config(self) -> dict[str, Any]:
        return {**super()._config(), "ratio_bounds": self.ratio_bounds, "ratio_change": self.ratio_change}

    def _update(self, t: int, g: torch.Tensor, x: torch.Tensor, here: torch.Tensor) -> None:
        b1 = self.defaults["betas"][0]
        warm = t <= self.freeze_step
        if warm:
            present = self._dense_moments(t, g, here)
            denom = self._denominator(t)
        else:
            present = self._present_now(here)
            denom = self._frozen_denominator()
            self._prev.copy_(self.exp_avg)
            self._local_momentum(g, present, self._mask)
            self._compressed_mean(
                self.exp_avg, denom, "momentum", self._element_mask(present, self._mask),
                scale=self.flat.expand(self.momentum_scale),
            )  # fmt: skip
            self._fresh_variance(present)
        layers = torch.ones(len(self.flat.params), dtype=torch.bool, device=self.flat.device)
        if present is not None:
            layers = present
        c1 = 1.0 - b1**t
        u = self._u
        torch.div(self.exp_avg, denom, out=u).div_(c1)
        u0_norm = self.flat.norms(u)
        for group, seg in zip(self.param_groups, self.flat.segments, strict=True):
            if group["weight_decay"]:
                u[seg].add_(x[seg], alpha=group["weight_decay"])
        u_norm = self.flat.norms(u)
        if warm:
            w_norm = self.flat.norms(x)
            valid = (w_norm > 0) & (u_norm > 0)
            ratio = torch.where(valid, w_norm / torch.where(valid, u_norm, 1.0), 1.0)
            # a layer no rank had a gradient for keeps its mean (it took no step)
            self.ratio_mean.copy_(torch.where(layers, self.ratio_mean.lerp(ratio, 1.0 - b1), self.ratio_mean))
            if t == self.freeze_step:
                self._freeze()
        else:
            frozen = self.ratio_mean / (1.0 - b1**self.freeze_step)
            ratio = frozen * self._factor(t, denom, u0_norm, u_norm, layers)
        ratio = torch.where(self.adapt, ratio, 1.0)
        self.last_ratio.copy_(ratio)
        rates = ratio.tolist()
        lrs = self._layer_lrs()
        for i, s in self._slices_of(present):
            x[s].add_(u[s], alpha=-lrs[i] * rates[i])

    def _freeze(self) -> None:
        """End of the warm-up: the fresh variance starts from ``v``; the momentum scales."""
        self.exp_avg_sq_fresh.copy_(self.exp_avg_sq)
        sizes = torch.tensor([max(p.numel(), 1) for p in self.flat.params], dtype=torch.float32)
        rms = self.flat.norms(self.exp_avg).cpu() / sizes.sqrt()
        used = rms > 0
        if bool(used.any()):
            mean = rms[used].mean()
            scale = torch.where(used, mean / torch.where(used, rms, 1.0), 1.0)
        else:
            scale = torch.ones_like(rms)
        self.momentum_scale.copy_(scale.to(self.momentum_scale.device))

    def _fresh_variance(self, present: torch.Tensor | None) -> None:
        """``v' = b2 v' + (1 - b2) g~^2`` with ``g~`` the gradient the averaged momentum implies,
        for the parameters some rank had a gradient for (the others' momentum did not move)."""
        b1, b2 = self.defaults["betas"]
        g = torch.mul(self._prev, b1, out=self._work)
        torch.sub(self.exp_avg, g, out=g).div_(1.0 - b1)
        for _, s in self._slices_of(present):
            self.exp_avg_sq_fresh[s].mul_(b2).addcmul_(g[s], g[s], value=1.0 - b2)

    def _factor(
        self, t: int, denom: torch.Tensor, u0_norm: torch.Tensor, u_norm: torch.Tensor, layers: torch.Tensor
    ) -> torch.Tensor:
        """Each layer's fresh-variance factor ``f`` (see the module), kept for the next step."""
        b2 = self.defaults["betas"][1]
        fresh = torch.sqrt(self.exp_avg_sq_fresh, out=self._work)
        fresh.div_(math.sqrt(1.0 - b2**t)).add_(self.defaults["eps"])
        torch.div(denom, fresh, out=fresh)  # d / d', elementwise
        factor = torch.stack(
            [fresh[s].amax() if s.stop > s.start else fresh.new_ones(()) for s in self.flat.slices]
        )
        decayed = torch.tensor(
            [self.param_groups[i]["weight_decay"] > 0 for i in self.flat.group_of], device=factor.device
        )
        share = torch.where(u_norm > 0, u0_norm / torch.where(u_norm > 0, u_norm, 1.0), 1.0).clamp(max=1.0)
        factor = torch.where(decayed, factor * share + (1.0 - share), factor)
        lower, upper = self.ratio_bounds
        factor = factor.clamp(lower, upper)
        last, c = self.last_factor, self.ratio_change
        factor = torch.minimum(torch.maximum(factor, last * (1.0 - c)), last * (1.0 + c))
        self.last_factor.copy_(torch.where(layers, factor, last))
        return factor

    def _layer_lrs(self) -> list[float]:
        return [g["lr"] for g in self.param_groups for _ in g["params"]]

    def _extra_state(self) -> dict[str, Any]:
        return {
            "ratio_mean": self.ratio_mean.clone(),
            "momentum_scale": self.momentum_scale.clone(),
            "last_factor": self.last_factor.clone(),
            "exp_avg_sq_fresh": self.exp_avg_sq_fresh.clone(),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        dev = self.flat.device
        for name in ("ratio_mean", "momentum_scale", "last_factor", "exp_avg_sq_fresh"):
            getattr(self, name).copy_(state[name].to(dev))
