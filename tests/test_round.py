"""The round (gradsync.sync.round): one iteration's states and its end decision, which every front
drives, checked on a ledger of a real codec with error feedback against what it owed before."""

from __future__ import annotations

import pytest
import torch

from gradsync.codecs import EncodeContext, build_codec
from gradsync.sync.carry import Layouts
from gradsync.sync.ledger import Ledger
from gradsync.sync.round import Round, RoundFlags, RoundState


def ledger_with_history() -> tuple[Ledger, torch.Tensor]:
    """A ledger whose codec has run one round already; returns it and the residual owed then."""
    codec = build_codec("topk:density=0.1+ef")
    ledger = Ledger([codec])
    r = Round(ledger)
    r.begin()
    codec.encode(torch.randn(40, generator=torch.Generator().manual_seed(0)), EncodeContext(key="b"))
    r.end(RoundFlags())
    return ledger, codec.residual("b").clone()


def test_flags_are_read_from_the_agreed_values():
    flags = RoundFlags.from_values([0.0, 1.0, 0.0, 1.0], ["a", "b", "c"])
    assert flags == RoundFlags(False, frozenset({"b"}))
    assert RoundFlags.from_values([1.0]).overflow
    with pytest.raises(ValueError):
        RoundFlags.from_values([0.0, 1.0], ["a", "b"])  # a value for every tracked parameter


def test_an_overflow_poisons_and_rolls_the_round_back():
    ledger, before = ledger_with_history()
    codec = ledger.codecs[0]
    r = Round(ledger)
    assert r.state is RoundState.IDLE
    r.begin()
    assert r.state is RoundState.OPEN
    codec.encode(torch.randn(40, generator=torch.Generator().manual_seed(1)), EncodeContext(key="b"))
    assert not torch.equal(codec.residual("b"), before)
    poisoned = []
    state = r.end(RoundFlags(overflow=True), poison=lambda: poisoned.append(1), settle=lambda back: 1 / 0)
    assert state is RoundState.ROLLED_BACK and r.rolled_back and poisoned == [1]
    assert torch.equal(codec.residual("b"), before)  # what it owed before the round, exactly


def test_a_round_gives_back_the_unused_and_the_named_and_settles_the_rest():
    ledger, _ = ledger_with_history()
    codec = ledger.codecs[0]
    r = Round(ledger)
    r.begin()
    g = torch.randn(40, generator=torch.Generator().manual_seed(2))
    before = codec.residual("b").clone()
    codec.encode(g, EncodeContext(key="b"))
    after = codec.residual("b").clone()
    layouts = Layouts([("b", [("w", 20), ("v", 20)])])
    settled: list[frozenset[str]] = []
    state = r.end(RoundFlags(unused=frozenset({"w"})), layouts=lambda: layouts, give_back={"v"},
                  settle=settled.append)  # fmt: skip
    assert state is RoundState.SETTLED and settled == [frozenset({"w", "v"})]
    # both parameters' elements were given back: the residual is as before the round
    assert torch.equal(codec.residual("b"), before) and not torch.equal(after, before)


def test_a_round_ends_only_while_open():
    r = Round(Ledger([]))
    with pytest.raises(RuntimeError, match="only while open, this one is idle"):
        r.end(RoundFlags())
    r.begin()
    r.end(RoundFlags())
    with pytest.raises(RuntimeError, match="this one is settled"):
        r.end(RoundFlags())
