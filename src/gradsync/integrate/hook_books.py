"""The DDP hook's books from one iteration to the next: where DDP's buckets put each parameter,
which parameters got a gradient, and the flags an iteration ends with (see
:mod:`gradsync.integrate.ddp_hook` for what the hook does with them). What error feedback owes
is the :class:`~gradsync.sync.ledger.Ledger`'s, the same object ``wrap`` and FSDP2 drive.

DDP hands the hook one bucket at a time and waits for every bucket's future at the end of the
backward pass. An :class:`Iteration` collects what the buckets of one iteration leave behind;
:class:`HookBooks` settles it once the last bucket is done: with the agreed flags (overflow on
some rank, parameters no rank used), with the streams of buckets DDP no longer forms (their
residuals carried to the parameters), and only then are the buckets released to DDP.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gradsync.collectives.program import Program
from gradsync.collectives.topology import Topology
from gradsync.sync.bucket_sync import nonfinite_flag
from gradsync.sync.carry import Layouts, whole
from gradsync.sync.flags import flags_program, read_flags
from gradsync.sync.ledger import Ledger
from gradsync.sync.round import Round, RoundFlags


@dataclass
class Iteration:
    """One DDP iteration as the hook sees it, bucket by bucket."""

    joined: bool  # DDP's Join runs the hook on zero buckets for a rank out of data
    dense: bool
    members: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # bucket key -> (name, numel)
    compressed: set[str] = field(default_factory=set)  # keys (and, for PowerSGD, names) of streams in use
    nonfinite: list[torch.Tensor] = field(default_factory=list)  # per bucket, on its device
    held: list[tuple[torch.futures.Future[torch.Tensor], torch.Tensor]] = field(default_factory=list)


class HookBooks:
    """Bucket layouts and parameter use of a DDP hook, around its ``ledger`` (whose codecs are
    the hook's compressor, none for a dense scheme; ``model``: DDP's module, for parameter names
    and their use)."""

    def __init__(
        self, ledger: Ledger, model: nn.Module | None, find_unused: bool, check_overflow: bool
    ) -> None:
        self.ledger = ledger
        self.round = Round(ledger)
        """The iteration around the ledger: its state and its end (:mod:`gradsync.sync.round`)."""
        self.find_unused = find_unused
        self.check_overflow = check_overflow
        self.layouts: dict[str, list[tuple[str, int]]] = {}
        """Every bucket key seen, with its parameters (name, numel) in DDP's order."""
        self._warned: set[str] = set()  # the warnings given once
        self._used: set[str] = set()  # parameters with a gradient since the last synchronized iteration
        self._named = model is not None
        trained = (
            [(n, p) for n, p in model.named_parameters() if p.requires_grad] if model is not None else []
        )
        self._tracked = [n for n, _ in trained] if find_unused else []
        """The parameters whose use the flags carry (the same order on every rank)."""
        self._grad_hooks = [
            p.register_post_accumulate_grad_hook(lambda _, n=n: self._used.add(n)) for n, p in trained
        ]

    def _layouts(self) -> Layouts:
        return Layouts(self.layouts.items())

    @property
    def needs_flags(self) -> bool:
        """Whether an iteration ends with the flag all-reduce (overflow, used parameters)."""
        return self.check_overflow or self.find_unused

    def begin(self, joined: bool, dense: bool) -> Iteration:
        """The first bucket of an iteration (every bucket of the last one is done by now)."""
        it = Iteration(joined, dense)
        self.round.begin()
        if dense and self.ledger.codecs:  # a dense iteration: every stream ends, what it owed is sent now
            self.ledger.end_streams(lambda key: False, self._layouts(), strict=False)
        return it

    def inject(self, it: Iteration, key: str, buf: torch.Tensor, loss_scale: float) -> None:
        """Before a bucket is synchronized (compute thread): add what its parameters are owed and
        note whether it holds inf/NaN (a flag kept on the device)."""
        if self.ledger.carry.local and not it.joined:
            self.ledger.inject(buf, whole(it.members[key]), loss_scale)
        if self.check_overflow:
            it.nonfinite.append(nonfinite_flag(buf))

    def flags_program(self, it: Iteration, topo: Topology) -> tuple[Program, torch.Tensor]:
        """After the last bucket: agree on overflow and on the parameters used (one all-reduce)."""
        names = self._tracked

        def used() -> list[float]:
            return [float(n in self._used) for n in names]

        return flags_program(topo, it.nonfinite, used if names else None, len(names))

    def settle(self, it: Iteration, flags: torch.Tensor | None) -> None:
        """The iteration is over (compute thread): act on the agreed ``flags``, and carry what
        the streams of buckets DDP no longer forms owed. :meth:`release` then hands DDP the buckets."""
        agreed = (
            RoundFlags.from_values(read_flags(flags), self._tracked) if flags is not None else RoundFlags()
        )

        def poison() -> None:  # every rank skips the step: NaN reaches each rank's GradScaler
            for _, buf in it.held:
                buf.fill_(math.nan)

        def settle(unused: frozenset[str]) -> None:  # (DDP leaves unused ones untouched)
            if it.joined:
                return
            self.ledger.settle(n for members in it.members.values() for n, _ in members if n not in unused)
            self._warn_unplaced(it)
            self._warn_untracked(it)

        self.round.end(agreed, poison=poison, layouts=self._layouts, settle=settle)
        if not it.dense and self.ledger.codecs:  # streams of buckets DDP no longer forms
            self.ledger.end_streams(
                lambda key: key.split("/", 1)[0] in it.compressed or key in it.compressed,
                self._layouts(),
                strict=False,
            )
        self._used.clear()

    @staticmethod
    def release(it: Iteration) -> None:
        for fut, buf in it.held:
            fut.set_result(buf)

    def _warn_untracked(self, it: Iteration) -> None:
        """A parameter without a gradient while the hook was not told ``find_unused_parameters``:
        if no rank used it, DDP drops its result, and what error feedback sent of it is lost."""
        if self.find_unused or not self._named or "untracked" in self._warned:
            return
        missing = sorted({n for members in it.members.values() for n, _ in members} - self._used)
        if missing:
            self._warned.add("untracked")
            warnings.warn(
                f"gradsync: {len(missing)} parameters ({', '.join(missing[:3])}) got no gradient in this "
                "iteration, and the hook was not made with find_unused_parameters=True: for a parameter "
                "that no rank uses, DDP drops the synchronized result and with it what error feedback "
                "sent; pass find_unused_parameters=True, as the DDP model has (gradsync.register_comm_hook "
                "does it for you)",
                RuntimeWarning,
                stacklevel=2,
            )

    def _warn_unplaced(self, it: Iteration) -> None:
        here = {n for members in it.members.values() for n, _ in members}
        stray = sorted(set(self.ledger.carry.local) - here)
        if stray and "unplaced" not in self._warned:
            self._warned.add("unplaced")
            warnings.warn(
                f"gradsync: gradient owed to {len(stray)} tensors ({', '.join(stray[:3])}) waits for buckets "
                "DDP no longer forms: give the hook model= so that it follows parameters by name",
                RuntimeWarning,
                stacklevel=2,
            )

    def owed_gradients(self, world: int) -> dict[str, torch.Tensor]:
        """What this rank still owes the mean gradient, per parameter (see
        :meth:`~gradsync.sync.ledger.Ledger.owed_gradients`)."""
        return self.ledger.owed_gradients(self._layouts(), world)

    def state_dict(self) -> dict[str, Any]:
        """The bucket layouts (the ledger's state is saved beside them)."""
        return {"layouts": {k: [[n, c] for n, c in members] for k, members in self.layouts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, members in (state.get("layouts") or {}).items():
            self.layouts[key] = [(str(n), int(c)) for n, c in members]

    def close(self) -> None:
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()
