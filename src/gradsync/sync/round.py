"""The round: one synchronized iteration of a front, around its :class:`~gradsync.sync.ledger.Ledger`.

Every front synchronizes in its own shape (``wrap``'s engine its planned buckets, the DDP hook
DDP's buckets, FSDP2 its flat shards, the outer loop its fragments' pseudo-gradients), but an
iteration goes through the same states and ends by the same decision, kept here once:

- :attr:`RoundState.IDLE`: before the first iteration;
- :meth:`Round.begin` -> :attr:`RoundState.OPEN`: the codecs' streams commit, the carry gives to
  the round's inputs; all of it can still be undone (a round left open when the next begins is
  settled as it stands: its iteration had nothing to decide, or never ended);
- :meth:`Round.end`, with the flags every rank agreed (:class:`RoundFlags`):

  * an overflow on any rank (inf/NaN): every rank skips the step, the front poisons what it
    synchronized (NaN: each rank's GradScaler skips), and the ledger rolls the round back ->
    :attr:`RoundState.ROLLED_BACK`;
  * otherwise the parameters no rank used get their residuals back (what was sent of them never
    reached the model), and what the step applied is settled -> :attr:`RoundState.SETTLED`;

  then the round is idle again.

FSDP2's own states (``torch.distributed.fsdp._fully_shard._fsdp_common.TrainingState``) are the
model: one enum, every transition in one place. The fronts keep only what is theirs (how to
poison their outputs, where their parameters sit, what they applied).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from gradsync.sync.carry import Layouts
from gradsync.sync.ledger import Ledger


class RoundState(enum.Enum):
    """Where a front's iteration is (see the module)."""

    IDLE = "idle"
    OPEN = "open"
    ROLLED_BACK = "rolled back"
    SETTLED = "settled"


@dataclass(frozen=True)
class RoundFlags:
    """What every rank agreed at the end of an iteration: whether some rank's gradients
    overflowed, and which of the tracked parameters no rank used."""

    overflow: bool = False
    unused: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def from_values(cls, values: Sequence[float], tracked: Sequence[str] = ()) -> RoundFlags:
        """From the agreed flag values ``[overflow, used_0, used_1, ...]`` (maxima over the
        ranks), ``tracked`` naming the parameters whose use they carry, in that order."""
        unused = frozenset(n for n, v in zip(tracked, values[1:], strict=True) if v == 0)
        return cls(values[0] > 0, unused)


class Round:
    """One front's iteration around ``ledger``: its state and its end (see the module)."""

    def __init__(self, ledger: Ledger, scope: Callable[[str], bool] | None = None) -> None:
        self.ledger = ledger
        self.scope = scope
        """The codec streams the round covers (None: all of them; see
        :meth:`~gradsync.sync.ledger.Ledger.begin_round`)."""
        self.state = RoundState.IDLE

    @property
    def rolled_back(self) -> bool:
        """Whether the current (or last) round was rolled back."""
        return self.state is RoundState.ROLLED_BACK

    def begin(self) -> None:
        """An iteration starts: what it does to the ledger can be undone until :meth:`end`."""
        self.ledger.begin_round(self.scope)
        self.state = RoundState.OPEN

    def end(
        self,
        flags: RoundFlags,
        *,
        poison: Callable[[], None] = lambda: None,
        layouts: Callable[[], Layouts] | None = None,
        give_back: Iterable[str] = (),
        settle: Callable[[frozenset[str]], None] | None = None,
    ) -> RoundState:
        """End the round on the agreed ``flags``.

        ``poison``: make what the front synchronized NaN (on an overflow). ``layouts``: the
        geometry the round's streams ran under (needed when parameters are given back).
        ``give_back``: parameters this rank knows were not applied although some rank used them
        (a frozen parameter), given back with the unused ones. ``settle``: what the front
        applied is settled, given the parameters that were not (by default the ledger settles
        nothing: a front whose carry was taken at injection has nothing to settle)."""
        if self.state is not RoundState.OPEN:
            raise RuntimeError(f"gradsync: a round can end only while open, this one is {self.state.value}")
        if flags.overflow:
            poison()
            self.ledger.rollback_round(self.scope)
            self.state = RoundState.ROLLED_BACK
            return self.state
        back = set(flags.unused) | set(give_back)
        if back:
            assert layouts is not None, "giving residuals back needs the round's layouts"
            self.ledger.give_back(layouts(), back)
        if settle is not None:
            settle(frozenset(back))
        self.state = RoundState.SETTLED
        return self.state


__all__ = ["Round", "RoundFlags", "RoundState"]
