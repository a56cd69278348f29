"""Start-up agreement: every rank must run the same configuration on the same model.

Each rank builds its config locally; a bad value raises there, but the other ranks cannot know.
So the config (or the error it raised) is compared across ranks first, as hashes exchanged in
one tiny all-gather: a rank that disagrees, or failed, makes every rank raise an error that
names the differing ranks, instead of some ranks hanging in their first collective.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import TypeVar

import torch

from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology

T = TypeVar("T")


def agreed(
    topo: Topology, build: Callable[[], T], describe: Callable[[T], str], model: str, device: torch.device
) -> T:
    """``build()`` on every rank, then check that every rank built the same thing for the same
    model (``describe`` renders it, ``model`` fingerprints the parameters). Raises the local error
    if every rank failed the same way, else :class:`~gradsync.collectives.MismatchError`."""
    error: Exception | None = None
    try:
        value = build()
        text = describe(value)
    except (ValueError, TypeError) as e:
        error, text = e, f"invalid: {e}"
    digest = hashlib.blake2b(model.encode(), digest_size=8).hexdigest()
    P.check_same(topo.world_group, device, config=text, parameters=f"model {digest}")
    if error is not None:
        raise error
    return value


def comm_device() -> torch.device:
    """Where the default process group's tensors must live (the current GPU under NCCL)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
