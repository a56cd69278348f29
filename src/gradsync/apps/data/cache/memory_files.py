"""The files of the data cache's memory tier: where the stores live, the store file's header,
creating and opening a store, registering the processes that use it, and removing it once its last
user is gone or dead. :mod:`gradsync.apps.data.cache.memory` reads and writes the samples in it.
Standard library only.

Where: ``HOME`` is ``ROOT/gradsync-<uid>``, a folder of this user's alone (mode 0700), under
``ROOT``: ``/dev/shm`` (a RAM-backed tmpfs) where it exists, else the temporary directory, or the
``root`` given (``GRADSYNC_SHM_ROOT`` for ``gradsync train``). ``/dev/shm`` is writable by every
local user, who could otherwise pre-create or link a store's names; a ``HOME`` that is not a real
directory of ours with mode 0700 (a symbolic link, another owner, a wider mode) is refused.

Lifetime: each process using a store registers itself in ``HOME/gradsync-<name>.users/`` (its pid
and start time, so a reused pid is not mistaken for it);
:meth:`~gradsync.apps.data.cache.memory.SharedSampleStore.close` (also run at exit) deregisters it and
removes the store once no user is left. A crashed run leaves its store behind;
:func:`reclaim_stale`, also run whenever a store is opened, removes stores whose users are all
dead. These steps hold an exclusive ``flock`` on ``HOME/gradsync-cache-<uid>.lock``.
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
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"GSSHM001"
MAX_DIMS = 8
# magic, slots, sample bytes, dtype (numpy's dtype.str), ndim, shape padded with zeros
HEADER = struct.Struct(f"<8sQQ16sI{MAX_DIMS}Q")
_STORE_FILE = re.compile(r"gradsync-([0-9a-z-]{1,64})\.store")
_STALE_AFTER_S = 60.0  # a store without users dir this old was left by a crash during creation
_LOCK_TIMEOUT_S = 30.0


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


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
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


def open_store(store: Path, header: bytes, size: int) -> _Handle:
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
        pwrite_all(fd, header, 0)
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
    if len(header) < HEADER.size or not header.startswith(MAGIC):
        return "a header that is not a gradsync store's"
    _, slots, _, dtype, ndim, *dims = HEADER.unpack_from(header)
    dtype_str = dtype.rstrip(b"\0").decode(errors="replace")
    return f"slots={slots}, shape={tuple(dims[:ndim])}, dtype={dtype_str!r}"


def release(h: _Handle) -> None:
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
