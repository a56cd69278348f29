"""Checkpoint integrity: the manifest of sizes and SHA-256 digests, verified before anything is
loaded; damaged, truncated, missing and old-format files refused naming the file; one rank's
damaged file stops every rank; every rank resumes from the folder rank 0 resolves; pruning never
removes the checkpoint just written, nor a completed checkpoint of a later step.

One 2-rank world (spawned once per module) writes a real checkpoint; the damage cases work on
copies of it in this process."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gradsync.apps.train import checkpoint
from gradsync.apps.train.checkpoint import CheckpointError
from worlds import run_checks, run_world

pytestmark = pytest.mark.timeout(120)

STEP = 7


def _main_state():
    return {
        "model": {"w": torch.linspace(-1, 1, 20000), "b": torch.zeros(3)},
        "optimizer": {"state": {0: {"momentum_buffer": torch.ones(20000)}}, "param_groups": [{"lr": 0.1}]},
        "position": {"epoch": 1, "batch": 3, "global_step": STEP},
        "history": [{"epoch": 1, "train_loss": 0.5}],
    }


def _local_state(rank):
    return {"sync": {"residual": torch.full((8000,), float(rank + 1))}, "rng": torch.get_rng_state()}


def _flip_middle(path: Path, n: int = 256) -> None:
    """Overwrite ``n`` bytes in the middle of a file with different bytes (each one inverted)."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2 - n // 2
    data[mid : mid + n] = bytes(b ^ 0xFF for b in data[mid : mid + n])
    path.write_bytes(bytes(data))


def _two_ranks(root):
    rank = dist.get_rank()
    good, bad = Path(root, "good"), Path(root, "bad")
    checkpoint.save(good, STEP, _main_state(), _local_state(rank), rank, keep=2)
    folder = checkpoint.save(bad, STEP, _main_state(), _local_state(rank), rank, keep=2)
    dist.barrier()  # rank 0 writes the manifests and ``latest`` last

    def check_one_damaged_file_stops_every_rank():
        """Only rank 1's file is damaged, yet both ranks refuse (rank 0 with rank 1's reason)."""
        if rank == 0:
            _flip_middle(folder / "rank-1.pt")
        dist.barrier()
        with pytest.raises(CheckpointError) as err:
            checkpoint.load(checkpoint.latest(bad), rank)
        text = str(err.value)
        assert f"{folder / 'rank-1.pt'} is damaged: its SHA-256 digest does not match the manifest" in text
        if rank == 0:
            assert text.startswith("rank 1 cannot use its checkpoint: ")

    def check_an_intact_checkpoint_loads_on_every_rank():
        main, local = checkpoint.load(checkpoint.latest(good), rank)
        assert main["position"]["global_step"] == STEP
        assert torch.equal(local["sync"]["residual"], torch.full((8000,), float(rank + 1)))

    def check_every_rank_resolves_the_folder_rank_0_sees():
        """Each rank is given its own view of the folder (its own root, a stale ``latest`` on rank
        1): every rank takes the folder rank 0's pointer names; a damaged pointer on rank 0 fails
        every rank with rank 0's reason; no pointer on rank 0 means no checkpoint anywhere."""
        view = Path(root, f"view-{rank}")
        for step in (8, 16):
            (view / f"step-{step:08d}").mkdir(parents=True, exist_ok=True)
        (view / "latest").write_text("step-00000016\n" if rank == 0 else "step-00000008\n")
        assert checkpoint.agreed_latest(view) == view / "step-00000016"
        dist.barrier()
        if rank == 0:
            (view / "latest").write_text("step-x/../../etc\n")
        dist.barrier()
        with pytest.raises(CheckpointError, match="latest is damaged") as err:
            checkpoint.agreed_latest(view)
        assert rank == 0 or str(err.value).startswith("rank 0 cannot resolve the checkpoint: ")
        dist.barrier()
        if rank == 0:
            (view / "latest").unlink()
        dist.barrier()
        assert checkpoint.agreed_latest(view) is None

    run_checks(
        check_one_damaged_file_stops_every_rank,
        check_an_intact_checkpoint_loads_on_every_rank,
        check_every_rank_resolves_the_folder_rank_0_sees,
    )


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    run_world(2, _two_ranks, str(root))
    return root / "good"


@pytest.fixture
def root(saved, tmp_path):
    """A fresh copy of the 2-rank checkpoint."""
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy)
    return copy


def test_manifest_lists_every_file_with_its_size_and_digest(root):
    folder = root / f"step-{STEP:08d}"
    assert (root / "latest").read_text().strip() == folder.name
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["step"] == STEP and manifest["world"] == 2
    assert set(manifest["files"]) == {"main.pt", "rank-0.pt", "rank-1.pt"}
    for name, entry in manifest["files"].items():
        data = (folder / name).read_bytes()
        assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    assert oct(folder.stat().st_mode & 0o777) == oct(0o700)
    main, local = checkpoint.load(folder, 1)
    assert torch.equal(main["model"]["w"], torch.linspace(-1, 1, 20000))
    assert torch.equal(local["sync"]["residual"], torch.full((8000,), 2.0))


def _truncate(path: Path) -> str:
    size = path.stat().st_size
    os.truncate(path, size // 2)
    return f"{path} is truncated: {size // 2} bytes of {size}"


@pytest.mark.parametrize(
    ("name", "damage"),
    [
        ("main.pt", lambda p: _flip_middle(p) or f"{p} is damaged: its SHA-256 digest does not match"),
        ("rank-1.pt", lambda p: _flip_middle(p) or f"{p} is damaged: its SHA-256 digest does not match"),
        ("rank-1.pt", _truncate),
        ("rank-1.pt", lambda p: p.write_bytes(p.read_bytes() + b"?") and f"{p} has {p.stat().st_size} bytes"),
        ("rank-1.pt", lambda p: p.unlink() or f"{p} is missing (the manifest lists it)"),
        ("manifest.json", lambda p: p.unlink() or f"{p} is missing: checkpoint"),
        ("manifest.json", lambda p: _flip_middle(p, 16) or f"{p} is unreadable"),
    ],
    ids=[
        "main-flipped",
        "rank-flipped",
        "rank-truncated",
        "rank-longer",
        "rank-deleted",
        "no-manifest",
        "manifest-garbage",
    ],
)
def test_damaged_checkpoint_is_refused_before_loading(root, name, damage, monkeypatch):
    folder = root / f"step-{STEP:08d}"
    expected = damage(folder / name)

    def no_load(*args, **kwargs):
        raise AssertionError("torch.load ran on an unverified checkpoint")

    monkeypatch.setattr(torch, "load", no_load)
    with pytest.raises(CheckpointError) as err:
        checkpoint.load(checkpoint.latest(root), 1)
    assert expected in str(err.value)


def test_rank_of_a_larger_world_is_refused(root):
    with pytest.raises(CheckpointError, match=r"has no file for rank 2: it was saved by a world of 2 ranks"):
        checkpoint.load(root / f"step-{STEP:08d}", 2)


def test_old_format_checkpoint_without_manifest_is_refused(tmp_path):
    """What gradsync wrote before manifests existed: the files and ``latest``, nothing else."""
    folder = tmp_path / "step-00000005"
    folder.mkdir()
    torch.save(_main_state(), folder / "main.pt")
    torch.save(_local_state(0), folder / "rank-0.pt")
    (tmp_path / "latest").write_text("step-00000005\n")
    with pytest.raises(CheckpointError, match="older gradsync") as err:
        checkpoint.load(checkpoint.latest(tmp_path), 0)
    assert str(folder / "manifest.json") in str(err.value)


def test_damaged_latest_pointer_is_refused(tmp_path):
    (tmp_path / "latest").write_bytes(b"../../etc\n")
    with pytest.raises(CheckpointError, match="latest is damaged: it should name a step-NNNNNNNN folder"):
        checkpoint.latest(tmp_path)
    assert checkpoint.latest(tmp_path / "nothing-here") is None


def test_pruning_keeps_the_checkpoint_just_written(tmp_path):
    """keep=1 with leftovers on both sides: an older checkpoint and a later step's folder from an
    attempt that crashed before finishing it. The new checkpoint stays, both leftovers go."""
    for step in (8, 40):
        checkpoint.save(tmp_path, step, _main_state(), _local_state(0), 0, keep=3)
    (tmp_path / "step-00000040" / "manifest.json").unlink()  # the crashed attempt's half save
    (tmp_path / "latest").write_text("step-00000008\n")
    checkpoint.save(tmp_path, 32, _main_state(), _local_state(0), 0, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-00000032"]
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000032"
    checkpoint.load(tmp_path / "step-00000032", 0)


def test_pruning_never_removes_a_completed_checkpoint_of_a_later_step(tmp_path):
    """A completed later checkpoint is not this run's unfinished save (a resumed run starts from
    ``latest``): another run's, it stays; the unfinished one (no manifest) goes."""
    for step in (40, 48):
        checkpoint.save(tmp_path, step, _main_state(), _local_state(0), 0, keep=3)
    (tmp_path / "step-00000048" / "manifest.json").unlink()
    checkpoint.save(tmp_path, 8, _main_state(), _local_state(0), 0, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-00000008", "step-00000040"]
    checkpoint.load(tmp_path / "step-00000040", 0)


def test_saving_a_step_again_replaces_its_manifest(tmp_path):
    checkpoint.save(tmp_path, 3, _main_state(), _local_state(0), 0, keep=2)
    changed = _main_state()
    changed["position"]["batch"] = 99
    checkpoint.save(tmp_path, 3, changed, _local_state(0), 0, keep=2)
    main, _ = checkpoint.load(checkpoint.latest(tmp_path), 0)
    assert main["position"]["batch"] == 99
