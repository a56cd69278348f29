"""What a checkpoint keeps of ``wrap``'s sync engine (in the envelope of :mod:`gradsync.sync.checkpoint`).

The state is one rank's: its codecs' streams (error-feedback residuals, PowerSGD factors, RNG
states, reused thresholds), the momentum of momentum correction, what is carried for ended
streams, the step count, the plan and the closed loop's progress. Tensors and plain values only,
so ``torch.load(..., weights_only=True)`` reads it. A state saved under another world size,
topology, scheme, set of codecs or model is refused, or reset with a warning on request: it is
never silently applied to buckets it was not made for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from gradsync.collectives.topology import Topology
from gradsync.planner.plan import Plan
from gradsync.sync.buckets import Slot
from gradsync.sync.checkpoint import front_state
from gradsync.sync.codec_set import CodecSet

if TYPE_CHECKING:
    from gradsync.integrate.engine import SyncEngine

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
    return front_state(
        STATE_FORMAT, engine.topo.rank, engine.signature(), engine.step, engine.ledger,
        plan=None if engine.plan is None else engine.plan.to_state(),
        closed_loop=engine.replanner.state_dict(),
    )  # fmt: skip


def load_engine_state(engine: SyncEngine, state: dict[str, Any]) -> None:
    """Restore :func:`engine_state` into ``engine`` (once :func:`~gradsync.sync.checkpoint.must_reset`
    said it fits)."""
    engine.ledger.load_state_dict(state)
    engine.step = int(state["step"])
    if state["plan"] is not None:
        engine.layout.install(Plan.from_state(state["plan"]), engine.codecs)
        engine.replanner.load_state_dict(state.get("closed_loop"))
