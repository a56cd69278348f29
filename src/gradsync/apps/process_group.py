"""Joining the default process group from torchrun's environment, the one way the apps do it.

On a CUDA machine each rank takes the GPU of its ``LOCAL_RANK`` and tells NCCL so through
``device_id``: without it NCCL guesses the device from the global rank, warns, and can hang
where ranks and GPUs are not numbered alike (seen in the first H200 GPU check). Without CUDA
the group is gloo's.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist


def init_default_group(
    timeout: datetime.timedelta,
    store: dist.Store | None = None,
    rank: int = -1,
    world_size: int = -1,
) -> str:
    """Initialize the default group (NCCL bound to this rank's GPU, else gloo); return the
    backend's name. ``store``, ``rank`` and ``world_size`` are passed on when a store is given
    (a rendezvous of the caller's own); otherwise torchrun's ``env://`` variables are read."""
    options: dict[str, Any] = {"timeout": timeout}
    if store is not None:
        options.update(store=store, rank=rank, world_size=world_size)
    backend = "gloo"
    if torch.cuda.is_available():
        backend = "nccl"
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        options["device_id"] = torch.device("cuda", local)
    dist.init_process_group(backend, **options)
    return backend
