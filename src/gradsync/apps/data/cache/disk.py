"""The disk tier of the data cache: files from central storage, kept once per node.

Files fetched from central storage (HTTP, S3, ...) are written here so that later epochs and later
runs on the same node read them from local disk instead of fetching them again. All training
processes of a node share one directory, with no locks between them. Standard library only; no
pickle: an entry holds the file's bytes and nothing else that needs decoding.

Layout: ``DIR/v1/<key[:2]>/<key>``, where a key is a sha256 hex string (see :func:`entry_key`).
An entry is a 48-byte header — magic ``GSCACHE1``, the payload length (8 bytes, little-endian),
the sha256 of the payload (32 bytes) — followed by the payload. A read checks all three and
deletes an entry that fails (damaged disk, truncated file): the caller then fetches it again.
The directory and its sub-folders are 0700 and entries 0600; a directory owned by another user is
refused, since whoever can write it could feed us any data.

Atomicity: an entry is written to a temporary file (``.tmp-*``) in its final sub-folder, fsynced and
then renamed onto its final name, so a reader sees either no entry or a whole one. Two processes
writing the same key write the same bytes; the last rename wins. Temporary files older than an hour
were left by writers that crashed, and are removed when a cache object scans the directory.

Eviction: with ``max_bytes`` set, a put that would exceed it first scans the directory and removes
the least recently used entries (oldest mtime; a hit refreshes the mtime) until the total is at
most 90% of ``max_bytes`` minus the new entry. Between scans a process counts only its own writes,
so with several writers the directory can exceed the limit by up to about 10% of ``max_bytes`` per
writer until their next scans; leave that much headroom on the disk.

Failures: when the disk is full, over quota, read-only or not ours to write (ENOSPC, EDQUOT, EROFS,
EACCES, EPERM, EFBIG), the cache object warns once, turns itself off (``enabled = False``) and
from then on misses every get and refuses every put without touching the disk; training goes on
from central storage. Any other OSError is a real fault and propagates.

fsspec has caching file systems of its own; they are not used because they write the cached copy
in place rather than by rename (a concurrent reader can see a partial file), may leave a partial
file behind after a failed fetch, check no digest and have no size limit.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import re
import stat
import struct
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO

_MAGIC = b"GSCACHE1"
_HEADER = struct.Struct("<8sQ32s")  # magic, payload length, sha256 of the payload
HEADER_BYTES = _HEADER.size  # 48: where the payload starts in an entry file
_KEY = re.compile(r"[0-9a-f]{64}")
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600.0  # a temporary file this old belongs to a writer that crashed
_BLOCK = 1 << 20  # read size when verifying a large entry
_EVICT_TO = 0.9  # eviction frees room down to this fraction of max_bytes, so it runs rarely
# errors that mean "this directory cannot take (more) data": the tier turns itself off
_UNUSABLE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG})


@dataclass
class DiskStats:
    """What this cache object did. ``misses`` includes the ``corrupt`` entries found (and deleted);
    ``bytes_read`` and ``bytes_written`` count payload bytes of hits and of stored entries."""

    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    writes: int = 0
    evictions: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def entry_key(*parts: object) -> str:
    """The sha256 hex digest of ``parts``, for use as a cache key.

    ``parts`` may be str, int, bool, float, bytes, None, and tuples or lists of those (a tuple and a
    list with the same items give the same key). Each value is encoded with a type tag and its
    length, so distinct ``parts`` never share an encoding. Any other type raises TypeError: its
    ``repr`` need not be stable from one run to the next.
    """
    h = hashlib.sha256(b"gradsync-disk-key-v1\0")
    _encode(h.update, parts)
    return h.hexdigest()


def _encode(update: Callable[[bytes], None], value: object) -> None:
    if isinstance(value, (tuple, list)):
        update(b"L" + len(value).to_bytes(8, "little"))
        for item in value:
            _encode(update, item)
        return
    if value is None:
        tag, data = b"N", b""
    elif isinstance(value, bool):  # before int: bool is an int subclass, but True is not 1 here
        tag, data = b"B", b"1" if value else b"0"
    elif isinstance(value, int):
        tag, data = b"I", str(int(value)).encode()
    elif isinstance(value, float):
        tag, data = b"F", float(value).hex().encode()
    elif isinstance(value, str):
        tag, data = b"S", value.encode("utf-8", "surrogatepass")
    elif isinstance(value, (bytes, bytearray)):
        tag, data = b"Y", bytes(value)
    else:
        raise TypeError(
            f"entry_key: cannot encode a {type(value).__name__}; use str, int, float, bytes, None "
            "or tuples/lists of those"
        )
    update(tag + len(data).to_bytes(8, "little"))
    update(data)


class DiskCache:
    """Byte strings ``key -> payload`` in files under ``directory``, shared by a node's processes.

    ``max_bytes`` (None: no limit) bounds the entry files' total size; least recently used entries
    are evicted to stay under it. ``enabled`` turns False, with one RuntimeWarning, once the
    directory proved unusable (see the module docstring); the tier then does nothing.
    """

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None = None) -> None:
        if max_bytes is not None and (
            isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0
        ):
            raise ValueError(f"max_bytes must be None (no limit) or an int > 0, got {max_bytes!r}")
        self.directory = Path(directory)
        self.max_bytes = max_bytes
        self.enabled = True
        self.stats = DiskStats()
        self._root = self.directory / "v1"
        self._total = 0  # this process's estimate of the entries' total size, exact after a scan
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise ValueError(f"cache directory {self.directory} is not a directory") from None
        except OSError as err:
            self._give_up(err, stacklevel=3)
            return
        st = os.stat(self.directory)
        if not stat.S_ISDIR(st.st_mode):
            raise ValueError(f"cache directory {self.directory} is not a directory")
        if st.st_uid != os.getuid():
            raise ValueError(
                f"cache directory {self.directory} belongs to uid {st.st_uid}; use a directory of your own"
            )
        try:
            if st.st_mode & 0o077:
                os.chmod(self.directory, 0o700)
            self._root.mkdir(mode=0o700, exist_ok=True)
            self._total = sum(size for _, size, _ in self._scan())
        except OSError as err:
            self._give_up(err, stacklevel=3)

    def get(self, key: str) -> bytes | None:
        """The payload stored under ``key``, or None (missing, corrupt or tier disabled)."""
        path = self._path(key)
        if not self.enabled:
            self.stats.misses += 1
            return None
        try:
            with open(path, "rb") as f:
                length, digest = self._check_header(f)
                payload = f.read() if length is not None else b""
                ok = length is not None and hashlib.sha256(payload).digest() == digest
                if not ok:
                    self._discard(path, os.fstat(f.fileno()))
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        if not ok:
            return None
        self._hit(path, len(payload))
        return payload

    def map_payload(self, key: str) -> memoryview | None:
        """The payload of a verified entry, memory-mapped (read-only); None when missing, corrupt
        or disabled. The digest is checked on the mapping itself, block by block, so a large
        entry is never loaded whole, and what the caller reads is exactly what was verified: an
        entry is never changed in place (writers rename a new file over it, eviction unlinks it),
        and the mapping keeps the verified file alive whatever happens to its name afterwards."""
        path = self._path(key)
        if not self.enabled:
            self.stats.misses += 1
            return None
        try:
            with open(path, "rb") as f:
                length, digest = self._check_header(f)
                ok = length is not None
                if length is not None:
                    whole = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                    view = memoryview(whole)[HEADER_BYTES:]
                    h = hashlib.sha256()
                    for start in range(0, length, _BLOCK):
                        h.update(view[start : start + _BLOCK])
                    ok = h.digest() == digest
                if not ok:
                    self._discard(path, os.fstat(f.fileno()))
        except FileNotFoundError:
            self.stats.misses += 1
            return None
        if length is None or not ok:
            return None
        self._hit(path, length)
        return view

    def put(self, key: str, payload: bytes) -> bool:
        """Store ``payload`` under ``key``; False when not stored (too big for ``max_bytes``, or the
        tier is or just became disabled)."""
        return self._store(self._path(key), (payload,), HEADER_BYTES + len(payload))

    def put_file(self, key: str, chunks: Iterable[bytes]) -> bool:
        """Like :meth:`put`, for a payload streamed in ``chunks`` (it is never held whole). An
        exception raised by ``chunks`` propagates, and nothing is stored."""
        return self._store(self._path(key), chunks, None)

    def size_bytes(self) -> int:
        """This process's estimate of the entries' total size (exact after each scan; other
        processes' writes since then are not counted)."""
        return self._total

    def __repr__(self) -> str:
        return f"DiskCache({str(self.directory)!r}, max_bytes={self.max_bytes}, enabled={self.enabled})"

    def _path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"key must be 64 lowercase hex characters (see entry_key), got {key!r}")
        return self._root / key[:2] / key

    def _check_header(self, f: BinaryIO) -> tuple[int | None, bytes]:
        """Payload length and digest from an entry's header; length None when the header is bad
        or the file's size does not match it (``f`` is then left at the payload)."""
        head = f.read(HEADER_BYTES)
        if len(head) < HEADER_BYTES:
            return None, b""
        magic, length, digest = _HEADER.unpack(head)
        if magic != _MAGIC or os.fstat(f.fileno()).st_size != HEADER_BYTES + length:
            return None, b""
        return length, digest

    def _hit(self, path: Path, length: int) -> None:
        self.stats.hits += 1
        self.stats.bytes_read += length
        try:
            os.utime(path)  # the mtime records the last use, for eviction
        except OSError as err:  # evicted meanwhile, or a read-only disk: the read still counts
            if err.errno != errno.ENOENT and err.errno not in _UNUSABLE:
                raise

    def _discard(self, path: Path, seen: os.stat_result) -> None:
        """Delete a corrupt entry, unless another process has just replaced it with a new file."""
        self.stats.corrupt += 1
        self.stats.misses += 1
        try:
            now = os.stat(path)
            if (now.st_dev, now.st_ino) == (seen.st_dev, seen.st_ino):
                os.unlink(path)
                self._total = max(0, self._total - seen.st_size)
        except FileNotFoundError:
            pass

    def _store(self, path: Path, chunks: Iterable[bytes], size: int | None) -> bool:
        if not self.enabled or (self.max_bytes is not None and size is not None and size > self.max_bytes):
            return False
        tmp: str | None = None
        reading = False
        try:
            if size is not None:
                self._make_room(size)
            path.parent.mkdir(mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=_TMP_PREFIX, dir=path.parent)  # mode 0600
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, 0, bytes(32)))  # rewritten once the digest is known
                h, length, it = hashlib.sha256(), 0, iter(chunks)
                while True:
                    reading = True  # an error now is the source's, not the disk's
                    chunk = next(it, None)
                    reading = False
                    if chunk is None:
                        break
                    length += len(chunk)
                    if self.max_bytes is not None and HEADER_BYTES + length > self.max_bytes:
                        os.unlink(tmp)
                        return False
                    h.update(chunk)
                    f.write(chunk)
                f.seek(0)
                f.write(_HEADER.pack(_MAGIC, length, h.digest()))
                f.flush()
                os.fsync(f.fileno())
            if size is None:
                self._make_room(HEADER_BYTES + length)
            replaced = _size_or_zero(path)
            os.replace(tmp, path)
        except BaseException as exc:
            if tmp is not None:
                _unlink_quietly(tmp)
            if isinstance(exc, OSError) and exc.errno in _UNUSABLE and not reading:
                self._give_up(exc, stacklevel=4)
                return False
            raise
        self._total += HEADER_BYTES + length - replaced
        self.stats.writes += 1
        self.stats.bytes_written += length
        return True

    def _make_room(self, incoming: int) -> None:
        """Evict least recently used entries so that ``incoming`` more bytes fit under max_bytes."""
        if self.max_bytes is None or self._total + incoming <= self.max_bytes:
            return
        entries = self._scan()
        total = sum(size for _, size, _ in entries)
        if total + incoming > self.max_bytes:
            target = int(self.max_bytes * _EVICT_TO) - incoming
            for _, size, path in sorted(entries):  # oldest use first
                if total <= target:
                    break
                try:
                    os.unlink(path)
                    self.stats.evictions += 1
                except FileNotFoundError:  # another process evicted it first
                    pass
                total -= size
        self._total = total

    def _scan(self) -> list[tuple[int, int, str]]:
        """``(mtime_ns, size, path)`` of every entry; removes stale temporary files on the way."""
        found: list[tuple[int, int, str]] = []
        stale_before = time.time() - _STALE_TMP_S
        try:
            with os.scandir(self._root) as folders:
                shards = [d.path for d in folders if d.is_dir(follow_symlinks=False)]
        except FileNotFoundError:  # the directory was removed under us: nothing to count
            return found
        for shard in shards:
            try:
                with os.scandir(shard) as files:
                    for e in files:
                        try:
                            st = e.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue
                        if e.name.startswith(_TMP_PREFIX):
                            if st.st_mtime < stale_before:
                                _unlink_quietly(e.path)
                        elif _KEY.fullmatch(e.name) and stat.S_ISREG(st.st_mode):
                            found.append((st.st_mtime_ns, st.st_size, e.path))
            except FileNotFoundError:
                continue
        return found

    def _give_up(self, err: OSError, stacklevel: int) -> None:
        """Turn the tier off with one warning; ``stacklevel`` points it at our caller's line."""
        if not self.enabled:
            return
        self.enabled = False
        reason = os.strerror(err.errno) if err.errno else str(err)
        warnings.warn(
            f"gradsync disk cache: directory {self.directory} is unusable ({reason}); training "
            "continues without the disk tier, fetching from central storage",
            RuntimeWarning,
            stacklevel=stacklevel,
        )


def _size_or_zero(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
