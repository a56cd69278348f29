"""A world of one rank: nothing is synchronized, but what the scheme does to the gradients
besides synchronizing them still happens, once per backward pass that would synchronize."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradsync.sync.buckets import Slot
from gradsync.sync.clipping import clip_, local_threshold
from gradsync.sync.momentum import SyncMomentum


def finish_one_rank(
    slots: Sequence[Slot], clip_local: float | None, momentum: SyncMomentum | None, grad_scaler: Any | None
) -> None:
    """``clip_local`` clips the gradients (plain clipping: the bound for one rank) and momentum
    correction applies the momentum, unless the GradScaler will skip this step (inf/NaN in the
    gradients: the momentum stays as it was)."""
    scaled = grad_scaler is not None and bool(grad_scaler.is_enabled())
    scale = float(grad_scaler.get_scale()) if grad_scaler is not None and scaled else 1.0
    if clip_local is not None:
        grads = [s.param.grad for s in slots if s.param.grad is not None]
        clip_(grads, local_threshold(clip_local, 1), scale)
    if momentum is None:
        return
    live = [(s.name, g) for s in slots if (g := s.param.grad) is not None]
    if scaled and live:  # one read of the flags (kept on the device until then)
        home = live[0][1].device
        if not bool(torch.stack([torch.isfinite(g).all().to(home) for _, g in live]).all()):
            return
    momentum.begin_round()
    momentum.dense([n for n, _ in live], [g for _, g in live], scale)
