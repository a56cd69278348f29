"""The ledger: everything one front's error feedback owes, and the rounds that change it.

``wrap``'s engine, the DDP hook and FSDP2 each synchronize gradients their own way (the engine's
planned buckets, DDP's buckets, FSDP's flat shards), but what they owe the model is kept here,
once, by one object per front, so that a fix is a fix for all three:

- the codecs' streams (error-feedback residuals, PowerSGD's warm starts, random states), and
  with momentum correction the momentum of what goes dense (:mod:`gradsync.sync.momentum`);
- the :class:`~gradsync.sync.carry.Carry`: what streams that ended still owe, per parameter name,
  until a step applies it;
- the round: :meth:`Ledger.begin_round` opens it (one synchronized backward pass), what the
  carry gives to the round's inputs (:meth:`Ledger.inject`) and what the codecs commit can be
  undone together (:meth:`Ledger.rollback_round`, when any rank's gradients overflowed), or
  given back for parameters that no rank used (:meth:`Ledger.give_back`), or settled
  (:meth:`Ledger.settle`, :meth:`Ledger.apply_agreed`);
- ending streams whose layout changed (a re-plan, the switch to dense, a bucket DDP no longer
  forms, an FSDP module whose parameters changed): :meth:`Ledger.end_streams` traces what they
  owed back to parameters through the layout they ran under;
- what is owed per parameter (:meth:`Ledger.owed_gradients`) and the checkpoint of all of it
  (:meth:`Ledger.state_dict`; the per-front envelope and its check are :func:`front_state` and
  :func:`must_reset`).

Where state lives: every tensor follows the gradient's device (and dtype) at its first use,
so a state loaded with ``map_location="cpu"`` resumes a CUDA run. A front describes its geometry
with :class:`~gradsync.sync.carry.Layouts`: which parameter (and which elements of it) each
element of a stream's input is, and what it is worth in the carry's units.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Sequence, Set
from typing import Any

import torch

from gradsync.codecs import Compressor
from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology
from gradsync.sync.buckets import Slot
from gradsync.sync.carry import Carry, Layouts, Piece, gather_for_mean, give_back_unused, owed_by_parameter
from gradsync.sync.momentum import sync_momentum

Keep = Callable[[str], bool] | dict[int, Callable[[str], bool]]
"""Which streams stay when streams end: one filter for every codec, or one per codec index (a
codec without one ends all of its streams)."""


class Ledger:
    """What one front's error feedback owes (see the module). ``codecs``: the front's
    compressors, in a fixed order (the checkpoint keeps their states in it)."""

    def __init__(self, codecs: Sequence[Compressor]) -> None:
        self.codecs = list(codecs)
        self.momentum = sync_momentum(self.codecs)
        """Momentum correction (``ef:momentum``): the optimizer's momentum for what is sent
        densely; None for other schemes."""
        self.carry = Carry()
        """What streams that ended still owe, per parameter, until a step applies it."""
        self._taken: list[tuple[str, torch.Tensor]] = []  # carry given to this round's inputs

    # ------------------------------------------------------------------ the round
    def begin_round(self, scope: Callable[[str], bool] | None = None) -> None:
        """A synchronized backward pass starts: what it does can be undone until the next one.
        ``scope``: the round covers the codecs' streams whose key it accepts (a front whose
        rounds overlap, the outer loop's fragments); a scoped round leaves momentum correction
        and the carry's taken gifts alone."""
        for codec in self.codecs:
            codec.begin_round(scope)
        if scope is not None:
            return
        if self.momentum is not None:
            self.momentum.begin_round()
        self._taken = []

    def inject(self, flat: torch.Tensor, pieces: Sequence[Piece], scale: float, take: bool = False) -> None:
        """Add what the carry holds for each piece (in ``flat``'s order; padding and names ""
        skipped) to its elements of ``flat``, times ``scale`` (the loss scale over the bucket's
        :meth:`Layouts.factor`): it is synchronized with the gradient. ``take``: the carry gives
        it up now (and gets it back if the round is rolled back); else it stays until
        :meth:`settle` or :meth:`apply_agreed` says a step applied it."""
        if not self.carry.local:
            return
        at, given = 0, []
        for piece in pieces:
            if piece.name and self.carry.inject(piece, flat[at : at + piece.length], scale):
                given.append(piece.name)
            at += piece.length
        if take:
            for name in dict.fromkeys(given):
                self._taken.append((name, self.carry.local.pop(name)))

    def rollback_round(self, scope: Callable[[str], bool] | None = None) -> None:
        """Some rank's gradients overflowed: every rank skips the step and undoes what the round
        did to its residuals, momentum and carry (``scope``: as :meth:`begin_round`)."""
        for codec in self.codecs:
            codec.rollback_round(scope)
        if scope is not None:
            return
        if self.momentum is not None:
            self.momentum.rollback_round()
        for name, owed in self._taken:
            self.carry.add_local(name, owed)
        self._taken = []

    def give_back(self, layouts: Layouts, unused: set[str]) -> None:
        """Parameters no rank used get no gradient (as DDP leaves them): what error feedback sent
        of them this round never reached the model, so their elements get their residual back
        (and momentum correction's momentum does not move for them)."""
        if not unused:
            return
        give_back_unused(self.codecs, layouts, unused)
        if self.momentum is not None:
            self.momentum.rollback_round(unused)

    def settle(self, applied: Iterable[str]) -> None:
        """A step applied what these parameters were owed (their carry went into its inputs)."""
        self.carry.settle(applied)

    def apply_agreed(self, slots: Sequence[Slot], unused: Set[str], shadow: bool, scale: float) -> None:
        """After a step that was not skipped: the agreed carry (momentum correction) goes onto the
        synchronized gradients, and what the step applied is settled. A parameter without a
        gradient (no rank used it, or this rank joined without data) keeps its carry."""
        if not self.carry:
            return
        if shadow:  # the others applied the agreed carry; this rank takes their parameters
            self.carry.settle(list(self.carry.mean), local=False)
            return
        applied = []
        for s in slots:
            if s.param.grad is None or s.name in unused:
                continue
            self.carry.apply_mean(s.name, s.param.grad, scale)
            applied.append(s.name)
        self.carry.settle(applied)

    # ------------------------------------------------------------------ streams
    def end_streams(
        self,
        keep: Keep,
        layouts: Layouts,
        *,
        strict: bool = True,
        ended: Sequence[Slot] = (),
        topo: Topology | None = None,
    ) -> list[str]:
        """End every stream ``keep`` rejects and carry what it owed to its parameters through
        ``layouts`` (the layout the streams ran under); returns the ended streams' keys.

        ``strict=False``: a stream of no known bucket (a state saved by an older gradsync) is
        dropped with a warning instead of raising. With momentum correction the residual is part
        of an update, so the ranks agree on it here (one all-reduce over ``topo``, ``ended``: the
        parameters whose streams end, the same on every rank): the mean goes onto the next
        synchronized gradients and seeds the momentum."""
        owed = []
        for cid, codec in enumerate(self.codecs):
            filt = keep if callable(keep) else keep.get(cid, lambda key: False)
            owed += codec.take_streams(filt)
        if self.momentum is None:
            lost = self.carry.add_owed(owed, layouts, strict=strict)
            if lost:
                warnings.warn(
                    f"gradsync: the residuals of {len(lost)} compression streams ({', '.join(lost[:3])}...) "
                    "belong to buckets of no known layout (a state saved by an older gradsync): they "
                    "are dropped",
                    RuntimeWarning,
                    stacklevel=3,
                )
        elif ended:
            assert topo is not None, "momentum correction agrees on what ended streams owed"
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
                self.carry.add_mean(s.name, total[at : at + s.numel].to(device))
                self.momentum.seed(s.name, total[half + at : half + at + s.numel].to(device))
                at += s.numel
        return [o.key for o in owed]

    # ------------------------------------------------------------------ what is owed
    def owed_gradients(self, layouts: Layouts, world: int, strict: bool = True) -> dict[str, torch.Tensor]:
        """What this rank still owes the synchronized gradient, per parameter name (flat,
        unscaled): the residuals traced back through ``layouts``, and the carry, divided by
        ``world`` (the carry's units are a sum over the ranks; 1 where they are the final
        gradient's already). The ranks' values add up to everything computed but not applied
        yet. ``strict=False``: streams of no known layout are left out."""
        return owed_by_parameter(self.codecs, layouts, self.carry, world, strict)

    def residual_norm(self) -> float | None:
        """The L2 norm of every codec's error-feedback residuals (None without error feedback)."""
        norms = [n for c in self.codecs if (n := c.residual_norm()) is not None]
        return math.sqrt(sum(n * n for n in norms)) if norms else None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Codec streams, momentum and carry: tensors and plain values (``weights_only`` loads it)."""
        return {
            "codecs": [c.state_dict() for c in self.codecs],
            "momentum": None if self.momentum is None else self.momentum.state_dict(),
            "carry": self.carry.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (a front's older checkpoint with one ``codec`` too). Tensors
        stay where they were loaded; each follows its gradient's device at its first use."""
        codecs = state.get("codecs")
        if codecs is None:  # a front's older state: its one codec's, or {} / None for a dense scheme
            codecs = [state["codec"]] if self.codecs and state.get("codec") is not None else []
        if len(codecs) != len(self.codecs):
            raise ValueError(
                f"gradsync: the state holds {len(codecs)} codec states, this synchronization has "
                f"{len(self.codecs)} codecs"
            )
        for codec, cs in zip(self.codecs, codecs, strict=True):
            codec.load_state_dict(cs)
        if self.momentum is not None and state.get("momentum") is not None:
            self.momentum.load_state_dict(state["momentum"])
        self.carry.load_state_dict(state.get("carry"))
        self._taken = []

    def reset(self) -> None:
        """Start the compression state afresh (a checkpoint of another setup, on request)."""
        for codec in self.codecs:
            codec.reset_state()
        self.momentum = sync_momentum(self.codecs)
        self.carry = Carry()
        self._taken = []
