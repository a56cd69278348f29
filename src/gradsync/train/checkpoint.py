"""Training checkpoints: consistent across ranks, atomic on disk, readable with ``weights_only``.

A checkpoint is a folder ``step-NNNNNNNN`` with

- ``main.pt`` (rank 0): model, optimizer, scheduler, GradScaler, position (epoch, batch in the
  epoch, global step), the epoch history so far, and what the run was (data fingerprint, model,
  scheme, world) so that a resume under other settings is refused;
- ``rank-R.pt`` (every rank): that rank's gradsync engine state (error-feedback residuals and
  the like differ between ranks) and its RNG states.

Every file is written to a temporary name and renamed, so a crash never leaves a half-written
file under a real name. Ranks write their files, meet at a barrier, and only then rank 0 points
``latest`` (itself written atomically) at the new folder: a checkpoint is used only once every
rank's part of it exists. Older folders beyond ``keep`` are removed afterwards. The folder is
created with mode 0700. Everything is tensors and plain Python values: no pickled objects.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LATEST = "latest"


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _atomic_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save(
    root: str | os.PathLike[str], step: int, main: dict[str, Any], local: dict[str, Any], rank: int, keep: int
) -> Path:
    """Write this rank's part of the checkpoint of ``step`` (``main`` is written by rank 0 only).
    Every rank must call it (it has a barrier when a process group exists)."""
    root = Path(root)
    folder = root / f"step-{step:08d}"
    if rank == 0:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
    _barrier()
    _atomic_save(local, folder / f"rank-{rank}.pt")
    if rank == 0:
        _atomic_save(main, folder / "main.pt")
    _barrier()
    if rank == 0:
        _atomic_text(folder.name + "\n", root / LATEST)
        done = sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-"))
        for old in done[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return folder


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The folder ``latest`` points at, or None when there is no complete checkpoint."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    folder = Path(root) / pointer.read_text().strip()
    return folder if (folder / "main.pt").is_file() else None


def load(folder: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(main, local)`` of a checkpoint folder for ``rank`` (``weights_only``: no pickled code)."""
    local_path = folder / f"rank-{rank}.pt"
    if not local_path.is_file():
        raise ValueError(f"checkpoint {folder} has no file for rank {rank}: it was saved by a smaller world")
    main = torch.load(folder / "main.pt", map_location="cpu", weights_only=True)
    local = torch.load(local_path, map_location="cpu", weights_only=True)
    return main, local


def check_identity(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse a checkpoint of another run: ``ValueError`` listing what differs."""
    diff = [f"{k}: saved {saved.get(k)!r}, now {v!r}" for k, v in now.items() if saved.get(k) != v]
    if diff:
        raise ValueError("the checkpoint was saved by a different run (" + "; ".join(diff) + ")")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
