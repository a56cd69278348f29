"""The three levels a sample comes from, fastest first: the node's memory store of decoded
samples, the node's disk copy of the source files, and central storage.

:class:`SampleTiers` serves one dataset's decoded samples by slot number. A batch's misses in
memory are looked up on disk together, what disk lacks is fetched from central storage in one
concurrent request batch and kept on disk, every file fetched or read from disk is decoded, and
the decoded sample is offered to the memory store. The disk tier holds the files exactly as
central storage has them, so it is keyed by the file alone (URL, size, version) and different
transforms of one dataset share it; the memory tier holds decoded samples, so its store's name
also covers the decode settings (and the node, since emulated nodes share one ``/dev/shm``).

Counters (:meth:`SampleTiers.counters`) say where each sample came from and what it cost, so a
training loop can report per-epoch hit rates, bytes fetched and decode time.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gradsync.apps.data.cache.disk import DiskCache, entry_key
from gradsync.apps.data.cache.memory import SharedSampleStore
from gradsync.apps.data.cache.source import RemoteFile, Storage, StorageError

Decoder = Callable[[bytes, RemoteFile], np.ndarray]

COUNTERS = (
    "memory_hits",
    "disk_hits",
    "central_files",
    "central_bytes",
    "decoded",
    "decode_s",
    "fetch_s",
    "load_s",
)


@dataclass
class _Counts:
    values: dict[str, float] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0.0))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, **amounts: float) -> None:
        with self.lock:
            for key, amount in amounts.items():
                self.values[key] += amount


class SampleTiers:
    """Decoded samples ``slot -> array`` backed by memory, disk and central storage.

    ``files[slot]`` is the source file of each slot; ``decode(bytes, file)`` turns its bytes into
    the array the memory store keeps (fixed shape and dtype). ``disk`` and ``memory`` are each
    optional; without both every sample is fetched and decoded each time it is asked for.
    """

    def __init__(
        self,
        storage: Storage,
        files: Sequence[RemoteFile],
        decode: Decoder,
        *,
        disk: DiskCache | None = None,
        memory: SharedSampleStore | None = None,
    ) -> None:
        if memory is not None and memory.slots != len(files):
            raise ValueError(f"the memory store has {memory.slots} slots for {len(files)} files")
        self.storage = storage
        self.files = list(files)
        self.decode = decode
        self.disk = disk
        self.memory = memory
        self._counts = _Counts()
        # without a version a changed file keeps its key: its disk copy could be stale, so the
        # disk tier does not hold such files (their decoded samples still go to memory)
        self._unversioned = {i for i, f in enumerate(self.files) if not f.version}
        if disk is not None and self._unversioned:
            warnings.warn(
                f"{len(self._unversioned)} files under {storage.url} have no version on their storage "
                "(no ETag, Last-Modified or modification time), so a cached copy could not tell that "
                "one changed: they are read from central storage, not from the disk cache",
                RuntimeWarning,
                stacklevel=2,
            )

    def counters(self) -> dict[str, float]:
        """Cumulative counts of this process: hits per tier, files and bytes fetched from central
        storage, samples decoded and seconds spent decoding, fetching and loading in all."""
        with self._counts.lock:
            return dict(self._counts.values)

    def raw(self, slots: Sequence[int]) -> list[bytes]:
        """The source files' bytes (disk, else central storage, which then fills disk)."""
        out: list[bytes | None] = [None] * len(slots)
        keys = [self._key(self.files[s]) for s in slots]
        disk = self.disk
        if disk is not None and disk.enabled:
            for j, key in enumerate(keys):
                if slots[j] not in self._unversioned:
                    out[j] = disk.get(key)
        want = [j for j, b in enumerate(out) if b is None]
        self._counts.add(disk_hits=len(slots) - len(want))
        if want:
            t0 = time.perf_counter()
            fetched = self.storage.fetch([self.files[slots[j]].url for j in want])
            self._counts.add(
                fetch_s=time.perf_counter() - t0,
                central_files=len(want),
                central_bytes=sum(len(b) for b in fetched),
            )
            for j, data in zip(want, fetched, strict=True):
                f = self.files[slots[j]]
                if len(data) != f.size:
                    raise StorageError(
                        f"{f.url} has {len(data)} bytes but was listed with {f.size}: it changed "
                        "on central storage during the run; restart to list it again"
                    )
                if disk is not None and disk.enabled and slots[j] not in self._unversioned:
                    disk.put(keys[j], data)
                out[j] = data
        return [b for b in out if b is not None]

    def load(self, slots: Sequence[int]) -> list[np.ndarray]:
        """The decoded samples of ``slots``, in order."""
        t0 = time.perf_counter()
        out: list[np.ndarray | None] = [None] * len(slots)
        memory = self.memory
        if memory is not None:
            for j, s in enumerate(slots):
                out[j] = memory.get(s)
        want = [j for j, a in enumerate(out) if a is None]
        self._counts.add(memory_hits=len(slots) - len(want))
        if want:
            raw = self.raw([slots[j] for j in want])
            t1 = time.perf_counter()
            for j, data in zip(want, raw, strict=True):
                array = self.decode(data, self.files[slots[j]])
                if memory is not None and memory.enabled:
                    memory.put(slots[j], array)
                out[j] = array
            self._counts.add(decoded=len(want), decode_s=time.perf_counter() - t1)
        self._counts.add(load_s=time.perf_counter() - t0)
        return [a for a in out if a is not None]

    @staticmethod
    def _key(f: RemoteFile) -> str:
        return entry_key("file", f.url, f.size, f.version)

    def close(self) -> None:
        if self.memory is not None:
            self.memory.close()
