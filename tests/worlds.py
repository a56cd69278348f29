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


def init_world() -> None:
    """Start this rank's gloo process group (for ``run_world(..., init=False)``, where the
    function does things before the process group exists, as some training scripts do)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(os.environ["GRADSYNC_TEST_STORE"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)


def _entry(
    rank: int,
    world: int,
    store_path: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    init: bool,
) -> None:
    torch.set_num_threads(1)
    for k, v in env.items():
        os.environ[k] = v.format(rank=rank)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), GRADSYNC_TEST_STORE=store_path)
    if init:
        init_world()
    try:
        fn(*args)
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    world: int, fn: Callable[..., Any], *args: Any, env: dict[str, str] | None = None, init: bool = True
) -> None:
    """Run ``fn(*args)`` on ``world`` ranks; ``env`` values may use ``{rank}``. With ``init=False``
    the function starts the process group itself (:func:`init_world`)."""
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(
            _entry,
            args=(world, os.path.join(d, "store"), fn, args, env or {}, init),
            nprocs=world,
            start_method="spawn",
        )
