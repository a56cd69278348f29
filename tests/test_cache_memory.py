"""gradsync.apps.data.cache.memory: the node's shared store of decoded samples.

Expectations are independent of the code under test: samples are recomputed from their index in
every process, the payload to damage is found by searching the file for the sample's bytes, and
lifetimes are checked by listing the directory. Other processes are fresh interpreters that load
memory.py by its path (standard library and numpy only), which starts in a fraction of the time a
``multiprocessing`` spawn child takes to import gradsync (and with it torch).
"""

import errno
import inspect
import json
import os
import pickle
import re
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import numpy as np
import pytest

from gradsync.apps.data.cache import memory
from gradsync.apps.data.cache.memory import MemoryStats, SharedSampleStore
from gradsync.apps.data.cache.memory_files import default_root, reclaim_stale

SHAPE = (3, 32, 32)


def expected(i, shape=SHAPE):
    """Sample ``i``: the same pattern in every process, different for each slot."""
    n = int(np.prod(shape))
    return ((np.arange(n, dtype=np.int64) * (2 * i + 1) + i) % 251).astype(np.uint8).reshape(shape)


# the start of every child: argv = [-c, memory.py, root, name, *args]; memory.py's one gradsync
# import, memory_files.py, is loaded by its path first, under its own name (no package, no torch)
PRELUDE = f"""
import importlib.util, json, os, signal, sys, time
import numpy as np

def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module

load("gradsync.apps.data.cache.memory_files", os.path.join(os.path.dirname(sys.argv[1]), "memory_files.py"))
memory = load("gradsync_memory_child", sys.argv[1])
root, name, args = sys.argv[2], sys.argv[3], sys.argv[4:]
SHAPE = {SHAPE!r}

def wait_for(path, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {{path}}")
        time.sleep(0.001)

{inspect.getsource(expected)}
"""


def child(body, root, name, *args):
    code = PRELUDE + textwrap.dedent(body)
    argv = [sys.executable, "-c", code, memory.__file__, str(root), name, *map(str, args)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, returncode=0, timeout=20):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == returncode, err
    return out


def home(root):
    """This user's folder for stores under ``root`` (what the module makes there)."""
    return Path(root) / f"gradsync-{os.getuid()}"


def listing(root):
    """The stores' files under ``root`` (in this user's folder there; none if it is missing)."""
    folder = home(root)
    if not folder.is_dir():
        return []
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


# ------------------------------------------------------------------------------------- single process


@pytest.mark.parametrize(("dtype", "shape"), [("uint8", (3, 8, 8)), ("float32", (5,))])
def test_roundtrip(tmp_path, dtype, shape):
    rng = np.random.default_rng(0)
    arrays = [(rng.random(shape) * 200).astype(dtype) for _ in range(4)]
    with SharedSampleStore("roundtrip", 6, shape, dtype, root=tmp_path) as store:
        assert store.dtype == np.dtype(dtype) and store.shape == shape
        assert store.record_bytes % 64 == 0 and store.record_bytes >= arrays[0].nbytes
        for i, a in enumerate(arrays):
            assert store.put(i, a) is True
        assert store.put(0, arrays[1]) is False  # slots are written once
        for i, a in enumerate(arrays):
            got = store.get(i)
            assert got is not None and got.dtype == a.dtype and got.shape == a.shape
            assert got.tobytes() == a.tobytes()
        got = store.get(0)
        got[...] = 0  # a copy, not a view of the store
        assert np.array_equal(store.get(0), arrays[0])
        assert store.get(4) is None and store.get(5) is None
        assert store.stored_count() == 4
        assert store.stats == MemoryStats(hits=6, misses=2, stored=4)

        wrong_shape = np.zeros((*shape, 1), dtype)
        wrong_dtype = arrays[0].astype("int64")
        for bad in (wrong_shape, wrong_dtype, arrays[0].tolist()):
            with pytest.raises(ValueError, match="array must have shape"):
                store.put(5, bad)
        for i in (-1, 6, 1.0, True):
            with pytest.raises(IndexError, match="i must be a slot index"):
                store.put(i, arrays[0])
            with pytest.raises(IndexError, match="i must be a slot index"):
                store.get(i)
        assert store.get(5) is None


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"slots": 0}, "slots"),
        ({"slots": True}, "slots"),
        ({"shape": ()}, "shape"),
        ({"shape": (3, 0)}, "shape"),
        ({"shape": (2.0,)}, "shape"),
        ({"dtype": "complex64"}, "dtype"),
        ({"dtype": object}, "dtype"),
        ({"dtype": ">f4"}, "dtype"),
        ({"dtype": None}, "dtype"),
        ({"max_bytes": 0}, "max_bytes"),
        ({"name": ""}, "name"),
        ({"name": "Abc"}, "name"),
        ({"name": "a_b"}, "name"),
        ({"name": "../x"}, "name"),
        ({"name": "x" * 65}, "name"),
        ({"name": 7}, "name"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, param):
    args = {"name": "bad", "slots": 2, "shape": (2,), "dtype": "uint8", **kwargs}
    with pytest.raises(ValueError, match=f"^{param} must"):
        SharedSampleStore(
            args.pop("name"), args.pop("slots"), args.pop("shape"), args.pop("dtype"), root=tmp_path, **args
        )
    assert listing(tmp_path) == []


def test_same_name_other_layout_is_refused(tmp_path):
    with SharedSampleStore("layout", 4, (2, 3), "uint8", root=tmp_path):
        for slots, shape, dtype in [(5, (2, 3), "uint8"), (4, (3, 2), "uint8"), (4, (2, 3), "int8")]:
            with pytest.raises(ValueError, match="already exists with slots=4, shape=\\(2, 3\\)"):
                SharedSampleStore("layout", slots, shape, dtype, root=tmp_path)
        with SharedSampleStore("layout", 4, (2, 3), np.uint8, root=tmp_path):
            pass


def test_corrupt_payload_is_never_returned(tmp_path):
    with SharedSampleStore("corrupt", 4, SHAPE, "uint8", root=tmp_path) as store:
        for i in range(4):
            store.put(i, expected(i))
        raw = store.path.read_bytes()
        at = raw.find(expected(2).tobytes())  # the payload, found without knowing the layout
        assert at > 0 and raw.count(expected(2).tobytes()) == 1
        with open(store.path, "r+b") as f:
            f.seek(at + 100)
            f.write(bytes([raw[at + 100] ^ 0x10]))
        assert store.get(2) is None
        assert store.stats.corrupt == 1 and store.stats.misses == 1
        for i in (0, 1, 3):
            assert np.array_equal(store.get(i), expected(i))
        assert store.put(2, expected(2)) is False  # still marked ready: no silent overwrite


def test_budget_admits_first_and_refuses_the_rest(tmp_path):
    record = SharedSampleStore("probe", 1, SHAPE, "uint8", root=tmp_path).record_bytes
    store = SharedSampleStore("budget", 10, SHAPE, "uint8", max_bytes=3 * record + record // 2, root=tmp_path)
    other = SharedSampleStore("budget", 10, SHAPE, "uint8", max_bytes=3 * record, root=tmp_path)
    results = [store.put(i, expected(i)) for i in range(10)]
    assert results == [True] * 3 + [False] * 7
    assert other.put(9, expected(9)) is False  # the count is shared by all users of the store
    assert store.stats.refused == 7 and store.stats.stored == 3 and other.stats.refused == 1
    assert store.stored_count() == other.stored_count() == 3
    assert [other.get(i) is not None for i in range(10)] == [True] * 3 + [False] * 7
    store.close()
    other.close()


def test_full_tmpfs_warns_once_and_keeps_serving(tmp_path, monkeypatch):
    store = SharedSampleStore("full", 10, SHAPE, "uint8", root=tmp_path)
    assert store.put(0, expected(0)) and store.put(1, expected(1))

    def no_space(fd, data, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(memory.os, "pwrite", no_space)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [store.put(i, expected(i)) for i in range(2, 10)]
    monkeypatch.undo()
    assert results == [False] * 8
    assert [w.category for w in caught] == [RuntimeWarning]
    assert "full" in str(caught[0].message) and "training continues" in str(caught[0].message)
    assert store.enabled is False
    assert store.put(5, expected(5)) is False  # stays disabled once space returns
    assert store.stored_count() == 2  # the failed slot's claim was undone
    assert np.array_equal(store.get(0), expected(0)) and np.array_equal(store.get(1), expected(1))
    assert store.get(2) is None
    store.close()


def test_close_of_the_last_user_removes_the_store(tmp_path):
    first = SharedSampleStore("life", 2, SHAPE, "uint8", root=tmp_path)
    second = SharedSampleStore("life", 2, SHAPE, "uint8", root=tmp_path)
    assert first.path == second.path and (first.path.stat().st_mode & 0o777) == 0o600
    users = home(tmp_path) / "gradsync-life.users"
    assert (users.stat().st_mode & 0o777) == 0o700 and len(list(users.iterdir())) == 2
    first.put(0, expected(0))
    first.close()
    first.close()  # idempotent
    assert listing(tmp_path) == ["gradsync-life.store", "gradsync-life.users"]
    assert np.array_equal(second.get(0), expected(0))
    with pytest.raises(ValueError, match="closed"):
        first.get(0)
    second.close()
    assert listing(tmp_path) == []


def test_default_root_is_shared_memory_and_cleaned_up():
    name = f"test-{os.getpid()}-{os.urandom(4).hex()}"
    with SharedSampleStore(name, 3, SHAPE, "uint8") as store:
        assert store.path.parent == default_root()
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        assert default_root() == home(shm)
        assert stat.S_IMODE(default_root().stat().st_mode) == 0o700
        assert store.put(1, expected(1)) and np.array_equal(store.get(1), expected(1))
    assert not store.path.exists() and not store.path.with_suffix(".users").exists()


def test_pickle_reopens_by_name(tmp_path):
    # what a DataLoader with spawned workers does with a dataset that holds a store
    with SharedSampleStore("reduce", 3, SHAPE, "uint8", root=tmp_path) as store:
        store.put(2, expected(2))
        with pickle.loads(pickle.dumps(store)) as copy:
            assert copy.path == store.path and np.array_equal(copy.get(2), expected(2))
        assert store.path.exists()


# ------------------------------------------------------------------------------------ several processes


def test_two_processes_share_one_copy(tmp_path):
    store = SharedSampleStore("pair", 8, SHAPE, "uint8", root=tmp_path)
    for i in range(5):
        store.put(i, expected(i))
    body = """
    store = memory.SharedSampleStore(name, 8, SHAPE, "uint8", root=root)
    ok = [bool(np.array_equal(store.get(i), expected(i))) for i in range(5)]
    ok.append(store.get(5) is None)
    store.put(6, expected(6))
    print(json.dumps({"ok": ok, "stats": store.stats.as_dict(), "count": store.stored_count()}))
    """
    report = json.loads(finish(child(body, tmp_path, "pair")))
    assert report["ok"] == [True] * 6
    assert report["stats"] == {"hits": 5, "misses": 1, "corrupt": 0, "stored": 1, "refused": 0}
    assert report["count"] == 6
    assert np.array_equal(store.get(6), expected(6)) and store.stored_count() == 6
    # one file; the child deregistered itself at exit, this process is still registered
    assert listing(tmp_path) == ["gradsync-pair.store", "gradsync-pair.users"]
    assert len(list((home(tmp_path) / "gradsync-pair.users").iterdir())) == 1
    store.close()
    assert listing(tmp_path) == []


def test_concurrent_writers_and_readers(tmp_path):
    slots, writers, readers = 1500, 4, 2
    body = """
    role, k, slots = args[0], int(args[1]), int(args[2])
    wait_for(os.path.join(root, "go"))
    store = memory.SharedSampleStore(name, slots, SHAPE, "uint8", root=root)
    report = {"inode": os.stat(store.path).st_ino, "stored": 0, "torn": 0, "complete": False}
    order = np.random.default_rng(k).permutation(slots)
    if role == "writer":
        report["stored"] = sum(store.put(int(i), expected(int(i))) for i in order)
    else:
        deadline, seen = time.monotonic() + 15, set()
        while len(seen) < slots and time.monotonic() < deadline:
            for i in order:
                got = store.get(int(i))
                if got is not None:
                    seen.add(int(i))
                    report["torn"] += not np.array_equal(got, expected(int(i)))
        report["complete"] = len(seen) == slots
    with open(os.path.join(root, f"result-{k}.tmp"), "w") as f:
        json.dump(report, f)
    os.rename(os.path.join(root, f"result-{k}.tmp"), os.path.join(root, f"result-{k}.json"))
    wait_for(os.path.join(root, "release"))  # keep the store until the test has opened it
    """
    roles = ["writer"] * writers + ["reader"] * readers
    procs = [child(body, tmp_path, "many", role, k, slots) for k, role in enumerate(roles)]
    (tmp_path / "go").touch()  # all open, and so race to create, the store at once
    reports, deadline = {}, time.monotonic() + 20
    while len(reports) < len(procs) and time.monotonic() < deadline:
        for k, proc in enumerate(procs):
            path = tmp_path / f"result-{k}.json"
            if k not in reports and path.exists():
                reports[k] = json.loads(path.read_text())
            assert proc.poll() in (None, 0), proc.stderr.read() if proc.stderr else ""
        time.sleep(0.01)
    try:
        assert len(reports) == len(procs)
        with SharedSampleStore("many", slots, SHAPE, "uint8", root=tmp_path) as store:
            assert {r["inode"] for r in reports.values()} == {store.path.stat().st_ino}
            assert sum(reports[k]["stored"] for k in range(writers)) == slots  # each slot written once
            assert all(r["torn"] == 0 for r in reports.values())
            assert all(reports[k]["complete"] for k in range(writers, len(procs)))
            assert store.stored_count() == slots
            assert all(np.array_equal(store.get(i), expected(i)) for i in range(slots))
            assert [p.name for p in home(tmp_path).glob("*.store")] == ["gradsync-many.store"]
    finally:
        (tmp_path / "release").touch()
        for proc in procs:
            finish(proc)
    assert not list(home(tmp_path).glob("*.store"))


def crash(root, names, how):
    """A child opens the stores ``names``, writes a slot of each and dies without cleaning up."""
    body = """
    stores = [memory.SharedSampleStore(each, 4, SHAPE, "uint8", root=root) for each in name.split(",")]
    for store in stores:
        store.put(1, expected(1))
    if args[0] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(0)  # no clean-up runs
    """
    finish(child(body, root, ",".join(names), how), returncode=-signal.SIGKILL if how == "kill" else 0)
    for name in names:
        assert (home(root) / f"gradsync-{name}.store").exists()


def test_stores_of_crashed_processes_are_reclaimed(tmp_path):
    with SharedSampleStore("alive", 4, SHAPE, "uint8", root=tmp_path) as alive:
        alive.put(1, expected(1))
        crash(tmp_path, ["killed", "reused"], "kill")
        # a live pid (ours) with another start time is a reused pid, not the registered process
        (home(tmp_path) / "gradsync-reused.users" / f"{os.getpid()}-1-0").touch()
        assert sorted(reclaim_stale(tmp_path)) == ["killed", "reused"]
        assert listing(tmp_path) == ["gradsync-alive.store", "gradsync-alive.users"]
        crash(tmp_path, ["exited"], "exit")
        assert reclaim_stale(tmp_path) == ["exited"]
        assert reclaim_stale(tmp_path) == []
        # opening a store reclaims too
        crash(tmp_path, ["again"], "kill")
        with SharedSampleStore("other", 2, SHAPE, "uint8", root=tmp_path):
            assert listing(tmp_path) == [
                f"gradsync-{n}.{s}" for n in ("alive", "other") for s in ("store", "users")
            ]
        assert np.array_equal(alive.get(1), expected(1))


def test_store_without_users_is_reclaimed_only_when_old(tmp_path):
    crash(tmp_path, ["orphan"], "exit")
    for entry in (home(tmp_path) / "gradsync-orphan.users").iterdir():
        entry.unlink()
    (home(tmp_path) / "gradsync-orphan.users").rmdir()  # as if it crashed while creating the store
    assert reclaim_stale(tmp_path) == []  # maybe being created right now
    old = time.time() - 120
    os.utime(home(tmp_path) / "gradsync-orphan.store", (old, old))
    assert reclaim_stale(tmp_path) == ["orphan"]
    assert listing(tmp_path) == []


def test_forked_child_reads_and_does_not_deregister(tmp_path):
    store = SharedSampleStore("fork", 6, SHAPE, "uint8", root=tmp_path)
    for i in range(4):
        store.put(i, expected(i))
    pid = os.fork()
    if pid == 0:  # the child, like a DataLoader worker: read, write, close, exit
        code = 1
        try:
            ok = all(np.array_equal(store.get(i), expected(i)) for i in range(4)) and store.get(4) is None
            ok = ok and store.put(4, expected(4))
            store.close()
            code = 0 if ok else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert listing(tmp_path) == ["gradsync-fork.store", "gradsync-fork.users"]
    assert len(list((home(tmp_path) / "gradsync-fork.users").iterdir())) == 1
    assert np.array_equal(store.get(4), expected(4)) and store.stored_count() == 5
    store.close()
    assert listing(tmp_path) == []


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="chown needs root")
def test_files_of_other_users_are_refused(tmp_path):
    store = SharedSampleStore("owned", 2, SHAPE, "uint8", root=tmp_path)
    os.chown(store.path, 12345, 12345)
    with pytest.raises(ValueError, match="not a regular file owned by uid 0"):
        SharedSampleStore("owned", 2, SHAPE, "uint8", root=tmp_path)
    store.close()
    foreign = home(tmp_path) / "gradsync-foreign.store"
    foreign.write_bytes(b"x")
    os.chown(foreign, 12345, 12345)
    old = time.time() - 120
    os.utime(foreign, (old, old))
    assert reclaim_stale(tmp_path) == [] and foreign.exists()  # never touches another user's files


@pytest.mark.parametrize("how", ["symlink", "open to others", "a file", "another owner"])
def test_a_folder_others_could_write_is_refused(tmp_path, how):
    """The stores live in ROOT/gradsync-<uid>, which must be a directory of ours, mode 0700: in a
    world-writable ROOT (/dev/shm) another user could have made that name first."""
    folder = home(tmp_path)
    if how == "symlink":
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
        problem = "a symbolic link"
    elif how == "open to others":
        folder.mkdir()
        folder.chmod(0o777)
        problem = "mode 777, open to other users"
    elif how == "a file":
        folder.write_text("x")
        problem = "not a directory"
    else:
        if os.getuid() != 0:
            pytest.skip("chown needs root")
        folder.mkdir(mode=0o700)
        os.chown(folder, 12345, 12345)
        problem = "owned by uid 12345"
    message = re.escape(f"the memory store's folder {folder} is {problem}; it must be a directory of uid")
    with pytest.raises(ValueError, match=message):
        SharedSampleStore("refused", 2, SHAPE, "uint8", root=tmp_path)
    with pytest.raises(ValueError, match=message):
        reclaim_stale(tmp_path)
    if how == "symlink":
        assert list((tmp_path / "elsewhere").iterdir()) == []  # nothing written through the link


def test_the_private_folder_is_made_with_mode_0700(tmp_path):
    with SharedSampleStore("private", 2, SHAPE, "uint8", root=tmp_path / "new" / "root") as store:
        assert store.path.parent == home(tmp_path / "new" / "root")
        assert stat.S_IMODE(store.path.parent.stat().st_mode) == 0o700
