"""Ending the engine's compression streams without losing what they owe.

A plan switch (or its revert) ends the streams of every bucket it changes, and
``dense_from_step`` ends all of them. What each stream's error feedback still owed is traced back
to its parameters and kept in the engine's :class:`~gradsync.sync.carry.Carry` until a step
applies it; with momentum correction the ranks agree on it here, once. After every step that was
not skipped, :func:`apply_carry` settles what that step applied.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology
from gradsync.sync.buckets import Slot
from gradsync.sync.carry import Carry, Layouts, gather_for_mean
from gradsync.sync.codec_set import CodecSet
from gradsync.sync.momentum import SyncMomentum


def end_streams(
    codecs: CodecSet,
    keep: dict[int, Callable[[str], bool]],
    ended: Sequence[Slot],
    layouts: Layouts,
    carry: Carry,
    momentum: SyncMomentum | None,
    topo: Topology,
) -> list[str]:
    """End every stream ``keep`` rejects (all of a codec without a filter) and carry what they
    owed (returns their keys). ``ended``: the parameters whose streams end, the same on every
    rank. With momentum correction the ranks agree on it here (one all-reduce): the mean of the
    residuals goes onto the next synchronized gradients and seeds the momentum."""
    owed = []
    for cid, codec in enumerate(codecs.codecs):
        owed += codec.take_streams(keep.get(cid, lambda key: False))
    if momentum is None:
        carry.add_owed(owed, layouts)
    elif ended:
        wide = any(s.param.dtype == torch.float64 for s in ended)
        total = gather_for_mean(
            owed, layouts, [(s.name, s.numel) for s in ended], torch.float64 if wide else torch.float32,
            topo.comm_device,
        )  # fmt: skip
        if topo.world > 1:
            P.all_reduce(total, topo.control_group, "world")
        total.div_(topo.world)
        half, at = total.numel() // 2, 0
        for s in ended:
            device = s.param.device
            carry.add_mean(s.name, total[at : at + s.numel].to(device))
            momentum.seed(s.name, total[half + at : half + at + s.numel].to(device))
            at += s.numel
    return [o.key for o in owed]


def apply_carry(carry: Carry, slots: Sequence[Slot], unused: set[str], shadow: bool, scale: float) -> None:
    """After a step that was not skipped: the agreed carry (momentum correction) goes onto the
    synchronized gradients; what this step applied is settled. A parameter without a gradient
    (no rank used it, or a rank that joined) keeps its carry for a later step."""
    if shadow:  # the others applied the agreed carry; this rank takes their parameters
        carry.settle(list(carry.mean), local=False)
        return
    applied = []
    for s in slots:
        if s.param.grad is None or s.name in unused:
            continue
        carry.apply_mean(s.name, s.param.grad, scale)
        applied.append(s.name)
    carry.settle(applied)
