"""The checkpoint of a front's synchronization state, and the check before one is loaded.

Every front (``wrap``'s engine, the DDP hook, FSDP2) saves one state per rank in the same
envelope: ``format`` (the front's, with a version), ``rank``, ``signature`` (what the state was
made under: world, topology, scheme, codecs, parameters), ``step``, the
:class:`~gradsync.sync.ledger.Ledger`'s state (codec streams, momentum, carry) and what the
front adds (the engine's plan and closed loop, the hook's bucket layouts, FSDP's stream layouts
and call counts). Tensors and plain values only, so ``torch.load(..., weights_only=True)`` reads
it. :func:`must_reset` refuses a state saved under another setup or by another rank, naming the
difference, or resets with a warning on request: a state is never silently applied to buckets it
was not made for.
"""

from __future__ import annotations

import warnings
from typing import Any

from gradsync.sync.ledger import Ledger


def front_state(
    state_format: str, rank: int, signature: dict[str, Any], step: int, ledger: Ledger, **extra: Any
) -> dict[str, Any]:
    """One rank's checkpoint of a front (see the module)."""
    return {
        "format": state_format,
        "rank": rank,
        "signature": signature,
        "step": step,
        **ledger.state_dict(),
        **extra,
    }


def must_reset(
    state: Any,
    mine: dict[str, Any],
    rank: int,
    reset_compression_state: bool,
    state_format: str,
) -> bool:
    """Whether ``state`` (a front's ``state_dict``: the engine's, or the DDP hook's with its
    ``state_format``) was saved under another setup than ``mine`` (its signature) or by another
    rank: ``ValueError`` naming what differs, or with ``reset_compression_state`` a warning and
    True (the caller starts the compression state afresh). ``ValueError`` for something that is
    no such state at all."""
    if not isinstance(state, dict) or state.get("format") != state_format:
        raise ValueError(
            f"not a gradsync compression state (expected format {state_format!r}, got "
            f"{state.get('format') if isinstance(state, dict) else type(state).__name__!r})"
        )
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
