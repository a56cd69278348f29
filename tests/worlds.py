"""Run a function in a spawned world of gloo processes on loopback (FileStore rendezvous).

The process group timeout is short, so a collective that hangs fails the test instead of
stalling CI. Exceptions raised in any rank propagate to the test with their traceback.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=30)


def _entry(
    rank: int, world: int, store_path: str, fn: Callable[..., Any], args: tuple[Any, ...], env: dict[str, str]
) -> None:
    torch.set_num_threads(1)
    for k, v in env.items():
        os.environ[k] = v.format(rank=rank)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        fn(*args)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_world(world: int, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None) -> None:
    """Run ``fn(*args)`` on ``world`` ranks; ``env`` values may use ``{rank}``."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _entry,
            args=(world, os.path.join(d, "store"), fn, args, env or {}),
            nprocs=world,
            start_method="spawn",
        )
