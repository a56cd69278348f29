"""1-bit Adam (Tang et al. 2021): Adam whose communication after a warm-up is compressed momentum.

Steps ``1 .. freeze_step`` (the warm-up) are ordinary Adam/AdamW on the gradient averaged by a
plain float32 all-reduce. At the end of the warm-up the second moment ``v`` is frozen, and with it
its bias correction ``1 - b2^freeze_step``. From then on, at step ``t``, every rank::

    m = b1 * m + (1 - b1) * g_local                      (its own gradient)
    m = compressed_mean(m)                               (onebit + error feedback, both stages)
    w = w * (1 - lr * wd) - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^freeze_step)) + eps)

(elements whose frozen ``v`` is zero, and parameters no rank has a gradient for, are left out:
see :mod:`gradsync.optim.compressed_momentum`) and every rank keeps the averaged ``m`` as its
momentum, so the ranks stay in agreement (bit for bit: they decode the same payloads). With a
frozen ``v`` the update is linear in ``m``, so averaging the momentum instead of the gradient is
what Adam would do, and the error left out by the compression is carried to the next step by the
residuals.

Traffic per rank and compressed step with ``onebit`` over CaSync-PS and ``p`` ranks: about
``2 (p - 1) / p * n / 8`` bytes for ``n`` parameters (plus a 24-byte header per payload, the
sizes' exchange and a 4-byte flag per parameter tensor), 32x less than the warm-up's float32
all-reduce ``2 (p - 1) / p * 4 n``. Over a whole run of ``T`` steps the saving is
``1 / (f + (1 - f) / 32)`` for a warm-up share ``f = freeze_step / T``: keep the warm-up short
(16x needs ``f`` below about 3 %).

The model must not be synchronized by anything else (see
:mod:`gradsync.optim.compressed_momentum`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gradsync.collectives import Topology
from gradsync.optim.compressed_momentum import DEFAULT_CODEC, CompressedMomentumOptimizer


class OneBitAdam(CompressedMomentumOptimizer):
    """1-bit Adam / AdamW (see the module for the update).

    Args:
        params: parameters or param groups (``lr`` and ``weight_decay`` may differ per group).
        lr: learning rate (>= 0).
        betas: decay of the first and second moment, each in [0, 1).
        eps: added to the root of the second moment (>= 0).
        weight_decay: decoupled weight decay, as :class:`torch.optim.AdamW` (>= 0; 0 is Adam
            without L2).
        freeze_step: dense warm-up steps before ``v`` freezes (an integer >= 1).
        codec: the momentum's codec spec (``onebit`` by default; ``none`` is lossless).
        strategy: the compressed all-reduce's strategy (``ps``: two stages with error feedback on
            both sides; ``ring``, ``allgather``).
        topology: the ranks (default: the current process group, torchrun's layout).
        precondition: exchange ``m / (sqrt(v) + eps)`` instead of ``m`` (the same mean; off by default, see
            :mod:`gradsync.optim.compressed_momentum`).
    """

    kind = "onebit-adam"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 100,
        codec: str = DEFAULT_CODEC,
        strategy: str = "ps",
        topology: Topology | None = None,
        precondition: bool = False,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, freeze_step, codec, strategy, topology, precondition
        )

    def _update(self, t: int, g: torch.Tensor, x: torch.Tensor, here: torch.Tensor) -> None:
        if t <= self.freeze_step:
            present = self._dense_moments(t, g, here)
            denom = self._denominator(t)
        else:
            present = self._present_now(here)
            denom = self._frozen_denominator()
            self._compressed_momentum(g, denom, present, self._mask)
        self._adamw_update(t, x, self.exp_avg, denom, present)
