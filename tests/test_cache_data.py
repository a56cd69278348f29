"""The data cache end to end: an image folder and a token file served by a real HTTP server (the
standard library's, on loopback, port 0) read through fsspec, checked against the local readers
of the same files; the tiers' hits and refetches; the partitioned sampler; and ``gradsync train
--cache`` against the uncached run."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from gradsync.apps.cluster.storage import storage_server
from gradsync.apps.commands import main
from gradsync.apps.data import ShardedSampler, build_data
from gradsync.apps.data.cache.config import CacheConfig
from gradsync.apps.data.cache.partition import PartitionSampler
from gradsync.apps.data.cache.source import is_url
from gradsync.apps.data.loader import load_batch

pytestmark = pytest.mark.timeout(300)

CLASSES = ("circle", "cross", "dot")
PER_CLASS = 24


def _image(label: int, i: int, size: int = 14) -> np.ndarray:
    """A noisy picture whose colour says the class."""
    rng = np.random.default_rng(1000 * label + i)
    px = rng.integers(0, 90, size=(size, size, 3))
    px[..., label] += 150
    return px.clip(0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from PIL import Image

    root = tmp_path_factory.mktemp("store")
    imgs = root / "imgs"
    for label, name in enumerate(CLASSES):
        (imgs / name / "more").mkdir(parents=True)
        for i in range(PER_CLASS):
            sub = imgs / name / ("more" if i % 5 == 0 else "")
            ext = "jpg" if i % 3 == 0 else "png"
            # a space and brackets in names: percent-encoded over HTTP, glob characters for fsspec
            Image.fromarray(_image(label, i)).save(sub / f"{name} [{i:02d}].{ext}")
    (imgs / ".hidden").mkdir()
    (imgs / "circle" / "notes.txt").write_text("not an image")
    tokens = (np.arange(6000) * 7 % 300).astype("<u2")
    tokens.tofile(root / "corpus.bin")
    return root


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[str]:
    """The benchmark's file server (the standard library's threading HTTP server) on loopback."""
    with storage_server(folder) as running:
        yield running.url


def _all(ds: object) -> tuple[torch.Tensor, torch.Tensor]:
    return load_batch(ds, list(range(len(ds))))  # type: ignore[arg-type]


def _same_samples(a: object, b: object) -> None:
    xa, ya = _all(a)
    xb, yb = _all(b)
    assert torch.equal(ya, yb)
    assert torch.equal(xa, xb)


def test_an_image_folder_over_http_is_the_local_folder(folder, server, tmp_path):
    """Read over HTTP (uncached, then through both tiers) the folder gives exactly what the local
    reader gives: classes, split, statistics, pixels and labels."""
    local = build_data(f"imagefolder:{folder / 'imgs'},size=12")
    remote = build_data(f"imagefolder:{server}/imgs,size=12")
    cache = CacheConfig(directory=str(tmp_path / "c"), shm_root=str(tmp_path / "shm"), node=0)
    cached = build_data(f"imagefolder:{server}/imgs,size=12", cache=cache)
    for bundle in (remote, cached):
        assert bundle.num_classes == len(CLASSES) == local.num_classes
        assert bundle.input_shape == local.input_shape == (3, 12, 12)
        _same_samples(bundle.train, local.train)
        _same_samples(bundle.val, local.val)
    assert "uncached" in remote.source and "cached" in cached.source
    # item access agrees with batch access
    x, y = cached.train[5]
    assert torch.equal(x, local.train[5][0]) and int(y) == int(local.train[5][1])
    assert is_url(f"{server}/imgs") and not is_url(str(folder))


def test_the_tiers_serve_repeat_reads_without_central_storage(folder, server, tmp_path):
    """First pass: every file comes from central storage once. A second pass in the same process
    and a new reader of the same node (its memory store is shared) fetch nothing; a reader with a
    fresh memory store but the same disk tier finds every file on disk."""
    cache = CacheConfig(directory=str(tmp_path / "c"), shm_root=str(tmp_path / "shm"), node=0)
    spec = f"imagefolder:{server}/imgs,size=10"
    first = build_data(spec, cache=cache)
    n = len(first.train) + len(first.val)
    setup = first.train.cache_counters()
    _all(first.train), _all(first.val)
    after = first.train.cache_counters()
    files = after["central_files"] - setup["central_files"]
    assert after["central_files"] == n  # statistics' sample plus the rest: each file once
    assert files + setup["central_files"] == n and after["decoded"] == n
    _all(first.train)
    again = first.train.cache_counters()
    assert again["central_files"] == n and again["memory_hits"] - after["memory_hits"] == len(first.train)
    second = build_data(spec, cache=cache)  # same node: attaches to the same store
    _same_samples(second.train, first.train)
    c2 = second.train.cache_counters()
    assert c2["central_files"] == 0 and c2["memory_hits"] == len(first.train) and c2["decoded"] == 0
    other = build_data(spec, cache=CacheConfig(directory=str(tmp_path / "c"), memory=False))
    _same_samples(other.val, first.val)
    c3 = other.train.cache_counters()
    assert c3["central_files"] == 0 and c3["disk_hits"] >= len(first.val)


def test_a_corrupt_disk_entry_is_refetched_never_used(folder, server, tmp_path):
    spec = f"imagefolder:{server}/imgs,size=10"
    cache = CacheConfig(directory=str(tmp_path / "c"), memory=False)
    reference = build_data(spec)
    build_data(spec, cache=cache)  # fills the disk tier with the statistics' sample
    ds = build_data(spec, cache=cache)
    _all(ds.train)
    entries = sorted(p for p in (tmp_path / "c").rglob("*") if p.is_file() and not p.name.startswith("."))
    assert entries
    for i, path in enumerate(entries[::3]):
        data = bytearray(path.read_bytes())
        if i % 2:
            data[-7] ^= 0xFF  # a flipped byte
        else:
            data = data[: len(data) // 2]  # a truncated file
        path.write_bytes(bytes(data))
    fresh = build_data(spec, cache=cache)
    before = fresh.train.cache_counters()["central_files"]
    _same_samples(fresh.train, reference.train)
    _same_samples(fresh.val, reference.val)
    assert fresh.train.cache_counters()["central_files"] > before  # the damaged ones, again


def test_an_unusable_cache_directory_warns_once_and_reads_uncached(folder, server, tmp_path):
    target = tmp_path / "file-not-dir"
    target.write_text("x")
    spec = f"imagefolder:{server}/imgs,size=10"
    reference = build_data(spec)
    # a directory that cannot be created below a file: the disk tier gives up with one warning
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            ds = build_data(spec, cache=CacheConfig(directory=str(target / "cache"), memory=False))
        except ValueError as exc:  # refused outright is as good, if it names the directory
            assert "file-not-dir" in str(exc)
            return
        _same_samples(ds.train, reference.train)
    relevant = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(relevant) == 1 and "file-not-dir" in str(relevant[0].message)


def test_a_token_file_over_http_is_the_local_file(folder, server, tmp_path):
    local = build_data(f"tokens:{folder / 'corpus.bin'}", seq_len=16)
    remote = build_data(f"tokens:{server}/corpus.bin", seq_len=16)
    cache = CacheConfig(directory=str(tmp_path / "c"), memory=False)
    cached = build_data(f"tokens:{server}/corpus.bin", seq_len=16, cache=cache)
    again = build_data(f"tokens:{server}/corpus.bin", seq_len=16, cache=cache)  # from disk now
    for bundle in (remote, cached, again):
        assert bundle.num_classes == local.num_classes == 300
        _same_samples(bundle.train, local.train)
        _same_samples(bundle.val, local.val)


def test_files_without_a_version_are_never_served_from_the_disk_cache(folder, tmp_path):
    """Storage that reports no version (fsspec's memory file system: no ETag, Last-Modified or
    mtime) could replace a file in place with one of the same size, and the disk copy would be
    served stale: such files are read from central storage, with one warning, and the second
    read sees the new content."""
    import fsspec

    fs = fsspec.filesystem("memory")
    old = (np.arange(6000) * 7 % 300).astype("<u2")
    fs.pipe("/versionless/corpus.bin", old.tobytes())
    for name in ("circle", "cross"):
        for i in (1, 2, 4, 7, 8, 11, 13, 14):  # PNGs at the top of the class folder
            fs.pipe(
                f"/versionless/imgs/{name}/{i}.png",
                (folder / "imgs" / name / f"{name} [{i:02d}].png").read_bytes(),
            )
    cache = CacheConfig(directory=str(tmp_path / "c"), memory=False)
    try:
        with pytest.warns(RuntimeWarning, match="has no version on its storage") as said:
            first = build_data("tokens:memory://versionless/corpus.bin", seq_len=16, cache=cache)
        assert len([w for w in said if "no version" in str(w.message)]) == 1
        new = (np.arange(6000) * 11 % 300).astype("<u2")  # the same size, other tokens
        fs.pipe("/versionless/corpus.bin", new.tobytes())
        with pytest.warns(RuntimeWarning, match="has no version on its storage"):
            second = build_data("tokens:memory://versionless/corpus.bin", seq_len=16, cache=cache)
        xa, _ = _all(first.train)
        xb, _ = _all(second.train)
        assert not torch.equal(xa, xb)  # the new file, not a stale copy
        with pytest.warns(RuntimeWarning, match="16 files under memory://versionless/imgs have no version"):
            images = build_data("imagefolder:memory://versionless/imgs,size=14", cache=cache)
            _all(images.train)
        assert not list((tmp_path / "c").rglob("*")) or all(p.is_dir() for p in (tmp_path / "c").rglob("*"))
    finally:
        fs.rm("/versionless", recursive=True)


def test_cache_errors_name_the_option(server, tmp_path):
    with pytest.raises(ValueError, match="--cache applies to data read from files"):
        build_data("digits", cache=CacheConfig(directory=str(tmp_path)))
    with pytest.raises(ValueError, match="memory_max_bytes must be None"):
        CacheConfig(memory_max_bytes=0)
    with pytest.raises(ValueError, match="no-such-folder has no class sub-folders with images"):
        build_data(f"imagefolder:{server}/no-such-folder")


@pytest.mark.parametrize("length,world", [(48, 4), (50, 4), (7, 3), (5, 1)])
def test_partition_parts_are_fixed_and_cover_every_sample_each_epoch(length, world):
    samplers = [PartitionSampler(length, r, world, seed=3) for r in range(world)]
    reference = ShardedSampler(length, 0, world)
    parts = [sorted(s.part) for s in samplers]
    orders = []
    for epoch in range(3):
        seen: list[int] = []
        for s in samplers:
            s.set_epoch(epoch)
            got = list(s)
            assert sorted(got) == sorted(s.part)  # the rank's own part, in some order
            assert len(got) == len(s) == len(reference)
            seen += got
        assert set(seen) == set(range(length))  # every sample at least once ...
        assert len(seen) - length == len(seen) - len(set(seen))  # ... and only padding repeats
        orders.append([list(s) for s in samplers])
    assert [sorted(s.part) for s in samplers] == parts
    if length // world > 3:
        assert orders[0] != orders[1]  # reshuffled within the part
    # parts are not contiguous runs of the index (no rank gets one class of a sorted folder)
    if length >= 48:
        assert parts[0] != list(range(parts[0][0], parts[0][0] + len(parts[0])))


def test_partition_sampler_rejects_bad_arguments():
    for kwargs, message in (
        ({"length": 0, "rank": 0, "world": 1}, "length must be an integer >= 1"),
        ({"length": 4, "rank": 2, "world": 2}, r"rank must be in \[0, world\)"),
        ({"length": 4, "rank": 0, "world": 0}, "world must be an integer >= 1"),
    ):
        with pytest.raises(ValueError, match=message):
            PartitionSampler(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed must be an integer"):
        PartitionSampler(4, 0, 2, seed=1.5)  # type: ignore[arg-type]


TRAIN = ["train", "--nproc", "2", "--model", "vgg-small", "--batch-size", "8", "--quiet", "--epochs", "2"]
TRAIN += ["--scheme", "none", "--sync-option", "calibrate=false"]


def _history(path: Path) -> list[dict[str, float]]:
    return json.loads(path.read_text())["history"]


def test_train_with_the_cache(folder, server, tmp_path, monkeypatch):
    """``gradsync train --data imagefolder:http://... --cache DIR``: with the global shuffle it
    trains exactly like the uncached local folder; partitioned, from epoch 2 every sample comes
    from memory and nothing from central storage; bad cache options fail before any process."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("GRADSYNC_SHM_ROOT", str(tmp_path / "shm"))
    local = [*TRAIN, "--data", f"imagefolder:{folder / 'imgs'},size=16"]
    remote = [*TRAIN, "--data", f"imagefolder:{server}/imgs,size=16", "--cache", str(tmp_path / "c")]
    assert main([*local, "--json", str(tmp_path / "local.json")]) == 0
    assert main([*remote, "--cache-shuffle", "global", "--json", str(tmp_path / "global.json")]) == 0
    assert main([*remote, "--json", str(tmp_path / "part.json")]) == 0
    ref, glob, part = (_history(tmp_path / f"{n}.json") for n in ("local", "global", "part"))
    assert [h["train_loss"] for h in glob] == [h["train_loss"] for h in ref]
    assert [h["val_accuracy"] for h in glob] == [h["val_accuracy"] for h in ref]
    # every sample of a rank's part was loaded in epoch 1 (the part's tail that a full batch
    # leaves out too), so epoch 2 reads memory alone
    assert part[1]["cache_memory_hit"] == 1.0 and part[1]["central_bytes"] == 0
    assert all(h["data_wait_ms"] >= 0 for h in part)


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--cache-memory", "lots"], "--cache-memory must be a size"),
        (["--cache-disk", "0"], "--cache-disk must be a size"),
        (["--cache-shuffle", "random"], "--cache-shuffle must be one of partition, global"),
        (["--cache", "/tmp/x", "--data", "digits"], "--cache applies to data read from files"),
    ],
)
def test_cache_option_errors_come_before_any_process(extra, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--quiet", "--cache", "/tmp/never-made", *extra]) == 2
    assert message in capsys.readouterr().err


def test_a_cached_partitioned_run_resumes_mid_epoch_bit_identically(folder, tmp_path, monkeypatch):
    """Killed mid-epoch and resumed (from a cache that survived, with the memory store of the
    killed run reclaimed): the final parameters equal the uninterrupted run's, bit for bit; a
    checkpoint of the partitioned order is refused by a run with the global one."""
    from gradsync.apps.train import checkpoint

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setenv("GRADSYNC_SHM_ROOT", str(tmp_path / "shm"))
    run = [*TRAIN, "--epochs", "3", "--data", f"imagefolder:{folder / 'imgs'},size=16"]
    run += ["--cache", str(tmp_path / "cache")]

    def final(ckpt: Path) -> dict[str, torch.Tensor]:
        found = checkpoint.latest(ckpt)
        assert found is not None
        return checkpoint.load(found, 0)[0]["model"]

    assert main([*run, "--checkpoint-dir", str(tmp_path / "a")]) == 0
    crashed = [*run, "--checkpoint-dir", str(tmp_path / "b"), "--checkpoint-every", "5"]
    assert main([*crashed, "--crash-at-step", "7"]) == 1
    assert main([*run, "--checkpoint-dir", str(tmp_path / "b"), "--resume"]) == 0
    reference = final(tmp_path / "a")
    for k, v in final(tmp_path / "b").items():
        assert torch.equal(v, reference[k]), k
    assert not list((tmp_path / "shm").glob("gradsync-*.store"))  # every store removed or reclaimed
    assert main([*run, "--checkpoint-dir", str(tmp_path / "b"), "--resume", "--cache-shuffle", "global"]) == 1


def test_tiers_smaller_than_the_data_evict_and_stay_correct(folder, server, tmp_path):
    """A disk tier with room for a third of the files and a memory store for a quarter of the
    samples: every pass returns the right samples, the surplus is fetched again, nothing waits."""
    spec = f"imagefolder:{server}/imgs,size=10"
    reference = build_data(spec)
    total = sum(p.stat().st_size for p in (folder / "imgs").rglob("*.*g"))
    n = len(reference.train) + len(reference.val)
    record = 64 + 3 * 10 * 10  # one slot: state, checksum, padding and the uint8 sample
    cache = CacheConfig(
        directory=str(tmp_path / "c"),
        disk_max_bytes=total // 3,
        memory_max_bytes=(n // 4) * record + record // 2,
        shm_root=str(tmp_path / "shm"),
    )
    ds = build_data(spec, cache=cache)
    for _ in range(3):
        _same_samples(ds.train, reference.train)
    counts = ds.train.cache_counters()
    assert counts["memory_hits"] > 0 and counts["central_files"] > n  # some refetched
    disk_bytes = sum(p.stat().st_size for p in (tmp_path / "c").rglob("*") if p.is_file())
    assert disk_bytes <= total // 3 + total // 10  # the limit, within one writer's slack


def test_a_torch_dataloader_with_worker_processes_reads_the_cache(folder, server, tmp_path):
    """Any training loop: torch's DataLoader with two forked workers and the partition sampler.
    Each worker makes its own HTTP client; the memory store filled by the workers serves the
    next epoch's reads of the parent process."""
    cache = CacheConfig(directory=str(tmp_path / "c"), shm_root=str(tmp_path / "shm"))
    spec = f"imagefolder:{server}/imgs,size=10"
    data = build_data(spec, cache=cache)
    reference = build_data(f"imagefolder:{folder / 'imgs'},size=10")
    sampler = PartitionSampler(len(data.train), 0, 1, seed=0)
    loader = torch.utils.data.DataLoader(
        data.train, batch_size=8, sampler=sampler, num_workers=2, multiprocessing_context="fork"
    )
    seen = []
    for x, y in loader:
        seen.append((x, y))
    order = list(sampler)
    xs, ys = torch.cat([x for x, _ in seen]), torch.cat([y for _, y in seen])
    rx, ry = load_batch(reference.train, order)
    assert torch.equal(xs, rx) and torch.equal(ys, ry)
    before = data.train.cache_counters()
    _all(data.train)  # in this process: everything from the store the workers filled
    after = data.train.cache_counters()
    assert after["memory_hits"] - before["memory_hits"] == len(data.train)
    assert after["central_files"] == before["central_files"]
