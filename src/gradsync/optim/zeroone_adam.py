"""0/1 Adam (Lu et al. 2022), in a simplified form: fewer variance updates and fewer exchanges.

1-bit Adam still exchanges the (compressed) momentum on every step. 0/1 Adam cuts the traffic
further in two ways, and this module does both with schedules that are plain functions of the
step number (so every rank knows them without talking):

- **Variance at growing intervals, then frozen.** After a short dense warm-up (steps
  ``1 .. freeze_step``: ordinary AdamW on the all-reduced gradient), ``v`` is updated only on
  steps ``freeze_step + 1, + 2, + 4, + 8, ...`` up to ``var_freeze_step``, each time from a dense
  float32 all-reduce of the gradient (a handful of steps: their cost is a few warm-up steps).
  A refresh ``k`` steps after the previous one moves ``v`` as Adam would have in ``k`` steps of
  that gradient, ``v = b2^k v + (1 - b2^k) g^2``, with the bias correction ``1 - b2^t``: ``v``
  forgets the (large) warm-up gradients on Adam's time scale, not after ``1 / (1 - b2)``
  refreshes. Between them, momentum is exchanged compressed on every step, as in 1-bit Adam.
- **Local steps with growing intervals.** After ``var_freeze_step`` every rank steps on its own:
  its momentum from its own gradient, its parameters from that momentum, while it accumulates
  ``u = sum(lr_k * m_k / (1 - b1^k))`` over the local steps. Every ``I`` steps the ranks
  exchange ``u`` through the compressed all-reduce (onebit with error feedback on both stages,
  its own residual streams), and every rank sets::

      w = w_anchor * prod(1 - lr_k * wd) - mean(u) / denom      (w_anchor: the last synchronized w)
      m = (1 - b1^t) * mean(u) / sum(lr_k)                     (the lr-weighted mean momentum)

  so the ranks agree again (bit for bit). The decay is per parameter, over the local steps
  it had a gradient on (a parameter without one is skipped, as AdamW skips it; the flags and
  decays travel in one small all-reduce before the exchange). ``I`` starts at 1 and doubles every
  ``sync_growth`` steps up to ``max_sync_interval``. With one local step and a lossless codec
  this is exactly AdamW with a frozen ``v``. The weight-decay factor is applied to the anchor
  only (the decay of the interval's own updates, a second-order term, is left out).

:meth:`ZeroOneAdam.synchronize` exchanges what is pending at once: call it before evaluating or
saving the model (``gradsync train`` does, at epoch ends and before checkpoints), because between
exchanges each rank holds its own parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gradsync.collectives import Topology
from gradsync.optim.compressed_momentum import DEFAULT_CODEC, CompressedMomentumOptimizer, check_steps


def sync_interval(t: int, var_freeze_step: int, sync_growth: int, max_sync_interval: int) -> int:
    """:meth:`ZeroOneAdam.sync_interval` for these schedule options: 1 until ``var_freeze_step``,
    then doubling every ``sync_growth`` steps up to ``max_sync_interval``."""
    if t <= var_freeze_step:
        return 1
    doublings = (t - var_freeze_step - 1) // sync_growth
    return min(max_sync_interval, 2 ** min(doublings, 62))


def exchange_due(
    t: int, last_sync: int, var_freeze_step: int, sync_growth: int, max_sync_interval: int
) -> bool:
    """Whether step ``t`` synchronizes the ranks: every step up to ``var_freeze_step``; after it,
    a local step exchanges once :func:`sync_interval` steps have passed since ``last_sync``."""
    interval = sync_interval(t, var_freeze_step, sync_growth, max_sync_interval)
    return t <= var_freeze_step or t - last_sync >= interval


def exchange_steps(
    first: int, last: int, var_freeze_step: int, sync_growth: int, max_sync_interval: int
) -> int:
    """How many of the steps ``first .. last`` synchronize the ranks (:func:`exchange_due`)."""
    count, last_sync = 0, 0
    for t in range(1, last + 1):
        if exchange_due(t, last_sync, var_freeze_step, sync_growth, max_sync_interval):
            last_sync = t
            count += t >= first
    return count


class ZeroOneAdam(CompressedMomentumOptimizer):
    """0/1 Adam / AdamW (see the module).

    Args: as :class:`~gradsync.optim.OneBitAdam` (``freeze_step``: the dense warm-up), and
        var_freeze_step: the last step at which ``v`` may be updated (>= ``freeze_step``).
        sync_growth: after ``var_freeze_step``, the exchange interval doubles every this many
            steps (an integer >= 1).
        max_sync_interval: the longest interval between exchanges (an integer >= 1; 1 keeps
            1-bit Adam's exchange on every step).
    """

    kind = "zeroone-adam"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        freeze_step: int = 20,
        var_freeze_step: int = 200,
        sync_growth: int = 50,
        max_sync_interval: int = 8,
        codec: str = DEFAULT_CODEC,
        strategy: str = "ps",
        topology: Topology | None = None,
        precondition: bool = False,
    ) -> None:
        check_steps("freeze_step", freeze_step, 1)
        self.var_freeze_step = check_steps("var_freeze_step", var_freeze_step, 1)
        if isinstance(freeze_step, int) and var_freeze_step < freeze_step:
            raise ValueError(f"var_freeze_step must be >= freeze_step ({freeze_step}), got {var_freeze_step}")
        self.sync_growth = check_steps("sync_growth", sync_growth, 1)
        self.max_sync_interval = check_steps("max_sync_interval", max_sync_interval, 1)
        super().__init__(
            params, lr, betas, eps, weight_decay, freeze_step, codec, strategy, topology, precondition
        )

    def _build_state(self) -> None:
        super()._build_state()
        dev = self.flat.device
        self.v_steps = 0
        self.last_sync = 0
        self.anchor = self.flat.zeros()
        self.accum = self.flat.zeros()
        self.lr_sum = [0.0] * len(self.param_groups)
        # per parameter, over the local steps since the last exchange: the product of the weight
        # decay factors of the steps it had a gradient on this rank, and how many such steps
        self.decay = torch.ones(len(self.flat.params), dtype=torch.float64, device=dev)
        self.seen = torch.zeros(len(self.flat.params), dtype=torch.float64, device=dev)
        self._new_m = self.flat.zeros()
        self._denom_ok = False

    def _config(self) -> dict[str, Any]:
        return {
            **super()._config(),
            "var_freeze_step": self.var_freeze_step,
            "sync_growth": self.sync_growth,
            "max_sync_interval": self.max_sync_interval,
        }

    # ------------------------------------------------------------------ schedules
    def is_variance_step(self, t: int) -> bool:
        """Whether step ``t`` updates ``v`` (from a dense all-reduce of the gradient)."""
        if t <= self.freeze_step:
            return True
        k = t - self.freeze_step
        return t <= self.var_freeze_step and k & (k - 1) == 0

    def sync_interval(self, t: int) -> int:
        """Steps between momentum exchanges at step ``t`` (1 until ``var_freeze_step``)."""
        return sync_interval(t, self.var_freeze_step, self.sync_growth, self.max_sync_interval)

    # ------------------------------------------------------------------ the step
    def _denominator_now(self) -> torch.Tensor:
        if not self._denom_ok:
            self._denominator(self.v_steps)
            self._denom_ok = True
        return self._denom

    def _update(self, t: int, g: torch.Tensor, x: torch.Tensor, here: torch.Tensor) -> None:
        if self.is_variance_step(t):  # the warm-up and the variance refreshes: dense AdamW
            # v moves as Adam's would have over the steps since its last update (span): the
            # fresh g * g stands for each of them, so v keeps Adam's time scale, 1 / (1 - b2)
            # steps, instead of needing 1 / (1 - b2) refreshes to forget the warm-up
            present = self._dense_moments(t, g, here, span=t - self.v_steps)
            self.v_steps = t
            self._denom_ok = False
            self._adamw_update(t, x, self.exp_avg, self._denominator_now(), present)
            self._synced(t, x)
        elif t <= self.var_freeze_step:  # 1-bit Adam: compressed momentum on every step
            present = self._present_now(here)
            denom = self._denominator_now()
            self._compressed_momentum(g, denom, present, self._mask)
            self._adamw_update(t, x, self.exp_avg, denom, present)
            self._synced(t, x)
        else:  # a local step (this rank's own gradients decide), then an exchange when due
            mine = self._agreed_present(here)
            denom = self._denominator_now()
            self._local_momentum(g, mine, self._mask)
            c1 = 1.0 - self.defaults["betas"][0] ** t
            for i, group in enumerate(self.param_groups):
                self.lr_sum[i] += group["lr"]
            factors = []
            for i, s in self._slices_of(mine):
                group = self.param_groups[self.flat.group_of[i]]
                self.accum[s].add_(self.exp_avg[s], alpha=group["lr"] / c1)
                factors.append((i, 1.0 - group["lr"] * group["weight_decay"]))
            index = torch.tensor([i for i, _ in factors], dtype=torch.long, device=self.decay.device)
            values = torch.tensor([f for _, f in factors], dtype=torch.float64, device=self.decay.device)
            self.decay.index_copy_(0, index, self.decay[index] * values)
            self.seen.index_add_(0, index, torch.ones_like(values))
            self._adamw_update(t, x, self.exp_avg, denom, mine)
            if exchange_due(
                t, self.last_sync, self.var_freeze_step, self.sync_growth, self.max_sync_interval
            ):
                self._exchange(t, x)

    def _synced(self, t: int, x: torch.Tensor) -> None:
        self.anchor.copy_(x)
        self.accum.zero_()
        self.lr_sum = [0.0] * len(self.lr_sum)
        self.decay.fill_(1.0)
        self.seen.zero_()
        self.last_sync = t

    def _exchange(self, t: int, x: torch.Tensor) -> None:
        """Average the accumulated update and restart every rank from the same point."""
        denom = self._denominator_now()
        # which parameters some rank stepped, and their decay: one small all-reduce. Where the
        # ranks disagree about a parameter's steps, its decay is the mean of theirs
        n = len(self.flat.params)
        info = torch.cat([self.seen, self.decay])
        self.exchange.flags_mean(info)
        present = self._agreed_present(info[:n])
        self._compressed_mean(self.accum, denom, "update", self._element_mask(present, self._mask))
        # the elements left out hold no update (no rank stepped them, or their v is zero)
        c1 = 1.0 - self.defaults["betas"][0] ** t
        torch.mul(self.anchor, self.flat.expand(info[n:].to(torch.float32)), out=x)
        x.addcdiv_(self.accum, denom, value=-1.0)
        new_m = self._new_m
        for i, seg in enumerate(self.flat.segments):
            if self.lr_sum[i] > 0:
                torch.mul(self.accum[seg], c1 / self.lr_sum[i], out=new_m[seg])
            else:  # no learning rate in the interval: nothing moved; the same zero momentum everywhere
                new_m[seg].zero_()
        if present is None:
            self.exp_avg.copy_(new_m)
        else:  # a parameter no rank stepped keeps its momentum, as AdamW keeps a skipped one's
            torch.where(self.flat.expand(present), new_m, self.exp_avg, out=self.exp_avg)
        self._synced(t, x)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Exchange the pending local steps now (no-op when the ranks already agree)."""
        if self.step_count <= self.last_sync:
            return
        self.flat.read_params(self._x)
        self._exchange(self.step_count, self._x)
        self.flat.write_params(self._x)

    # ------------------------------------------------------------------ state
    def _extra_state(self) -> dict[str, Any]:
        return {
            "v_steps": self.v_steps,
            "last_sync": self.last_sync,
            "anchor": self.anchor.clone(),
            "accum": self.accum.clone(),
            "lr_sum": list(self.lr_sum),
            "decay": self.decay.clone(),
            "seen": self.seen.clone(),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        dev = self.flat.device
        self.v_steps = int(state["v_steps"])
        self.last_sync = int(state["last_sync"])
        self.anchor.copy_(state["anchor"].to(dev))
        self.accum.copy_(state["accum"].to(dev))
        self.lr_sum = [float(v) for v in state["lr_sum"]]
        self.decay.copy_(state["decay"].to(dev))
        self.seen.copy_(state["seen"].to(dev))
        self._denom_ok = False
