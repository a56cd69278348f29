"""The optimizer's momentum for what a momentum-correcting scheme sends densely (the RedSync
paper's Algorithm 4).

With ``ef:momentum=M`` (DGC's momentum correction) the optimizer runs without momentum: the
error feedback of each compressed bucket keeps it, per rank, before compression. Everything the
engine sends densely bypasses that error feedback: tensors too small to compress, buckets the
plan leaves dense, the dense warm-up steps and every step after ``dense_from_step``. Without this
module those gradients would be applied with no momentum at all.

:class:`SyncMomentum` gives them the momentum back, on the synchronized mean gradient ``g``. That
gradient is identical on every rank, so the momentum ``u`` is too, and no communication is
needed. Per parameter, as ``torch.optim.SGD`` computes it::

    u = M * u + g;  update = u            (Nesterov: update = g + M * u)

When a compressed stream ends (a re-plan changes its bucket, or the switch to dense training),
the momentum its error feedback kept is averaged over the ranks and added here (:meth:`seed`),
so momentum carries on instead of restarting. When a parameter moves from dense to compressed
(after the dense warm-up, or when a re-plan starts compressing its bucket), the momentum its
dense steps built up is not handed to the compressed streams: those are each rank's own and
laid out per codec. It is released as momentum SGD would release it: ``u = M * u;
update += u`` (Nesterov: ``update += M * u``) on every compressed step. Momentum SGD's velocity
is linear in the gradients, so the sum of this decaying part and the error feedback's new
momentum is the velocity momentum SGD would have. Once ``M ** steps`` falls below
:data:`NEGLIGIBLE`, the momentum is dropped.

``u`` is kept unscaled (a GradScaler's scale divided out), in float32 for 16-bit gradients. A
step that every rank skips for an overflow leaves ``u`` as it was (:meth:`rollback_round`).

References:

- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from gradsync.codecs import Compressor, ErrorFeedback

NEGLIGIBLE = 1e-6
"""Released momentum is dropped once it has decayed to this fraction of what it was."""


def _work(t: torch.Tensor) -> torch.Tensor:
    """``t`` flat, in the dtype the momentum is kept in (float32 for 16-bit gradients)."""
    flat = t.reshape(-1)
    return flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat


class SyncMomentum:
    """Per-parameter momentum (keyed by parameter name) for densely synchronized gradients."""

    def __init__(self, momentum: float, nesterov: bool = False) -> None:
        if not 0.0 < momentum < 1.0:
            raise ValueError(f"momentum must be in (0, 1), got {momentum!r}")
        self.momentum = momentum
        self.nesterov = nesterov
        self.velocity: dict[str, torch.Tensor] = {}
        self._released: dict[str, int] = {}  # compressed steps since the last dense one
        self._limit = max(1, math.ceil(math.log(NEGLIGIBLE) / math.log(momentum)))
        self._undo: list[tuple[str, torch.Tensor | None, int]] = []

    def begin_round(self) -> None:
        """Start a step: :meth:`rollback_round` undoes what the step changes."""
        self._undo = []

    def rollback_round(self, names: set[str] | None = None) -> None:
        """Undo this step's updates: all of them (every rank skips the step), or those of the
        parameters in ``names`` (no rank used them: the optimizer skips them, as SGD skips a
        parameter whose gradient is None)."""
        keep = []
        for entry in reversed(self._undo):
            name, old, released = entry
            if names is not None and name not in names:
                keep.append(entry)
                continue
            if old is None:
                self.velocity.pop(name, None)
                self._released.pop(name, None)
            else:
                self.velocity[name] = old
                self._released[name] = released
        self._undo = keep[::-1]

    def _velocity(self, name: str, device: torch.device) -> torch.Tensor | None:
        """``name``'s momentum on ``device`` (state loaded with ``map_location="cpu"`` follows
        the gradient on first use), or None."""
        v = self.velocity.get(name)
        if v is not None and v.device != device:
            v = self.velocity[name] = v.to(device)
        return v

    def _remember(self, name: str) -> None:
        self._undo.append((name, self.velocity.get(name), self._released.get(name, 0)))

    def dense(self, names: Sequence[str], grads: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        """``grads`` (synchronized, carrying the loss ``scale``) become the momentum update, in place."""
        m = self.momentum
        for name, grad in zip(names, grads, strict=True):
            g = _work(grad) / scale  # a new tensor: grad is overwritten below
            old = self._velocity(name, grad.device)
            self._remember(name)
            u = g.clone() if old is None else torch.add(g, old, alpha=m)
            self.velocity[name] = u
            self._released[name] = 0
            update = torch.add(g, u, alpha=m) if self.nesterov else u
            grad.copy_(update.view(grad.shape).mul(scale) if scale != 1.0 else update.view(grad.shape))

    def release(self, names: Sequence[str], grads: Sequence[torch.Tensor], scale: float = 1.0) -> None:
        """Add to ``grads`` (a compressed bucket's synchronized gradients) what their momentum
        from earlier dense steps still contributes, in place; nothing without such momentum."""
        m = self.momentum
        for name, grad in zip(names, grads, strict=True):
            old = self._velocity(name, grad.device)
            if old is None:
                continue
            self._remember(name)
            u = old * m
            released = self._released.get(name, 0) + 1
            if released >= self._limit:
                del self.velocity[name]
                del self._released[name]
            else:
                self.velocity[name] = u
                self._released[name] = released
            grad.add_(u.view(grad.shape), alpha=(m if self.nesterov else 1.0) * scale)

    def seed(self, name: str, u: torch.Tensor) -> None:
        """Add ``u`` (flat, unscaled, in units of the mean gradient) to ``name``'s momentum,
        between steps: the momentum a compressed stream had built up when the stream ended (see
        :mod:`gradsync.sync.carry`). A dense step continues it; a compressed one releases it."""
        old = self._velocity(name, u.device)
        self.velocity[name] = u.clone() if old is None else old + u.to(old.dtype)
        self._released[name] = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "momentum": self.momentum,
            "nesterov": self.nesterov,
            "velocity": {k: v.clone() for k, v in self.velocity.items()},
            "released": dict(self._released),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("momentum"), state.get("nesterov")) != (self.momentum, self.nesterov):
            raise ValueError(
                f"momentum state was saved with momentum={state.get('momentum')}, nesterov="
                f"{state.get('nesterov')}, but this engine has momentum={self.momentum}, "
                f"nesterov={self.nesterov}"
            )
        self.velocity = {k: v.clone() for k, v in state["velocity"].items()}
        self._released = {k: int(v) for k, v in state["released"].items()}
        self._undo = []


def sync_momentum(codecs: Sequence[Compressor]) -> SyncMomentum | None:
    """The dense side of momentum correction when the codecs carry the optimizer's momentum
    (``ef:momentum=M``), else None. Every codec must then carry the same momentum: a bucket
    under a codec without it would get none."""
    kinds = {
        (c.config.momentum, c.config.nesterov) if isinstance(c, ErrorFeedback) else (0.0, False)
        for c in codecs
    }
    if len(kinds) > 1:
        raise ValueError(
            "ef: momentum must be the same for every codec of the scheme (momentum correction moves "
            "the optimizer's momentum into the synchronization, so every bucket needs it), got "
            + ", ".join(sorted(c.spec() for c in codecs))
        )
    m, nesterov = kinds.pop() if kinds else (0.0, False)
    return SyncMomentum(m, nesterov) if m > 0 else None
