"""A failed step leaves no broken state: the first error is kept and every later call names it.

The task manager is checked with programs whose steps are plain callables (no process group
needed); the engine in a real 2-rank gloo world where one rank stalls in its backward pass.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.collectives.primitives import Traffic
from gradsync.integrate.engine_failure import SyncError
from gradsync.sync.tasks import TaskError, TaskManager
from worlds import run_checks, run_world

pytestmark = pytest.mark.timeout(240)


def test_a_wait_that_times_out_fails_the_manager_and_no_finisher_runs_after_it():
    gate = threading.Event()
    finished = []
    errors = []

    def program():
        yield lambda: "sent"
        gate.wait(10)  # local work that takes too long (a stuck decode, a peer that is gone)
        return lambda: finished.append("a")

    def second():
        yield lambda: None
        return lambda: finished.append("b")

    manager = TaskManager("test")
    try:
        a = manager.submit(program(), "bucket 0 [fc.weight]", on_error=errors.append)
        b = manager.submit(second(), "bucket 1 [fc.bias]", on_error=errors.append)
        stuck = r"task 'bucket 0 \[fc.weight\]' did not finish within 0\.2 s"
        with pytest.raises(TaskError, match=stuck) as e:
            manager.wait([a, b], timeout=0.2)
        assert isinstance(e.value.__cause__, TimeoutError)
        gate.set()  # the stuck work ends after all: its result must not be used
        time.sleep(0.3)
        assert finished == [], "a finisher ran after the manager failed"
        assert a.done and b.done and a.error is not None and b.error is not None
        assert len(errors) == 2  # every queued task's on_error ran exactly once
        # every later call reports the first failure, not a new one
        for call in (lambda: manager.submit(second(), "later"), lambda: manager.wait([])):
            with pytest.raises(TaskError, match=stuck):
                call()
    finally:
        gate.set()
        manager.close()


def test_a_failing_step_fails_every_task_after_it_and_keeps_the_first_error():
    ran = []

    def failing():
        yield lambda: (_ for _ in ()).throw(ConnectionError("peer 1 reset the connection"))
        return lambda: ran.append("failing")

    def fine(name):
        yield lambda: None
        return lambda: ran.append(name)

    manager = TaskManager("test")
    try:
        tasks = [manager.submit(failing(), "bucket 0"), manager.submit(fine("b1"), "bucket 1")]
        with pytest.raises(TaskError, match="ConnectionError: peer 1 reset the connection"):
            manager.wait(tasks, timeout=5)
        assert ran == []
        with pytest.raises(TaskError, match="peer 1 reset"):
            manager.submit(fine("b2"), "bucket 2")
    finally:
        manager.close()


def test_traffic_counts_every_byte_under_concurrent_adds_and_takes():
    traffic = Traffic()
    taken = []
    stop = threading.Event()

    def add():
        for _ in range(20000):
            traffic.add("inter", 3)

    def take():
        while not stop.is_set():
            taken.append(traffic.take())

    threads = [threading.Thread(target=add) for _ in range(4)]
    reader = threading.Thread(target=take)
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    reader.join()
    taken.append(traffic.take())
    assert sum(d.get("inter", 0) for d in taken) == 4 * 20000 * 3
    assert traffic.calls == 4 * 20000


# ------------------------------------------------------------------------------ a real world
class Stall(nn.Module):
    """Identity forward; its backward sleeps on the stalling rank (a rank stuck mid-backward)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x):
        return _Sleep.apply(x, self.seconds)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


def _stalled_peer():
    rank = dist.get_rank()
    torch.manual_seed(0)
    # rank 1 stalls between the last layer's gradients and the first layer's: rank 0's first
    # bucket completes, its second waits on rank 1 past the engine's timeout
    model = nn.Sequential(nn.Linear(8, 64), Stall(0.0), nn.Linear(64, 4))
    synced = gradsync.wrap(model, "none", bucket_bytes=1024, timeout_s=1.0, calibrate=False)
    x, y = torch.randn(16, 8), torch.randn(16, 4)

    def step():
        synced.zero_grad()
        nn.functional.mse_loss(synced(x), y).backward()
        synced.finish_sync()

    step()  # a normal first step: the plan is made (a collective) on every rank
    if rank == 1:
        model[1].seconds = 2.5
        step()  # slow, but its collectives pair with rank 0's, still in flight
        return

    def first_failure_names_rank_and_bucket():
        with pytest.raises(SyncError) as e:
            step()
        text = str(e.value)
        assert "rank 0" in text and "bucket" in text and "did not finish within 1.0 s" in text, text

    before = []

    def timed_out():
        first_failure_names_rank_and_bucket()
        before.append(model[0].weight.grad.clone())  # the bucket that timed out: rank 0's own

    def every_later_call_reraises_it():
        def backward():  # (no zero_grad: the next check reads the failed step's gradients)
            nn.functional.mse_loss(synced(x), y).backward()

        for call in (backward, synced.finish_sync):
            with pytest.raises(SyncError, match="failed earlier on rank 0") as e:
                call()
            assert "did not finish within 1.0 s" in str(e.value)
            assert "became ready twice" not in str(e.value)  # the old, wrong diagnosis
            assert e.value.__cause__ is not None

    def the_late_result_is_not_written():
        time.sleep(3.0)  # rank 1 has sent by now (2.5 s after the step began, 1.0 s before this
        # check's sleep began), so the timed-out collective completed
        assert torch.equal(model[0].weight.grad, before[0]), "a finisher ran after the failure"

    # no collectives (nor barriers) here: rank 1 is not in step with rank 0 any more
    run_checks(timed_out, every_later_call_reraises_it, the_late_result_is_not_written, together=False)


def test_a_timed_out_step_is_reported_with_rank_and_bucket_on_every_later_call():
    run_world(2, _stalled_peer)
