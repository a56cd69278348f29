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

Where: ``HOME`` is ``ROOT/gradsync-<uid>``, a folder of this user's alone (mode 0700), under
``ROOT``: ``/dev/shm`` (a RAM-backed tmpfs) where it exists, else the temporary directory, or the
``root`` given (``GRADSYNC_SHM_ROOT`` for ``gradsync train``). ``/dev/shm`` is writable by every
local user, who could otherwise pre-create or link a store's names; a ``HOME`` that is not a real
directory of ours with mode 0700 (a symbolic link, another owner, a wider mode) is refused.

Lifetime: each process using a store registers itself in ``HOME/gradsync-<name>.users/`` (its pid
and start time, so a reused pid is not mistaken for it); :meth:`~SharedSampleStore.close` (also run
at exit) deregisters it and removes the store once no user is left. A crashed run leaves its store
behind; :func:`reclaim_stale`, also run whenever a store is opened, removes stores whose users are
all dead. These steps hold an exclusive ``flock`` on ``HOME/gradsync-cache-<uid>.lock``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import re
import shutil
import stat
import struct
import tempfile
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GSSHM001"
_MAX_DIMS = 8
# magic, slots, sample bytes, dtype (numpy's dtype.str), ndim, shape padded with zeros
_HEADER = struct.Struct(f"<8sQQ16sI{_MAX_DIMS}Q")
_COUNT_AT = 128  # the reserved area; its first 8 bytes count the slots claimed for writing
_DATA_AT = 192  # the first record
_COUNT = struct.Struct("<Q")
_CRC = struct.Struct("<I")
_CRC_AT, _PAYLOAD_AT = 4, 8  # inside a record, after the state byte and 3 pad bytes
_READY = 1
_NAME = re.compile(r"[0-9a-z-]{1,64}")
_STORE_FILE = re.compile(r"gradsync-([0-9a-z-]{1,64})\.store")
_DTYPES = (
    *("bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64"),
    *("float16", "float32", "float64"),
)
_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_STALE_AFTER_S = 60.0  # a store without users dir this old was left by a crash during creation
_LOCK_TIMEOUT_S = 30.0


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


@dataclass
class _Handle:
    """The resources of one store object, apart from it so that ``weakref.finalize`` can free them."""

    fd: int
    mm: mmap.mmap
    store: Path
    users: Path
    entry: Path  # this process's registration
    pid: int  # the process that registered: forked children must not deregister it
    closed: bool = False


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
        header = _HEADER.pack(
            _MAGIC, self.slots, self._nbytes, self.dtype.str.encode(), len(self.shape),
            *self.shape, *[0] * (_MAX_DIMS - len(self.shape)),
        )  # fmt: skip
        self._handle = _open(self.path, header, _DATA_AT + self.slots * self.record_bytes)
        self._finalizer = weakref.finalize(self, _release, self._handle)

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
            _pwrite_all(fd, payload, at + _PAYLOAD_AT)
            _pwrite_all(fd, _CRC.pack(zlib.crc32(payload)), at + _CRC_AT)
            _pwrite_all(fd, bytes([_READY]), at)
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


def shared_memory() -> Path:
    """``/dev/shm`` (memory-backed) where it is a directory, else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() else Path(tempfile.gettempdir())


def default_root() -> Path:
    """Where the stores live by default: this user's folder under :func:`shared_memory`."""
    return private_root(shared_memory())


def private_root(parent: str | os.PathLike[str]) -> Path:
    """``parent/gradsync-<uid>``, made with mode 0700 if missing. ``ValueError`` when that name is
    anything but a directory of this user with no access for others (a symbolic link, another
    owner, a wider mode): whoever can write in it could pre-create or swap a store's files."""
    uid = os.getuid()
    home = Path(parent) / f"gradsync-{uid}"
    Path(parent).mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        home.mkdir(mode=0o700)
    st = home.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        problem = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a directory"
    elif st.st_uid != uid:
        problem = f"owned by uid {st.st_uid}"
    elif st.st_mode & 0o077:
        problem = f"mode {stat.S_IMODE(st.st_mode):o}, open to other users"
    else:
        return home
    raise ValueError(
        f"gradsync: the memory store's folder {home} is {problem}; it must be a directory of uid {uid} "
        "with mode 0700. Remove it (it is made again), or point GRADSYNC_SHM_ROOT elsewhere"
    )


def reclaim_stale(root: str | os.PathLike[str] | None = None) -> list[str]:
    """Remove the stores of this user under ``root`` (default :func:`shared_memory`) whose
    registered users are all dead; returns their names."""
    parent = Path(root) if root is not None else shared_memory()
    if not os.path.lexists(parent / f"gradsync-{os.getuid()}"):
        return []  # nothing was ever stored there
    home = private_root(parent)
    with _registry_lock(home):
        return _reclaim_locked(home)


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
    if not 1 <= len(dims) <= _MAX_DIMS or not positive:
        raise ValueError(f"shape must be a tuple of 1 to {_MAX_DIMS} positive integers, got {shape!r}")
    return dims


def _check_dtype(dtype: object) -> np.dtype:
    try:
        dt = None if dtype is None else np.dtype(dtype)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        dt = None
    if dt is None or dt.name not in _DTYPES or not dt.isnative:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)} (native byte order), got {dtype!r}")
    return dt


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        if n == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view, offset = view[n:], offset + n


@contextmanager
def _registry_lock(root: Path) -> Iterator[None]:
    """Serialize creation, registration and removal of stores under ``root`` across processes."""
    uid = os.getuid()
    path = root / f"gradsync-cache-{uid}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        if os.fstat(fd).st_uid != uid:
            raise ValueError(f"{path} is owned by another user; refusing to use it")
        deadline = time.monotonic() + _LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{path} stayed locked for {_LOCK_TIMEOUT_S:.0f} s") from None
                time.sleep(0.002)
        yield
    finally:
        os.close(fd)  # releases the flock


def _open(store: Path, header: bytes, size: int) -> _Handle:
    """Open (creating if absent) and register the store; checks its owner and header."""
    root, name = store.parent, store.name[len("gradsync-") : -len(".store")]
    users = root / f"gradsync-{name}.users"
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    mm: mmap.mmap | None = None
    with _registry_lock(root):
        _reclaim_locked(root)
        try:
            fd = os.open(store, flags)
        except FileNotFoundError:
            fd = _create(store, header, size, flags)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise ValueError(f"{store} is not a regular file owned by uid {os.getuid()}; refusing it")
            found = os.pread(fd, len(header), 0)
            if found != header:
                raise ValueError(
                    f"memory store {name!r} already exists with {_describe(found)}, but this process "
                    f"asked for {_describe(header)}; give a store of other contents another name"
                )
            if st.st_size != size:
                raise ValueError(f"{store} has {st.st_size} bytes, expected {size}: it is damaged")
            users.mkdir(mode=0o700, exist_ok=True)
            ust = users.lstat()
            if not stat.S_ISDIR(ust.st_mode) or ust.st_uid != os.getuid():
                raise ValueError(f"{users} is not a directory owned by uid {os.getuid()}; refusing it")
            mm = mmap.mmap(fd, 0)
            pid = os.getpid()
            entry = users / f"{pid}-{_start_time(pid)}-{os.urandom(4).hex()}"
            efd = os.open(entry, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(efd, "w") as f:
                f.write(_pid_namespace())
        except BaseException:
            if mm is not None:
                mm.close()
            os.close(fd)
            raise
    return _Handle(fd, mm, store, users, entry, pid)


def _create(store: Path, header: bytes, size: int, flags: int) -> int:
    """A complete new store file, linked into place only if none is there (atomic, no replace)."""
    tmp = store.with_name(f"{store.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # we hold the registry lock: a leftover of a crashed process
    fd = os.open(tmp, flags | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _pwrite_all(fd, header, 0)
        os.ftruncate(fd, size)  # sparse: a slot takes memory once written
        os.link(tmp, store)
    except FileExistsError:  # another user's store of this name; the owner check refuses it
        os.close(fd)
        fd = os.open(store, flags)
    except BaseException:
        os.close(fd)
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return fd


def _describe(header: bytes) -> str:
    if len(header) < _HEADER.size or not header.startswith(_MAGIC):
        return "a header that is not a gradsync store's"
    _, slots, _, dtype, ndim, *dims = _HEADER.unpack_from(header)
    dtype_str = dtype.rstrip(b"\0").decode(errors="replace")
    return f"slots={slots}, shape={tuple(dims[:ndim])}, dtype={dtype_str!r}"


def _release(h: _Handle) -> None:
    """Close the handle; in the registering process also deregister, removing the store if last."""
    if h.closed:
        return
    h.closed = True
    try:
        if os.getpid() == h.pid:
            with _registry_lock(h.store.parent):
                h.entry.unlink(missing_ok=True)
                now, ours = os.stat(h.store), os.fstat(h.fd)
                same_file = (now.st_dev, now.st_ino) == (ours.st_dev, ours.st_ino)
                if same_file and h.users.is_dir() and not _any_user_alive(h.users):
                    _remove(h.store, h.users)
    except (OSError, ValueError):
        pass  # best effort: reclaim_stale removes what a failed clean-up leaves
    finally:
        h.mm.close()
        os.close(h.fd)


def _reclaim_locked(root: Path) -> list[str]:
    uid, now, removed = os.getuid(), time.time(), []
    for path in sorted(root.glob("gradsync-*")):
        try:
            st = path.lstat()
        except FileNotFoundError:
            continue
        match = _STORE_FILE.fullmatch(path.name)
        old = now - st.st_mtime > _STALE_AFTER_S
        if st.st_uid != uid:
            continue
        if match and stat.S_ISREG(st.st_mode):
            users = root / f"gradsync-{match.group(1)}.users"
            if (not _any_user_alive(users)) if users.is_dir() else old:
                _remove(path, users)
                removed.append(match.group(1))
        elif path.name.endswith(".tmp") and old:
            path.unlink(missing_ok=True)  # a crash during creation
        elif (
            path.name.endswith(".users")
            and stat.S_ISDIR(st.st_mode)
            and not path.with_suffix(".store").exists()
            and not _any_user_alive(path)
        ):
            shutil.rmtree(path, ignore_errors=True)  # a crash during removal
    return removed


def _remove(store: Path, users: Path) -> None:
    store.unlink(missing_ok=True)
    if users.is_dir() and not users.is_symlink():
        shutil.rmtree(users, ignore_errors=True)


def _any_user_alive(users: Path) -> bool:
    """Whether a process registered in ``users`` (entries ``<pid>-<start time>-<random>``) runs."""
    own_ns = _pid_namespace()
    try:
        names = os.listdir(users)
    except OSError:
        return True  # unreadable: keep the store
    for name in names:
        pid, _, rest = name.partition("-")
        if not pid.isdigit():
            continue
        try:
            ns = (users / name).read_text()
        except OSError:
            ns = ""
        if ns and own_ns and ns != own_ns:
            return True  # a process of another pid namespace (container): we cannot check it
        if _alive(int(pid), rest.partition("-")[0]):
            return True
    return False


def _alive(pid: int, start: str) -> bool:
    """Whether ``pid`` runs and is the process that registered (same start time; zombies are dead)."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    fields = _proc_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X") and start in ("0", fields[19])


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` from the third (state) on, or ``None``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw.rsplit(b")", 1)[1].decode().split()  # the command name may contain ") "


def _start_time(pid: int) -> str:
    fields = _proc_stat(pid)
    return fields[19] if fields else "0"  # field 22: start time in clock ticks after boot


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
