"""Start-up agreement: every rank must run the same configuration on the same model.

Each rank builds its config locally; a bad value raises there, but the other ranks cannot know.
So the config (or the error it raised) is compared across ranks first, as hashes exchanged in
one tiny fixed-size all-gather: a rank that disagrees, or failed, makes every rank raise an
error that names the differing ranks (and, for the model, the first differing parameter),
instead of some ranks hanging in their first collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from torch import nn

from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology

T = TypeVar("T")

_SEPARATOR = "\n"


def model_fingerprint(model: nn.Module | None) -> str:
    """One line per trainable or frozen parameter: name, shape, dtype, whether it trains."""
    if model is None:
        return ""
    return _SEPARATOR.join(
        f"{n} {tuple(p.shape)} {p.dtype} {'trains' if p.requires_grad else 'frozen'}"
        for n, p in model.named_parameters()
    )


def explain_models(fingerprints: list[str]) -> str:
    """The first parameter in which each rank's model differs from rank 0's, in words."""
    ref = fingerprints[0].split(_SEPARATOR) if fingerprints[0] else []
    lines = []
    for r, text in enumerate(fingerprints[1:], start=1):
        mine = text.split(_SEPARATOR) if text else []
        if mine == ref:
            continue
        for i in range(max(len(ref), len(mine))):
            a = ref[i] if i < len(ref) else None
            b = mine[i] if i < len(mine) else None
            if a == b:
                continue
            if a is None:
                lines.append(f"rank {r} has an extra parameter {b!r} (rank 0 has {len(ref)} parameters)")
            elif b is None:
                lines.append(f"rank {r} lacks parameter {a!r} (it has {len(mine)} parameters)")
            else:
                lines.append(f"parameter {i}: rank 0 has {a!r}, rank {r} has {b!r}")
            break
    return "the ranks' models differ: " + "; ".join(lines)


def agreed(
    topo: Topology,
    build: Callable[[], T],
    describe: Callable[[T], str],
    model: nn.Module | None,
) -> T:
    """``build()`` on every rank (it may raise ``ValueError``/``TypeError`` for bad input), then
    check that every rank built the same thing for the same model (``describe`` renders it).
    Raises the local error if every rank failed the same way, else
    :class:`~gradsync.collectives.MismatchError`."""
    error: Exception | None = None
    try:
        value = build()
        text = describe(value)
    except (ValueError, TypeError) as e:
        error, text = e, f"invalid: {e}"
    if topo.world > 1:
        P.check_same(
            topo.control_group, "gradsync start-up", {"parameters": explain_models},
            config=text, parameters=model_fingerprint(model),
        )  # fmt: skip
    if error is not None:
        raise error
    return value
