"""The memory tier of the data cache: one store of decoded samples per node, shared by processes.

A :class:`SharedSampleStore` is one file, ``HOME/gradsync-<name>.store``, mapped into every
training process of the node and into the
DataLoader workers forked from them, so a sample is decoded once per node and kept in memory once.
It is filled during the first epoch and read from then on. Standard library and numpy only; no
pickle: a sample is stored as its raw bytes, with its shape and dtype fixed in the file's header.

Layout: a header (magic ``GSSHM001``, slots, sample bytes, dtype, shape; then a 64-byte reserved area
whose first 8 bytes count the slots claimed for writing), then ``slots`` records of
:attr:`~SharedSampleStore.record_bytes` each, 64-byte aligned: a state byte (0 empty, 1 ready),
3 pad bytes, the crc32 of the payload, the payload. The file is sparse: a slot takes memory only
once it is written.

Concurrency: a reader takes no lock; it trusts a slot only when its state is ready *and* the crc
matches, so it never returns a torn or damaged sample. A writer claims the slot's state byte with a
non-blocking POSIX record lock (a slot being written by another process is simply skipped), writes
payload and crc with ``os.pwrite`` and the state byte last. It writes through ``pwrite`` and not
through the mapping because a write into a hole of a full tmpfs through a mapping kills the process
with SIGBUS, while ``pwrite`` fails with ENOSPC: the store then disables itself with one warning and
training goes on from the lower tiers. Record locks belong to the process and are all dropped when
*any* descriptor of the file is closed in it, so each store object keeps its one descriptor, and a
process should open a store once (a second object's ``close`` would drop the first one's claims;
the crc still keeps readers safe). Forked children (DataLoader workers) share the parent's object.

Where the stores live and how long (each process registers, the last one removes the store, a
crashed run's store is reclaimed) is :mod:`gradsync.apps.data.cache.memory_files`.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import struct
import threading
import warnings
import weakref
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from gradsync.apps.data.cache.memory_files import (
    HEADER,
    MAGIC,
    MAX_DIMS,
    open_store,
    private_root,
    pwrite_all,
    release,
    shared_memory,
)

__all__ = [
    "MemoryStats",
    "SharedSampleStore",
]

_COUNT_AT = 128  # the reserved area; its first 8 bytes count the slots claimed for writing
_DATA_AT = 192  # the first record
_COUNT = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_CRC_AT, _PAYLOAD_AT = 4, 8  # inside a record, after the state byte and 3 pad bytes
_READY = 1
_NAME = re.compile(r"[0-9a-z-]{1,64}")
_DTYPES = (
    *("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"),
    *("float16", "float32", "float64"),
)
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)


@dataclass
class MemoryStats:
    """What this store object did. ``misses`` includes ``corrupt`` (crc mismatch) reads; ``refused``
    counts puts not stored because the budget was full, another process was writing the slot or the
    store was disabled (a put of a slot already ready counts nowhere)."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    stored: int = 0
    refused: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class SharedSampleStore:
    """Fixed-shape samples ``slot -> array`` in a file shared by the processes of one node.

    ``name`` (1..64 of ``[0-9a-z-]``) identifies the store under ``root`` (default
    :func:`default_root`); processes that pass the same name share it, and must pass the same
    ``slots``, ``shape`` and ``dtype``. ``max_bytes`` caps the store at ``max_bytes //
    record_bytes`` slots with an admit-first policy: once full, new samples are refused and the
    stored ones stay. Training reads every sample once per epoch, a cyclic scan, under which LRU
    evicts each sample just before it is needed again and hits 0 % whenever the data set is
    larger than the cache; a fixed subset hits ``capacity / data set`` of the reads every epoch.
    """

    def __init__(
        self,
        name: str,
        slots: int,
        shape: tuple[int, ...],
        dtype: np.dtype | str,
        *,
        max_bytes: int | None = None,
        root: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"name must be 1 to 64 characters of [0-9a-z-], got {name!r}")
        self.name = name
        self.slots = _positive_int("slots", slots)
        self.shape = _check_shape(shape)
        self.dtype = _check_dtype(dtype)
        # tuned: the budget of the whole store, checked against the count all processes share
        self.max_bytes = None if max_bytes is None else _positive_int("max_bytes", max_bytes)
        self.enabled = True
        self.stats = MemoryStats()
        self._nbytes = int(np.prod(self.shape)) * self.dtype.itemsize
        self.record_bytes = -(-(_PAYLOAD_AT + self._nbytes) // 64) * 64
        self._parent = Path(root) if root is not None else shared_memory()
        root_dir = private_root(self._parent)
        self.root = root_dir
        self.path = root_dir / f"gradsync-{name}.store"
        # internal: record locks do not exclude threads of one process; this lock does (recreated
        # in a forked child, where a copy could be held by a thread that no longer exists)
        self._thread_lock = threading.Lock()
        self._lock_pid = os.getpid()
        header = HEADER.pack(
            MAGIC, self.slots, self._nbytes, self.dtype.str.encode(), len(self.shape),
            *self.shape, *[0] * (MAX_DIMS - len(self.shape)),
        )  # fmt: skip
        self._handle = open_store(self.path, header, _DATA_AT + self.slots * self.record_bytes)
        self._finalizer = weakref.finalize(self, release, self._handle)

    def get(self, i: int) -> np.ndarray | None:
        """A copy of slot ``i``, or ``None`` if it is not stored (or fails its crc check)."""
        at = self._record_at(i)
        mm = self._map()
        if mm[at] != _READY:
            self.stats.misses += 1
            return None
        (crc,) = _CRC.unpack_from(mm, at + _CRC_AT)
        flat = np.frombuffer(mm, np.uint8, self._nbytes, at + _PAYLOAD_AT).copy()
        if zlib.crc32(flat) != crc:
            self.stats.corrupt += 1
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return flat.view(self.dtype).reshape(self.shape)

    def put(self, i: int, array: np.ndarray) -> bool:
        """Store ``array`` in slot ``i``; ``False`` if not stored (see :class:`MemoryStats`)."""
        at = self._record_at(i)
        if not isinstance(array, np.ndarray) or array.shape != self.shape or array.dtype != self.dtype:
            got = f"{array.shape} {array.dtype}" if isinstance(array, np.ndarray) else type(array).__name__
            raise ValueError(f"array must have shape {self.shape} and dtype {self.dtype}, got {got}")
        mm = self._map()
        if mm[at] == _READY:
            return False
        with self._local_lock():
            if not self.enabled:
                self.stats.refused += 1
                return False
            fd = self._handle.fd
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, at)
            except OSError as err:
                if err.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                self.stats.refused += 1  # another process is writing this slot
                return False
            try:
                return self._write_claimed(mm, at, array.tobytes())
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, at)

    def stored_count(self) -> int:
        """Slots stored by all processes (including any being written now or left half-written by a
        crashed process: the shared count is raised before a slot is written)."""
        return int(_COUNT.unpack_from(self._map(), _COUNT_AT)[0])

    def close(self) -> None:
        """Stop using the store; the last registered user removes it. Idempotent."""
        self._finalizer()

    def __enter__(self) -> SharedSampleStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[object, ...]:
        # a spawned DataLoader worker opens (and registers for) the same store by name
        args = (self.name, self.slots, self.shape, self.dtype.str, self.max_bytes, str(self._parent))
        return (_reopen, args)

    def __repr__(self) -> str:
        return (
            f"SharedSampleStore({self.name!r}, slots={self.slots}, shape={self.shape}, "
            f"dtype={self.dtype}, path={str(self.path)!r}, enabled={self.enabled})"
        )

    def _write_claimed(self, mm: mmap.mmap, at: int, payload: bytes) -> bool:
        if mm[at] == _READY:  # written by another process between our check and our claim
            return False
        if not self._reserve(mm, +1):
            self.stats.refused += 1
            return False
        try:
            fd = self._handle.fd
            pwrite_all(fd, payload, at + _PAYLOAD_AT)
            pwrite_all(fd, _CRC.pack(zlib.crc32(payload)), at + _CRC_AT)
            pwrite_all(fd, bytes([_READY]), at)
        except BaseException as err:
            self._reserve(mm, -1)
            if not isinstance(err, OSError) or err.errno not in _FULL:
                raise
            self.enabled = False
            self.stats.refused += 1
            warnings.warn(
                f"gradsync memory cache {self.name!r}: {self.path.parent} is full "
                f"({err.strerror or err}); the memory tier stops growing and training continues, "
                "reading the samples it lacks from the lower tiers",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        self.stats.stored += 1
        return True

    def _reserve(self, mm: mmap.mmap, step: int) -> bool:
        """Add ``step`` to the shared count, unless that would exceed ``max_bytes``."""
        # The header page was written at creation, so writing the count through the mapping
        # cannot hit a hole (no SIGBUS); the lock is held for microseconds.
        fd = self._handle.fd
        fcntl.lockf(fd, fcntl.LOCK_EX, _COUNT.size, _COUNT_AT)
        try:
            count = _COUNT.unpack_from(mm, _COUNT_AT)[0] + step
            if step > 0 and self.max_bytes is not None and count * self.record_bytes > self.max_bytes:
                return False
            _COUNT.pack_into(mm, _COUNT_AT, max(count, 0))
            return True
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, _COUNT.size, _COUNT_AT)

    def _record_at(self, i: int) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.slots:
            raise IndexError(f"i must be a slot index in [0, {self.slots}), got {i!r}")
        return _DATA_AT + int(i) * self.record_bytes

    def _map(self) -> mmap.mmap:
        if self._handle.closed:
            raise ValueError(f"memory store {self.name!r} is closed")
        return self._handle.mm

    def _local_lock(self) -> threading.Lock:
        if self._lock_pid != os.getpid():
            self._thread_lock, self._lock_pid = threading.Lock(), os.getpid()
        return self._thread_lock


def _reopen(
    name: str, slots: int, shape: tuple[int, ...], dtype: str, max_bytes: int | None, root: str
) -> SharedSampleStore:
    return SharedSampleStore(name, slots, shape, dtype, max_bytes=max_bytes, root=root)


def _positive_int(param: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{param} must be an integer >= 1, got {value!r}")
    return value


def _check_shape(shape: object) -> tuple[int, ...]:
    dims = tuple(shape) if isinstance(shape, (tuple, list)) else ()
    positive = all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in dims)
    if not 1 <= len(dims) <= MAX_DIMS or not positive:
        raise ValueError(f"shape must be a tuple of 1 to {MAX_DIMS} positive integers, got {shape!r}")
    return dims


def _check_dtype(dtype: object) -> np.dtype:
    try:
        dt = None if dtype is None else np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        dt = None
    if dt is None or dt.name not in _DTYPES or not dt.isnative:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} (native byte order), got {dtype!r}")
    return dt
