"""What a checkpoint keeps of a sync engine, and the checks before it is loaded.

The state is one rank's: its codecs' streams (error-feedback residuals, PowerSGD factors, RNG
states, reused thresholds), the momentum of momentum correction, what is carried for ended
streams, the step count, the plan and the closed loop's progress. Tensors and plain values only,
so ``torch.load(..., weights_only=True)`` reads it. A state saved under another world size,
topology, scheme, set of codecs or model is refused, or reset with a warning on request: it is
never silently applied to buckets it was not made for.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gradsync.collectives.topology import Topology
from gradsync.sync.buckets import Slot
from gradsync.sync.codec_set import CodecSet
from gradsync.sync.plan import Plan

if TYPE_CHECKING:
    from gradsync.sync.engine import SyncEngine

STATE_FORMAT = "gradsync.sync/1"


def signature(topo: Topology, codecs: CodecSet, slots: Sequence[Slot]) -> dict[str, Any]:
    """What a checkpoint must match: world, topology, scheme, codecs and parameters."""
    return {
        "world": topo.world,
        "nodes": topo.nodes,
        "per_node": topo.per_node,
        "scheme": codecs.scheme.name,
        "codecs": [c.spec() for c in codecs.codecs],
        "params": [f"{s.name}:{tuple(s.param.shape)}" for s in slots],
    }


def engine_state(engine: SyncEngine) -> dict[str, Any]:
    """``engine``'s state, between steps (see the module)."""
    return {
        "format": STATE_FORMAT,
        "rank": engine.topo.rank,
        "signature": engine.signature(),
        "step": engine.step,
        "plan": None if engine.plan is None else engine.plan.to_state(),
        "codecs": [c.state_dict() for c in engine.codecs],
        "closed_loop": engine.replanner.state_dict(),
        "momentum": None if engine.momentum is None else engine.momentum.state_dict(),
        "carry": engine.carry.state_dict(),
    }


def load_engine_state(engine: SyncEngine, state: dict[str, Any]) -> None:
    """Restore :func:`engine_state` into ``engine`` (once :func:`must_reset` said it fits)."""
    for codec, cs in zip(engine.codecs, state["codecs"], strict=True):
        codec.load_state_dict(cs)
    if engine.momentum is not None and state.get("momentum") is not None:
        engine.momentum.load_state_dict(state["momentum"])
    engine.carry.load_state_dict(state.get("carry"))
    engine.step = int(state["step"])
    if state["plan"] is not None:
        engine.layout.install(Plan.from_state(state["plan"]), engine.codecs)
        engine.replanner.load_state_dict(state.get("closed_loop"))


def must_reset(
    state: Any,
    mine: dict[str, Any],
    rank: int,
    reset_compression_state: bool,
    state_format: str = STATE_FORMAT,
) -> bool:
    """Whether ``state`` (a front's ``state_dict``: the engine's, or the DDP hook's with its
    ``state_format``) was saved under another setup than ``mine`` (its signature) or by another
    rank: ``ValueError`` naming what differs, or with ``reset_compression_state`` a warning and
    True (the caller starts the compression state afresh). ``ValueError`` for something that is
    no such state at all."""
    if not isinstance(state, dict) or state.get("format") != state_format:
        raise ValueError(f"not a gradsync compression state (expected format {state_format!r})")
    theirs = {**state.get("signature", {}), "rank": state.get("rank")}
    mine = {**mine, "rank": rank}
    diff = [k for k in mine if k != "rank" and mine[k] != theirs.get(k)]
    if theirs["rank"] != rank and "world" not in diff:
        diff.append("rank")  # each rank's residuals are its own
    if not diff:
        return False
    detail = "; ".join(f"{k}: saved {_short(theirs.get(k))} vs now {_short(mine[k])}" for k in diff)
    if not reset_compression_state:
        raise ValueError(
            f"gradsync: the compression state was saved under a different setup ({detail}); pass "
            "reset_compression_state=True to start the compression state afresh"
        )
    warnings.warn(
        f"gradsync: resetting the compression state, it was saved under a different setup ({detail})",
        stacklevel=3,
    )
    return True


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) < 120 else text[:117] + "..."
