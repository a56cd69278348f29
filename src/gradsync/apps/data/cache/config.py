"""What a cached dataset is told about its cache: where the disk tier lives, how big each tier may
grow, and which node this process is on."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from gradsync.apps.data.cache.disk import DiskCache
from gradsync.apps.data.cache.memory import SharedSampleStore


def node_index() -> int:
    """This process's node under torchrun (``GROUP_RANK``), else 0."""
    raw = os.environ.get("GROUP_RANK", "0")
    return int(raw) if raw.isdigit() else 0


def _optional_size(name: str, value: object) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
        raise ValueError(f"{name} must be None (no limit) or a positive number of bytes, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """The caching of one dataset.

    ``directory``: the disk tier (``None``: none); a ``{node}`` in it is replaced by the node
    index, for nodes that share one filesystem (the emulated cluster). ``memory``: keep decoded
    samples in the node's shared memory store, a file in this user's folder ``gradsync-<uid>``
    under ``shm_root`` (default: the environment's ``GRADSYNC_SHM_ROOT``, else ``/dev/shm``). The
    limits are bytes (``None``: no limit). ``storage_options`` go to fsspec (credentials,
    timeouts, ...).
    """

    directory: str | None = None
    disk_max_bytes: int | None = None
    memory: bool = True
    memory_max_bytes: int | None = None
    node: int = field(default_factory=node_index)
    shm_root: str | None = field(default_factory=lambda: os.environ.get("GRADSYNC_SHM_ROOT"))
    storage_options: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        _optional_size("disk_max_bytes", self.disk_max_bytes)
        _optional_size("memory_max_bytes", self.memory_max_bytes)
        if isinstance(self.node, bool) or not isinstance(self.node, int) or self.node < 0:
            raise ValueError(f"node must be an integer >= 0, got {self.node!r}")
        if self.directory is not None and (not isinstance(self.directory, str) or not self.directory):
            raise ValueError(f"--cache must be a directory path, got {self.directory!r}")

    def disk_directory(self) -> str | None:
        if self.directory is None:
            return None
        return os.path.expanduser(self.directory.replace("{node}", str(self.node)))

    def build_disk(self) -> DiskCache | None:
        path = self.disk_directory()
        return None if path is None else DiskCache(path, self.disk_max_bytes)

    def build_memory(
        self, fingerprint: str, slots: int, shape: tuple[int, ...], dtype: DTypeLike
    ) -> SharedSampleStore | None:
        """This node's store for a dataset whose decoded samples ``fingerprint`` identifies."""
        if not self.memory:
            return None
        digest = hashlib.sha256(f"{fingerprint}|{shape}|{np.dtype(dtype).str}".encode()).hexdigest()
        return SharedSampleStore(
            f"{digest[:32]}-n{self.node}",
            slots,
            shape,
            np.dtype(dtype),
            max_bytes=self.memory_max_bytes,
            root=self.shm_root,
        )
