"""Run a function in a world of processes on loopback (FileStore rendezvous): gloo by default,
NCCL with ``backend="nccl"`` (rank r on GPU r).

Each rank is a process of its own. Gloo ranks on a machine without CUDA are forked from a server
process that has imported torch and gradsync and nothing else (multiprocessing's forkserver,
:data:`PRELOAD`): a world starts in a tenth of a second instead of seconds of imports per rank.
Every rank still starts from that clean state, with the parent's environment, working directory
and ``sys.path``, as a spawned one would. ``GRADSYNC_TEST_SPAWN=1`` spawns every rank instead (a
fresh interpreter each); NCCL worlds, and any world where CUDA is available, always spawn.

The process group timeout is short, so a collective that hangs fails the test instead of
stalling CI. Exceptions raised in any rank propagate to the test with their traceback: the
error names every rank that failed (the one that failed first first, as the others' errors are
often its consequences: a closed connection, a timeout).

Starting a world is the slow part, so a world runs many checks: :func:`run_checks` runs each one,
keeps going after a failure and fails the world with every failed check of every rank. Inside a
check, :func:`expect_all` keeps going after a failed assertion too, so that every rank still runs
the check's collectives in the same order. ``GRADSYNC_TEST_TIMES=1`` prints how long each check
took on rank 0 (to stderr; ``pytest -s`` shows it).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=30)


def init_world() -> None:
    """Start this rank's process group (for ``run_world(..., init=False)``, where the function
    does things before the process group exists, as some training scripts do). On NCCL, rank r
    uses GPU r (one machine)."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    backend = os.environ.get("GRADSYNC_TEST_BACKEND", "gloo")
    store = dist.FileStore(os.environ["GRADSYNC_TEST_STORE"], world)
    kw: dict[str, Any] = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT, **kw)


def _entry(
    rank: int,
    world: int,
    store_path: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    init: bool,
    backend: str,
    parent_env: dict[str, str],
) -> None:
    os.environ.clear()  # the parent's environment now, as a spawned rank has it (a forked one
    os.environ.update(parent_env)  # would have the forkserver's, from when it started)
    faulthandler.enable(all_threads=True)  # a rank that crashes in C++ prints its Python stacks
    torch.set_num_threads(1)
    for k, v in env.items():
        os.environ[k] = v.format(rank=rank)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), GRADSYNC_TEST_STORE=store_path, GRADSYNC_TEST_BACKEND=backend
    )
    try:
        if init:
            init_world()
        fn(*args)
        if dist.is_initialized():
            dist.barrier()
    except BaseException as e:
        # for run_world, which shows every rank's error (torch.multiprocessing shows one)
        text, checks = traceback.format_exc(), isinstance(e, ChecksFailed)
        error = {"rank": rank, "time": time.time(), "text": text, "checks": checks}
        path = os.path.join(os.path.dirname(store_path), f"error-rank{rank}.json")
        with contextlib.suppress(OSError):
            with open(path + ".tmp", "w") as fh:
                json.dump(error, fh)
            os.replace(path + ".tmp", path)  # whole, or not there (run_world may be reading)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    env: dict[str, str] | None = None,
    init: bool = True,
    backend: str = "gloo",
) -> None:
    """Run ``fn(*args)`` on ``world`` ranks; ``env`` values may use ``{rank}``. With ``init=False``
    the function starts the process group itself (:func:`init_world`). ``backend="nccl"`` needs
    ``world`` GPUs."""
    with tempfile.TemporaryDirectory() as d:
        try:
            mp.start_processes(
                _entry,
                args=(world, os.path.join(d, "store"), fn, args, env or {}, init, backend, dict(os.environ)),
                nprocs=world,
                start_method=_start_method(backend),
            )
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            message = _world_error(d)
            if message is None:
                raise
            raise WorldFailed(message) from None


# What (nearly) every rank imports, imported once in the forkserver: nothing else runs there (no
# tensors, threads of gradsync or process groups), so each forked rank starts clean.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp", "pytest", "gradsync"]
PRELOAD += ["worlds"]
_preloaded = False


def _start_method(backend: str) -> str:
    """``forkserver`` for gloo worlds without CUDA (see the module's docstring), else ``spawn``
    (CUDA does not survive a fork of a process that touched it; spawning is the safe default)."""
    global _preloaded
    if backend == "nccl" or os.environ.get("GRADSYNC_TEST_SPAWN") or torch.cuda.is_available():
        return "spawn"
    if not _preloaded:
        mp.set_forkserver_preload(PRELOAD)  # takes effect when the server starts: the first world
        _preloaded = True
    return "forkserver"


def process_context() -> Any:
    """A multiprocessing context for a test's own worker processes (a process pool, say): the
    worlds' preloaded forkserver where run_world uses it, else spawn. Its processes get the
    forkserver's environment (run_world passes the parent's own)."""
    return mp.get_context(_start_method("gloo"))


class WorldFailed(AssertionError):
    """Ranks of a world failed; the message has each one's traceback."""


class ChecksFailed(AssertionError):
    """Checks failed (:func:`run_checks`); the message lists them for every rank."""


def _world_error(folder: str) -> str | None:
    """Every failed rank's traceback, the first to fail first; of :func:`run_checks` reports
    (each complete for the world) only the first."""
    errors = []
    for name in os.listdir(folder):
        if name.startswith("error-rank") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as fh:
                errors.append(json.load(fh))
    if not errors:
        return None
    errors.sort(key=lambda e: e["time"])
    reported = False
    parts = []
    for i, e in enumerate(errors):
        if e["checks"] and reported:
            continue  # the same world-wide report again
        reported = reported or e["checks"]
        when = "failed first" if i == 0 else "failed too"
        parts.append(f"===== rank {e['rank']} {when} =====\n{e['text'].rstrip()}")
    ranks = ", ".join(str(e["rank"]) for e in errors)
    head = f"rank {ranks} failed" if len(errors) == 1 else f"ranks {ranks} failed, in this order"
    return head + "\n\n" + "\n\n".join(parts)


# ---------------------------------------------------------------------------------------- checks
def comm_device() -> torch.device:
    """Where the default process group's tensors live: this rank's GPU on NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def named_check(fn: Callable[..., Any], *args: Any, label: str = "") -> Callable[[], Any]:
    """``fn(*args)`` as one check for :func:`run_checks`, reported as ``fn[label]``."""

    def check() -> Any:
        return fn(*args)

    check.__name__ = f"{fn.__name__}[{label}]" if label else fn.__name__
    return check


# A failed check: an exception, or pytest's own outcomes (``pytest.raises`` that saw nothing
# raises pytest's Failed, which is no Exception) and SystemExit (argparse); never Ctrl-C.
_FAILURES = (Exception, pytest.fail.Exception, SystemExit)


_runs = 0  # run_checks calls so far in this process (every rank makes the same calls)


def run_checks(*checks: Callable[[], Any], together: bool = True) -> None:
    """Run every check on every rank (together: a barrier after each), whatever fails; then, if a
    check failed here, raise one error that names, for every rank, each check that failed there,
    followed by their tracebacks.

    A check must run the same collectives in the same order on every rank up to the point where
    it fails (:func:`expect_all` puts assertions between collectives off to its end). If the ranks
    fall out of step all the same, the barrier after that check fails (process group timeout) and
    the checks left are not run. The ranks tell each other what failed through files next to the
    world's FileStore, not through the process group, so that works even then.

    ``together=False``: checks that this rank runs alone (no collectives in them, the other ranks
    elsewhere): no barriers, and the error names this rank's failed checks only."""
    global _runs
    rank, world = dist.get_rank(), dist.get_world_size()
    failed: list[tuple[str, str]] = []
    if not together:
        for check in checks:
            try:
                check()
            except _FAILURES:
                failed.append((check.__name__, traceback.format_exc()))
        if failed:
            raise ChecksFailed(_report({rank: {"failed": failed, "out_of_step": None}}, len(checks), rank))
        return
    _runs += 1
    out_of_step = None
    for i, check in enumerate(checks):
        started = time.perf_counter()
        try:
            check()
        except _FAILURES:
            failed.append((check.__name__, traceback.format_exc()))
        if os.environ.get("GRADSYNC_TEST_TIMES") and rank == 0:
            took = time.perf_counter() - started
            print(f"[check {took:6.2f}s] {check.__name__}", file=sys.stderr, flush=True)
        try:
            dist.barrier()  # the next check starts together on every rank
        except _FAILURES:
            left = ", ".join(c.__name__ for c in checks[i + 1 :]) or "none"
            why = traceback.format_exception_only(*sys.exc_info()[:2])[-1].strip()
            out_of_step = f"the ranks fell out of step in {check.__name__} ({why}); not run: {left}"
            break
    folder = os.path.dirname(os.environ["GRADSYNC_TEST_STORE"])
    path = os.path.join(folder, f"checks-{_runs}-rank{{}}.json")
    with open(path.format(rank) + ".tmp", "w") as fh:
        json.dump({"failed": failed, "out_of_step": out_of_step}, fh)
    os.replace(path.format(rank) + ".tmp", path.format(rank))
    if not failed and out_of_step is None:
        return
    reports: dict[int, dict[str, Any] | None] = {}
    deadline = time.monotonic() + 2 * TIMEOUT.total_seconds()  # a rank out of step waits for one timeout
    for r in range(world):
        while not os.path.exists(path.format(r)) and time.monotonic() < deadline:
            time.sleep(0.1)
        try:
            with open(path.format(r)) as fh:
                reports[r] = json.load(fh)
        except OSError:
            reports[r] = None
    raise ChecksFailed(_report(reports, len(checks), rank))


def _report(reports: dict[int, dict[str, Any] | None], total: int, me: int) -> str:
    count = sum(len(rep["failed"]) for rep in reports.values() if rep is not None)
    lines = [f"{count} failed checks (of {total} on each rank), raised on rank {me}:"]
    for r, rep in reports.items():
        if rep is None:
            lines.append(f"  rank {r}: no report (it died, or is still stuck in a check)")
            continue
        names = ", ".join(name for name, _ in rep["failed"]) or "all passed"
        lines.append(f"  rank {r}: {names}" + (f"; {rep['out_of_step']}" if rep["out_of_step"] else ""))
    for r, rep in reports.items():
        for name, tb in rep["failed"] if rep is not None else []:
            lines.append(f"\n===== rank {r}: {name} =====\n{tb.rstrip()}")
    return "\n".join(lines)


class Expectations:
    """Assertions that let a check go on: see :func:`expect_all`."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    @contextlib.contextmanager
    def __call__(self, what: str) -> Iterator[None]:
        """A block of assertions: one that fails is noted (with ``what``), not raised. The block
        may end with a collective-then-assert helper such as :func:`same_on_every_rank`; nothing
        after an assertion in it may be a collective."""
        try:
            yield
        except (AssertionError, pytest.fail.Exception) as e:
            self.failed.append(f"{what}: {type(e).__name__}: {e}")


@contextlib.contextmanager
def expect_all() -> Iterator[Expectations]:
    """Inside a check, ``with expect_all() as expect:`` then ``with expect("what"): assert ...``
    between collectives: a failed assertion is noted and the check goes on (running the same
    collectives as the other ranks); at the end the check fails with every noted failure."""
    expect = Expectations()
    try:
        yield expect
    except BaseException as e:
        if expect.failed and hasattr(e, "add_note"):
            e.add_note("failed before it: " + "\n".join(expect.failed))
        raise
    if expect.failed:
        raise AssertionError(f"{len(expect.failed)} failed:\n" + "\n".join(expect.failed))


def same_on_every_rank(tensors: list[torch.Tensor], what: str) -> None:
    """Assert that ``tensors`` are identical on every rank (rank 0's, broadcast, is the reference)."""
    flat = torch.cat([t.detach().to(comm_device(), torch.float64).reshape(-1) for t in tensors])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    assert torch.equal(flat, ref), f"{what}: ranks differ by up to {float((flat - ref).abs().max())}"
