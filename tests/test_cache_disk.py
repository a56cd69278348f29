"""The disk tier of the data cache (gradsync.apps.data.cache.disk): entry format checked byte by byte
against hashlib, corruption detection, atomic writes under several processes, LRU eviction, and
the one-warning shutdown when the directory cannot take data (simulated, and a real EFBIG)."""

import errno
import hashlib
import os
import random
import resource
import signal
import stat
import struct
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from gradsync.apps.data.cache import disk
from gradsync.apps.data.cache.disk import DiskCache, DiskStats, entry_key
from worlds import process_context

HEADER = 48


def entry_path(directory, key):
    return Path(directory) / "v1" / key[:2] / key


def parse_entry(path):
    """An entry file decoded independently of the module: (magic, length, digest, payload)."""
    raw = Path(path).read_bytes()
    magic, (length,), digest = raw[:8], struct.unpack("<Q", raw[8:16]), raw[16:48]
    return magic, length, digest, raw[48:]


def files_under(directory):
    return [Path(root) / name for root, _, names in os.walk(directory) for name in names]


def entries_total(directory):
    return sum(p.stat().st_size for p in files_under(directory) if not p.name.startswith(".tmp-"))


def test_stats_as_dict():
    s = DiskStats(hits=2, bytes_read=7)
    assert s.as_dict() == {
        "hits": 2,
        "misses": 0,
        "corrupt": 0,
        "writes": 0,
        "evictions": 0,
        "bytes_read": 7,
        "bytes_written": 0,
    }


# --- keys ------------------------------------------------------------------------------------


def test_entry_key_is_sha256_hex_and_separates_values():
    k = entry_key("file", "s3://b/x.jpg", 1234, "etag=abc", ("rgb", 224, 0.5, None, b"\x00"))
    assert len(k) == 64 and k == k.lower() and int(k, 16) >= 0
    assert k == entry_key("file", "s3://b/x.jpg", 1234, "etag=abc", ["rgb", 224, 0.5, None, b"\x00"])
    distinct = [
        ("ab",),
        ("a", "b"),
        (("a", "b"),),
        ("a", ("b",)),
        (1,),
        ("1",),
        (1.0,),
        (True,),
        (b"1",),
        (None,),
        ((),),
        (),
        (2**70,),
        (-(2**70),),
        (0.0,),
        (-0.0,),
    ]
    assert len({entry_key(*p) for p in distinct}) == len(distinct)


@pytest.mark.parametrize("bad", [object(), {"a": 1}, {1}, Path("/x"), 1j, [1, object()]])
def test_entry_key_rejects_other_types(bad):
    with pytest.raises(TypeError, match="entry_key"):
        entry_key("x", bad)


@pytest.mark.parametrize(
    "key", ["../" + "0" * 61, "A" * 64, "0" * 63, "0" * 65, "g" * 64, "0" * 63 + "\n", b"0" * 64, 7]
)
def test_bad_keys_are_rejected(tmp_path, key):
    cache = DiskCache(tmp_path / "c")
    calls = (cache.get, cache.map_payload, lambda k: cache.put(k, b"x"), lambda k: cache.put_file(k, []))
    for call in calls:
        with pytest.raises(ValueError, match="key"):
            call(key)
    assert files_under(tmp_path / "c") == []


# --- the directory ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, "100"])
def test_max_bytes_is_validated(tmp_path, bad):
    with pytest.raises(ValueError, match=r"max_bytes.*None.*int > 0"):
        DiskCache(tmp_path, max_bytes=bad)


def test_directory_is_created_private(tmp_path):
    d = tmp_path / "a" / "b" / "cache"
    cache = DiskCache(d, max_bytes=10_000)
    assert cache.enabled and cache.directory == d and cache.size_bytes() == 0
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    key = entry_key("k")
    assert cache.put(key, b"payload")
    p = entry_path(d, key)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    for folder in (d / "v1", p.parent):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_open_directory_is_made_private(tmp_path):
    d = tmp_path / "shared"
    d.mkdir()
    d.chmod(0o775)
    DiskCache(d)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_directory_of_another_user_is_refused(tmp_path):
    if os.getuid() != 0:
        pytest.skip("giving a directory to another uid needs root")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, 54321, 54321)
    with pytest.raises(ValueError, match=r"belongs to uid 54321; use a directory of your own") as e:
        DiskCache(d)
    assert str(d) in str(e.value)
    assert list(d.iterdir()) == []  # nothing was created in it


def test_path_that_is_not_a_directory_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    for path in (f, f / "below"):
        with pytest.raises(ValueError, match="not a directory"):
            DiskCache(path)


def test_start_removes_stale_temp_files_and_counts_entries(tmp_path):
    first = DiskCache(tmp_path)
    payloads = {entry_key(i): os.urandom(100 * i + 1) for i in range(5)}
    for key, payload in payloads.items():
        assert first.put(key, payload)
    shard = entry_path(tmp_path, next(iter(payloads))).parent
    old, fresh = shard / ".tmp-crashed", shard / ".tmp-writing"
    old.write_bytes(b"x" * 1000)
    fresh.write_bytes(b"y" * 1000)
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    second = DiskCache(tmp_path)
    assert not old.exists() and fresh.exists()  # a writer may still be busy with the fresh one
    expected = sum(entry_path(tmp_path, k).stat().st_size for k in payloads)
    assert expected == sum(HEADER + len(p) for p in payloads.values())
    assert second.size_bytes() == expected == first.size_bytes()


# --- entries ---------------------------------------------------------------------------------


def test_entry_format_and_round_trip(tmp_path):
    cache = DiskCache(tmp_path)
    key, payload = entry_key("round trip"), os.urandom(5000)
    assert cache.get(key) is None
    assert cache.put(key, payload)
    magic, length, digest, body = parse_entry(entry_path(tmp_path, key))
    assert magic == b"GSCACHE1" and length == len(payload) and body == payload
    assert digest == hashlib.sha256(payload).digest()
    assert cache.get(key) == payload
    assert cache.put(key, b"") and cache.get(key) == b""
    assert cache.size_bytes() == HEADER == entries_total(tmp_path)
    assert cache.stats.as_dict() == {
        "hits": 2,
        "misses": 1,
        "corrupt": 0,
        "writes": 2,
        "evictions": 0,
        "bytes_read": len(payload),
        "bytes_written": len(payload),
    }
    assert DiskCache(tmp_path).get(key) == b""  # another process (object) sees it


def test_hit_refreshes_mtime(tmp_path):
    cache = DiskCache(tmp_path)
    a, b = entry_key("a"), entry_key("b")
    cache.put(a, b"aaa")
    cache.put(b, b"bbb")
    for key in (a, b):
        os.utime(entry_path(tmp_path, key), (1_000_000_000, 1_000_000_000))
    before = time.time() - 1
    assert cache.get(a) == b"aaa"
    assert cache.map_payload(b) is not None
    for key in (a, b):
        assert entry_path(tmp_path, key).stat().st_mtime >= before


def test_put_file_streams_and_map_payload_maps(tmp_path):
    cache = DiskCache(tmp_path)
    key = entry_key("big")
    chunks = [os.urandom(n) for n in (1, 0, 70_000, 1 << 20, 3)]
    payload = b"".join(chunks)
    assert cache.put_file(key, iter(chunks))
    path = entry_path(tmp_path, key)
    expected = (b"GSCACHE1", len(payload), hashlib.sha256(payload).digest(), payload)
    assert parse_entry(path) == expected
    found = cache.map_payload(key)
    assert found is not None and found.readonly and found.nbytes == len(payload)
    assert np.frombuffer(found, dtype=np.uint8).tobytes() == payload
    assert cache.stats.writes == 1 and cache.stats.bytes_written == len(payload)
    assert cache.stats.hits == 1 and cache.stats.bytes_read == len(payload)
    assert cache.map_payload(entry_key("absent")) is None and cache.stats.misses == 1


def test_a_mapped_payload_is_what_was_verified_whatever_happens_to_the_entry(tmp_path):
    """Between the digest check and the reads, another process may evict the entry (unlink) or
    replace it (a re-fetch renames a new file over it): the mapping still reads the verified
    bytes, never the new file, never a missing one."""
    cache = DiskCache(tmp_path)
    key, first = entry_key("moving"), os.urandom(200_000)
    cache.put(key, first)
    mapped = cache.map_payload(key)
    assert mapped is not None
    other = DiskCache(tmp_path)
    entry_path(tmp_path, key).unlink()  # evicted
    assert bytes(mapped) == first
    assert other.put(key, os.urandom(200_000))  # fetched again, different bytes, same name
    assert bytes(mapped) == first
    again = cache.map_payload(key)
    assert again is not None and bytes(again) != first


def test_put_file_failure_of_the_source_leaves_nothing(tmp_path):
    cache = DiskCache(tmp_path)

    def chunks():
        yield b"x" * 1000
        raise PermissionError(errno.EACCES, "central storage refused")  # the source's, not ours

    with pytest.raises(PermissionError, match="central storage"):
        cache.put_file(entry_key("k"), chunks())
    assert cache.enabled  # a source error does not turn the disk tier off
    assert files_under(tmp_path) == []
    assert cache.stats.writes == 0 and cache.size_bytes() == 0


def _damage(path, how):
    raw = bytearray(path.read_bytes())
    if how == "flipped payload byte":
        raw[HEADER + 10] ^= 0x01
    elif how == "flipped digest byte":
        raw[20] ^= 0x80
    elif how == "bad magic":
        raw[:8] = b"GSCACHE0"
    elif how == "truncated":
        raw = raw[:-1]
    elif how == "extra byte":
        raw += b"\x00"
    elif how == "header only":
        raw = raw[:HEADER]
    elif how == "torn header":
        raw = raw[:30]
    elif how == "empty":
        raw = bytearray()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("reader", ["get", "map_payload"])
@pytest.mark.parametrize(
    "how",
    [
        "flipped payload byte",
        "flipped digest byte",
        "bad magic",
        "truncated",
        "extra byte",
        "header only",
        "torn header",
        "empty",
    ],
)
def test_corrupt_entry_is_deleted_and_missed(tmp_path, reader, how):
    cache = DiskCache(tmp_path)
    key, payload = entry_key("victim"), os.urandom(3000)
    cache.put(key, payload)
    path = entry_path(tmp_path, key)
    _damage(path, how)
    assert getattr(cache, reader)(key) is None
    assert not path.exists()
    assert cache.stats.corrupt == 1 and cache.stats.misses == 1 and cache.stats.hits == 0
    assert cache.enabled
    assert cache.put(key, payload) and cache.get(key) == payload  # the refetched copy is good


# --- eviction --------------------------------------------------------------------------------


def test_lru_eviction_keeps_the_most_recent_under_the_limit(tmp_path):
    size = 1000
    max_bytes = 5 * (HEADER + size)
    cache = DiskCache(tmp_path, max_bytes=max_bytes)
    keys = [entry_key("lru", i) for i in range(20)]
    payloads = [os.urandom(size) for _ in keys]
    for i, (key, payload) in enumerate(zip(keys, payloads, strict=True)):
        assert cache.put(key, payload)
        # explicit, strictly increasing last-use times: the file system clock may be coarse
        os.utime(entry_path(tmp_path, key), (1_600_000_000 + i, 1_600_000_000 + i))
        assert entries_total(tmp_path) <= max_bytes
        assert cache.size_bytes() == entries_total(tmp_path)
    alive = [i for i, k in enumerate(keys) if entry_path(tmp_path, k).exists()]
    assert alive == list(range(20 - len(alive), 20))  # exactly the most recently used survive
    assert 3 <= len(alive) <= 5
    assert cache.stats.evictions == 20 - len(alive)
    for i in alive:
        assert cache.get(keys[i]) == payloads[i]


def test_eviction_spares_an_entry_just_read(tmp_path):
    size = 1000
    cache = DiskCache(tmp_path, max_bytes=5 * (HEADER + size))
    keys = [entry_key("spare", i) for i in range(5)]
    for i, key in enumerate(keys):
        cache.put(key, bytes([i]) * size)
        os.utime(entry_path(tmp_path, key), (1_600_000_000 + i, 1_600_000_000 + i))
    assert cache.get(keys[0]) == bytes([0]) * size  # now the most recently used
    assert cache.put(entry_key("new"), b"n" * size)
    # room is made down to 90% of the limit minus the new entry: the two oldest unread ones go
    assert [entry_path(tmp_path, k).exists() for k in keys] == [True, False, False, True, True]
    assert cache.stats.evictions == 2


def test_eviction_tolerates_entries_vanishing(tmp_path, monkeypatch):
    cache = DiskCache(tmp_path, max_bytes=4 * (HEADER + 100))
    for i in range(4):
        assert cache.put(entry_key("gone", i), b"g" * 100)
    real_scan = cache._scan

    def scan_then_another_process_evicts():
        found = real_scan()
        for _, _, path in found:
            os.unlink(path)
        return found

    monkeypatch.setattr(cache, "_scan", scan_then_another_process_evicts)
    new = entry_key("new")
    assert cache.put(new, b"n" * 100)
    assert cache.stats.evictions == 0  # the other process evicted them, not this one
    assert [p.name for p in files_under(tmp_path)] == [new]
    assert cache.get(new) == b"n" * 100


def test_entry_bigger_than_the_limit_is_not_stored(tmp_path):
    cache = DiskCache(tmp_path, max_bytes=1000)
    small = entry_key("small")
    assert cache.put(small, b"s" * 100)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not cache.put(entry_key("big"), b"b" * 1000)  # 1000 + header > limit
        assert not cache.put_file(entry_key("big file"), (b"c" * 300 for _ in range(10)))
    assert cache.enabled
    assert [p.name for p in files_under(tmp_path)] == [small]  # no entry, no temp file left
    assert cache.get(small) == b"s" * 100 and cache.stats.evictions == 0


# --- failures --------------------------------------------------------------------------------


def _refuse(err):
    def refuse(*args, **kwargs):
        refuse.calls += 1
        raise OSError(err, os.strerror(err))

    refuse.calls = 0
    return refuse


@pytest.mark.parametrize(
    ("target", "err"),
    [("tempfile.mkstemp", errno.EROFS), ("os.replace", errno.ENOSPC), ("os.fsync", errno.EDQUOT)],
)
def test_unusable_directory_warns_once_and_turns_off(tmp_path, monkeypatch, target, err):
    cache = DiskCache(tmp_path)
    kept = entry_key("kept")
    assert cache.put(kept, b"before")
    module, name = target.split(".")
    refuse = _refuse(err)
    monkeypatch.setattr(getattr(disk, module), name, refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(50):
            assert cache.put(entry_key(i), b"x" * 100) is False
            assert cache.put_file(entry_key("f", i), [b"y"]) is False
            assert cache.get(kept) is None and cache.map_payload(kept) is None
    assert refuse.calls == 1  # after giving up, nothing touches the disk
    assert len(caught) == 1
    w = caught[0]
    assert w.category is RuntimeWarning and w.filename == __file__  # points at our put
    message = str(w.message)
    assert str(tmp_path) in message and os.strerror(err) in message
    assert "continues without the disk tier" in message
    assert not cache.enabled
    assert [p.name for p in files_under(tmp_path)] == [kept]  # the temp file was removed


def test_other_os_errors_propagate(tmp_path, monkeypatch):
    cache = DiskCache(tmp_path)
    monkeypatch.setattr(disk.os, "replace", _refuse(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        cache.put(entry_key("k"), b"x")
    assert cache.enabled and files_under(tmp_path) == []


def test_unusable_directory_at_start_turns_off(tmp_path, monkeypatch):
    d = tmp_path / "ro"
    d.mkdir(mode=0o755)
    d.chmod(0o755)
    monkeypatch.setattr(disk.os, "chmod", _refuse(errno.EROFS))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = DiskCache(d)
        assert cache.put(entry_key("k"), b"x") is False and cache.get(entry_key("k")) is None
    assert not cache.enabled and len(caught) == 1 and caught[0].filename == __file__
    assert str(d) in str(caught[0].message) and "Read-only file system" in str(caught[0].message)
    assert list(d.iterdir()) == []


def _with_file_size_limit(directory):
    """Child process: files may grow to 64 KiB only, so writing an entry fails with EFBIG."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills us instead of failing
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    small = entry_key("small")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = DiskCache(directory)
        results = [cache.put(small, b"fits")]
        results += [cache.put(entry_key(i), bytes(1 << 20)) for i in range(10)]
        results += [cache.put_file(entry_key("f"), [bytes(1 << 16)] * 4)]
        mapped = cache.map_payload(small)
        gets = [cache.get(small), cache.get(entry_key(0)), None if mapped is None else bytes(mapped)]
    return {
        "results": results,
        "gets": gets,
        "enabled": cache.enabled,
        "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught],
        "files": sorted(p.name for p in files_under(directory)),
    }


def test_real_file_size_limit_efbig(tmp_path):
    with ProcessPoolExecutor(1, mp_context=process_context()) as pool:
        out = pool.submit(_with_file_size_limit, str(tmp_path)).result(timeout=120)
    assert out["results"] == [True] + [False] * 11
    assert out["gets"] == [None, None, None] and out["enabled"] is False
    assert len(out["warnings"]) == 1
    category, message, filename = out["warnings"][0]
    assert category == "RuntimeWarning" and filename == __file__
    assert str(tmp_path) in message and os.strerror(errno.EFBIG) in message
    assert out["files"] == [entry_key("small")]  # the failed temp file is gone


# --- several processes -----------------------------------------------------------------------

N_KEYS = 8


def _expected(i):
    return hashlib.sha256(str(i).encode()).digest() * (100 + 300 * i)  # 3.2 KiB .. 70 KiB


def _hammer(directory, seed, rounds, max_bytes):
    """Child process: random puts, streamed puts and reads of shared keys; counts wrong reads."""
    cache = DiskCache(directory, max_bytes=max_bytes)
    rng = random.Random(seed)
    wrong = 0
    for _ in range(rounds):
        i = rng.randrange(N_KEYS)
        key, want = entry_key("hammer", i), _expected(i)
        op = rng.randrange(4)
        if op == 0:
            cache.put(key, want)
        elif op == 1:
            cache.put_file(key, (want[j : j + 4096] for j in range(0, len(want), 4096)))
        elif op == 2:
            got = cache.get(key)
            wrong += got is not None and got != want
        else:
            found = cache.map_payload(key)
            if found is not None:  # still what was verified, if evicted or replaced meanwhile
                wrong += bytes(found) != want
    return {"wrong": wrong, **cache.stats.as_dict()}


def test_concurrent_processes_never_see_partial_entries(tmp_path):
    max_bytes = sum(HEADER + len(_expected(i)) for i in range(N_KEYS)) // 2  # forces evictions
    with ProcessPoolExecutor(4, mp_context=process_context()) as pool:  # processes of their own
        futures = [pool.submit(_hammer, str(tmp_path), seed, 300, max_bytes) for seed in range(4)]
        outs = [f.result(timeout=120) for f in futures]
    assert sum(o["wrong"] for o in outs) == 0
    assert sum(o["corrupt"] for o in outs) == 0  # a reader never saw a partly written entry
    assert sum(o["hits"] for o in outs) > 0 and sum(o["writes"] for o in outs) > 0
    assert sum(o["evictions"] for o in outs) > 0
    left = files_under(tmp_path)
    assert not [p for p in left if p.name.startswith(".tmp-")]
    by_name = {entry_key("hammer", i): i for i in range(N_KEYS)}
    for p in left:
        magic, length, digest, body = parse_entry(p)
        want = _expected(by_name[p.name])
        assert (magic, length, digest, body) == (b"GSCACHE1", len(want), hashlib.sha256(want).digest(), want)


def test_module_avoids_pickle_and_torch():
    source = Path(disk.__file__).read_text()
    for banned in ("pickle", "torch"):
        assert f"import {banned}" not in source and f"from {banned}" not in source
