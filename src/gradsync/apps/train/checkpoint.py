"""Training checkpoints: consistent across ranks, atomic on disk, verified before they are read.

A checkpoint is a folder ``step-NNNNNNNN`` with

- ``main.pt`` (rank 0): model, optimizer, scheduler, GradScaler, position (epoch, batch in the
  epoch, global step), the epoch history so far, and what the run was (data fingerprint, model,
  scheme, world) so that a resume under other settings is refused;
- ``rank-R.pt`` (every rank): that rank's gradsync engine state (error-feedback residuals and
  the like differ between ranks) and its RNG states;
- ``manifest.json`` (rank 0, written last): the size and SHA-256 of every file above.

Every file is written to a temporary name and renamed, so a crash never leaves a half-written
file under a real name. Each rank hashes its own file after writing it; the ranks then exchange
their (size, digest) pairs as one small uint8 all-gather (no pickle), which also guarantees that
every rank's file exists, and only then rank 0 writes the manifest and points ``latest`` at the
folder (both atomically). So ``latest`` only ever names a folder whose manifest exists, and a
checkpoint is used only once every rank's part of it exists. Older folders beyond ``keep`` are
removed afterwards, and so are unfinished folders of later steps (a crashed attempt's); a
completed checkpoint of a later step is never removed. ``gradsync train`` refuses to start afresh
in a folder that holds a run's checkpoints (``--resume`` continues it), and on resuming every
rank loads the folder rank 0 resolved (:func:`agreed_latest`). The folder is created with mode
0700.

Loading checks before anything is unpickled: the manifest exists and is well formed, and
``main.pt`` and this rank's file have the recorded size and digest. Each file is opened once,
hashed from that open handle and then read by ``torch.load(..., weights_only=True)`` from the
same handle, so what is loaded is what was verified. Under a process group the ranks agree on
the outcome (one all-gather of a short message), so a damaged file of one rank stops every rank
with the same :class:`CheckpointError`. A folder without a manifest (written by gradsync before
checkpoints carried digests, or whose save never finished) is refused rather than trusted.

Why not safetensors: it holds one flat ``name -> tensor`` map, while the optimizer and scheduler
state, the history and the engine state are nested dicts and lists of tensors and plain values;
fitting them in would mean a home-made flattening format on top. It also keeps no digest of its
data, so flipped bytes inside a tensor load silently there too. ``weights_only=True`` already
keeps code out of loading; the manifest adds the integrity check.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

LATEST = "latest"
MANIFEST = "manifest.json"
MAIN = "main.pt"
FORMAT = "gradsync.checkpoint/2"
_FOLDER = re.compile(r"^step-(\d{8,})$")
_HEX = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20
_MESSAGE_BYTES = 1024  # room for one rank's error message in the load agreement


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: missing, damaged, or not verifiable. The
    message names the file and what is wrong with it."""


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def _digest(fh: IO[bytes]) -> str:
    """SHA-256 of an open binary file from its current position to its end, in chunks."""
    h = hashlib.sha256()
    while chunk := fh.read(_CHUNK):
        h.update(chunk)
    return h.hexdigest()


def file_digest(path: str | os.PathLike[str]) -> tuple[int, str]:
    """``(size in bytes, SHA-256 hex digest)`` of a file, read in chunks."""
    with open(path, "rb") as fh:
        return os.fstat(fh.fileno()).st_size, _digest(fh)


def _atomic_save(obj: Any, path: Path) -> tuple[int, str]:
    """Write ``obj`` with ``torch.save`` under a temporary name, hash it, rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w+b") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())
        fh.seek(0)
        size, digest = os.fstat(fh.fileno()).st_size, _digest(fh)
    os.replace(tmp, path)
    return size, digest


def _atomic_text(text: str, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def save(
    root: str | os.PathLike[str], step: int, main: dict[str, Any], local: dict[str, Any], rank: int, keep: int
) -> Path:
    """Write this rank's part of the checkpoint of ``step`` (``main`` is written by rank 0 only).
    Every rank must call it (it has collectives when a process group exists)."""
    root = Path(root)
    folder = root / f"step-{step:08d}"
    if rank == 0:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.mkdir(mode=0o700, exist_ok=True)
        # the folder may hold an older save of the same step (a run started again in the same
        # directory): it stops counting as a checkpoint before any of its files changes
        pointer = root / LATEST
        if pointer.is_file() and pointer.read_text(errors="replace").strip() == folder.name:
            pointer.unlink()
        (folder / MANIFEST).unlink(missing_ok=True)
    _barrier()
    mine = _atomic_save(local, folder / rank_file(rank))
    files = {MAIN: _atomic_save(main, folder / MAIN)} if rank == 0 else {}
    every = _gather_digests(*mine)  # also the barrier: every rank's file is in place after it
    if rank == 0:
        files.update({rank_file(r): entry for r, entry in enumerate(every)})
        manifest = {
            "format": FORMAT,
            "step": step,
            "world": len(every),
            "files": {name: {"size": size, "sha256": digest} for name, (size, digest) in files.items()},
        }
        _atomic_text(json.dumps(manifest, indent=1) + "\n", folder / MANIFEST)
        _atomic_text(folder.name + "\n", root / LATEST)
        _prune(root, step, keep)
    return folder


def _prune(root: Path, step: int, keep: int) -> None:
    """Keep the checkpoint of ``step`` and the ``keep - 1`` newest before it. A folder of a later
    step without a manifest is the unfinished save of an attempt that did not get this far: it
    goes too. A later folder with a manifest is a completed checkpoint that this run did not
    resume from (another run's): it stays."""
    found = sorted(
        (int(m.group(1)), p) for p in root.iterdir() if (m := _FOLDER.match(p.name)) and p.is_dir()
    )
    older = [p for s, p in found if s < step]
    unfinished = [p for s, p in found if s > step and not (p / MANIFEST).is_file()]
    doomed = older[: max(len(older) - (keep - 1), 0)] + unfinished
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)


def latest(root: str | os.PathLike[str]) -> Path | None:
    """The folder ``latest`` points at, or None when no checkpoint was ever completed there.
    Whether that folder is usable is :func:`load`'s to check."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{pointer} is unreadable ({e})") from None
    if not _FOLDER.match(name):
        raise CheckpointError(
            f"{pointer} is damaged: it should name a step-NNNNNNNN folder, holds {name[:40]!r}"
        )
    return Path(root) / name


def agreed_latest(root: str | os.PathLike[str]) -> Path | None:
    """:func:`latest` as rank 0 reads it, on every rank (one broadcast of the folder's name; the
    same :class:`CheckpointError` everywhere when rank 0 cannot read the pointer). Each rank
    reading the pointer itself could see another folder: rank 0 may be moving it, or a shared
    file system may show it late. Every rank must call it (a collective under a process group)."""
    if _world() == 1:
        return latest(root)
    mine = torch.zeros(_MESSAGE_BYTES + 1, dtype=torch.uint8)
    if dist.get_rank() == 0:
        try:
            found = latest(root)
            status, raw = (0, b"") if found is None else (1, found.name.encode())
        except CheckpointError as e:
            status, raw = 2, str(e).encode()[:_MESSAGE_BYTES]
        mine[0] = status
        if raw:
            mine[1 : 1 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    mine = mine.to(_device())
    dist.broadcast(mine, 0)
    row = mine.cpu()
    text = bytes(row[1:].tolist()).rstrip(b"\0").decode(errors="replace")
    status = int(row[0])
    if status == 2:
        raise CheckpointError(
            text if dist.get_rank() == 0 else f"rank 0 cannot resolve the checkpoint: {text}"
        )
    if status == 0:
        return None
    if not _FOLDER.match(text):  # what rank 0 sent was checked there; check it here too
        raise CheckpointError(f"rank 0 named an unusable checkpoint folder {text[:40]!r}")
    return Path(root) / text


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, checked for form (``CheckpointError`` otherwise)."""
    path = folder / MANIFEST
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if not path.is_file():
        raise CheckpointError(
            f"{path} is missing: checkpoint {folder} was written by an older gradsync (without "
            "checksums) or its save did not finish, so it cannot be verified and is not used; "
            "remove the folder (and its 'latest' pointer) to start afresh"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable ({e})") from None
    problem = _manifest_problem(manifest)
    if problem:
        raise CheckpointError(f"{path} is unreadable ({problem})")
    return manifest


def _manifest_problem(m: Any) -> str | None:
    if not isinstance(m, dict):
        return "not a JSON object"
    if m.get("format") != FORMAT:
        return f"format {m.get('format')!r}, expected {FORMAT!r}"
    if not isinstance(m.get("world"), int) or not isinstance(m.get("files"), dict):
        return "no 'world' count or 'files' table"
    for name, entry in m["files"].items():
        ok = (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and entry["size"] >= 0
            and isinstance(entry.get("sha256"), str)
            and _HEX.match(entry["sha256"])
        )
        if not ok:
            return f"bad entry for {name!r}"
    return None


def _open_verified(folder: Path, name: str, entry: dict[str, Any]) -> IO[bytes]:
    """Open a checkpoint file, check its size and digest against its manifest entry and return
    the handle rewound to the start (the caller reads exactly what was checked)."""
    path = folder / name
    try:
        fh = open(path, "rb")  # noqa: SIM115 - handed to the caller, who closes it
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing (the manifest lists it)") from None
    except OSError as e:
        raise CheckpointError(f"{path} is unreadable ({e})") from None
    try:
        size, want = os.fstat(fh.fileno()).st_size, entry["size"]
        if size < want:
            raise CheckpointError(f"{path} is truncated: {size} bytes of {want}")
        if size > want:
            raise CheckpointError(
                f"{path} has {size} bytes, the manifest says {want}: it changed after the save"
            )
        if _digest(fh) != entry["sha256"]:
            raise CheckpointError(
                f"{path} is damaged: its SHA-256 digest does not match the manifest "
                "(right size, other content)"
            )
        fh.seek(0)
    except OSError as e:
        fh.close()
        raise CheckpointError(f"{path} is unreadable ({e})") from None
    except BaseException:
        fh.close()
        raise
    return fh


def _open_parts(folder: Path, rank: int) -> tuple[IO[bytes], IO[bytes]]:
    manifest = read_manifest(folder)
    files = manifest["files"]
    if rank_file(rank) not in files:
        raise CheckpointError(
            f"checkpoint {folder} has no file for rank {rank}: it was saved by a world of "
            f"{manifest['world']} ranks"
        )
    if MAIN not in files:
        raise CheckpointError(f"{folder / MANIFEST} is unreadable (it does not list {MAIN})")
    main = _open_verified(folder, MAIN, files[MAIN])
    try:
        local = _open_verified(folder, rank_file(rank), files[rank_file(rank)])
    except BaseException:
        main.close()
        raise
    return main, local


def load(folder: Path, rank: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(main, local)`` of a checkpoint folder for ``rank``, after verifying both files against
    the manifest (``CheckpointError`` naming the file otherwise). ``weights_only``: no pickled
    code. Under a process group every rank must call it: they agree, so one rank's damaged file
    fails every rank."""
    error: CheckpointError | None = None
    parts: tuple[IO[bytes], IO[bytes]] | None = None
    try:
        parts = _open_parts(folder, rank)
    except CheckpointError as e:
        error = e
    error = _agree(error)
    if error is not None:
        if parts is not None:
            for fh in parts:
                fh.close()
        raise error
    assert parts is not None
    with parts[0] as main_fh, parts[1] as local_fh:
        main = torch.load(main_fh, map_location="cpu", weights_only=True)
        local = torch.load(local_fh, map_location="cpu", weights_only=True)
    return main, local


def saved_world(folder: Path) -> int:
    """How many ranks saved the checkpoint in ``folder`` (its manifest's count; checked for form)."""
    return int(read_manifest(folder)["world"])


def load_every_rank(folder: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``(main, [rank 0's local, rank 1's, ...])``: every rank's file, each verified against the
    manifest first, for a run resumed with another number of ranks (an outer loop's resize sums
    what every old rank's error feedback owed). Under a process group every rank must call it:
    they agree on the outcome, as in :func:`load`."""
    error: CheckpointError | None = None
    handles: list[IO[bytes]] = []
    try:
        manifest = read_manifest(folder)
        files = manifest["files"]
        names = [MAIN] + [rank_file(r) for r in range(int(manifest["world"]))]
        for name in names:
            if name not in files:
                raise CheckpointError(f"{folder / MANIFEST} does not list {name}")
            handles.append(_open_verified(folder, name, files[name]))
    except CheckpointError as e:
        error = e
    error = _agree(error)
    if error is not None:
        for fh in handles:
            fh.close()
        raise error
    loaded = []
    for fh in handles:
        with fh:
            loaded.append(torch.load(fh, map_location="cpu", weights_only=True))
    return loaded[0], loaded[1:]


def check_identity(saved: dict[str, Any], now: dict[str, Any]) -> None:
    """Refuse a checkpoint of another run: ``ValueError`` listing what differs. A key that only
    one side has counts as a difference (options are recorded only when given)."""
    keys = list(now) + [k for k in saved if k not in now]
    diff = [f"{k}: saved {saved.get(k)!r}, now {now.get(k)!r}" for k in keys if saved.get(k) != now.get(k)]
    if diff:
        raise ValueError("the checkpoint was saved by a different run (" + "; ".join(diff) + ")")


# ---------------------------------------------------------------------- collectives
def _world() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def _device() -> torch.device:
    from gradsync.collectives.primitives import comm_device

    return comm_device(None)  # the default group's


def _barrier() -> None:
    if _world() > 1:
        dist.barrier()


def _gather_digests(size: int, digest: str) -> list[tuple[int, str]]:
    """Every rank's ``(size, digest)`` of its own file, gathered as raw bytes (8 + 32 per rank)."""
    raw = size.to_bytes(8, "little") + bytes.fromhex(digest)
    world = _world()
    if world == 1:
        rows = [raw]
    else:
        mine = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(_device())
        out = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(out, mine)
        rows = [bytes(t.cpu().tolist()) for t in out]
    return [(int.from_bytes(r[:8], "little"), r[8:].hex()) for r in rows]


def _agree(error: CheckpointError | None) -> CheckpointError | None:
    """One verdict on every rank: a rank that found an error keeps its own; the others take the
    error of the lowest rank that found one."""
    world = _world()
    if world == 1:
        return error
    text = str(error).encode()[:_MESSAGE_BYTES] if error is not None else b""
    mine = torch.zeros(_MESSAGE_BYTES + 1, dtype=torch.uint8)
    mine[0] = 1 if error is not None else 0
    if text:
        mine[1 : 1 + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    mine = mine.to(_device())
    out = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(out, mine)
    if error is not None:
        return error
    for r, t in enumerate(out):
        row = t.cpu()
        if int(row[0]) == 0:
            continue
        message = bytes(row[1:].tolist()).rstrip(b"\0").decode(errors="ignore")
        return CheckpointError(f"rank {r} cannot use its checkpoint: {message}")
    return None
