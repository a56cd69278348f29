"""The task manager: step programs run on a compute thread and a communication thread.

The HiPress paper (CaSync) found that compressing inside a framework's gradient hook serializes
compute, compression and communication. Here every bucket's synchronization is a step program
(:mod:`gradsync.collectives.program`) and runs as a *task* split over two threads:

- the **compute thread** runs the tasks' local work (packing gradients, encoding, merging,
  decoding: everything between two communication steps, then the finisher). Of the segments that
  are ready it always runs the one of the oldest task, so the communication thread is fed in
  order;
- the **communication thread** runs the communication steps, strictly task after task in
  submission order, and within a task in program order. Since every rank submits the same tasks
  in the same order, every rank issues the same collectives in the same order: the one rule
  torch.distributed imposes. As soon as a task's last step has run the thread moves on to the
  next task, while the compute thread decodes the previous one: a step the program marked as its
  last (:func:`~gradsync.collectives.program.last`) says so at once; otherwise the thread learns
  it when the compute thread resumes the program and sees it return.

A step's dependencies are explicit: it waits for the compute segment that produced it, and the
segment after it waits for its result. While one task communicates, the next task's packing
and encoding run on the compute thread, and the training thread keeps computing the backward
pass (both threads release the GIL inside torch kernels, gradsync's native kernels and gloo).

A failure in any task poisons the manager: the order of collectives can no longer be trusted,
so every later call raises the first error. A wait that times out is such a failure too (a
collective still in flight can never be taken back), and once the manager has failed no
finisher runs any more: nothing a failed step half-computed reaches the gradients.

References:

- HiPress paper: Wu et al., "A Generic, High-Performance, Compression-Aware Framework for Data
  Parallel DNN Training", IEEE TPDS (HiPress, CaSync, CompLL).
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync.collectives import primitives as P
from gradsync.collectives.program import AFTER_LAST, LastStep, Program, ProgramError, Step
from gradsync.collectives.topology import use_device
from gradsync.sync import host_reads

_running: weakref.WeakSet[TaskManager] = weakref.WeakSet()
"""Managers whose threads run, for :func:`_close_running` (filled as threads start)."""


def _stop_at_exit(manager: TaskManager) -> None:
    """Have the interpreter stop ``manager``'s threads before it shuts down.

    The threads are daemons (a script that never calls ``close()`` must still end), but at
    shutdown CPython ends a daemon thread abruptly wherever it next takes the GIL; inside a
    torch or gloo C++ frame that unwinding aborts the process ("terminate called without an
    active exception", SIGABRT, and torchrun reports a failed job). An ``atexit`` callback runs
    before that point, so the threads finish their queue and return normally."""
    _running.add(manager)
    P.at_exit(_close_running)  # then gloo's workers get their moment (P.at_exit)


def _close_running() -> None:
    for manager in list(_running):
        with contextlib.suppress(Exception):
            manager.close()


class TaskError(RuntimeError):
    """A synchronization task failed (the message names it; ``__cause__`` is the original)."""


@dataclass
class Span:
    """One piece of a task's work: ``kind`` is ``"compute"`` (local work before or between
    communication steps), ``"comm"`` (one communication step; ``calls`` lists its collectives as
    ``(op, level, bytes, end time)``) or ``"finish"`` (the finisher: decoding, unpacking).
    Times are ``time.perf_counter()`` values."""

    kind: str
    start: float
    end: float
    calls: list[tuple[str, str, int, float]] = field(default_factory=list)


@dataclass
class Task:
    """One step program in the manager, with what it cost."""

    seq: int
    name: str
    program: Program
    on_done: Callable[[], None] | None = None
    on_error: Callable[[BaseException], None] | None = None
    compute_s: float = 0.0  # local work between steps (packing, encoding, merging)
    finish_s: float = 0.0  # the finisher (decoding, unpacking)
    comm_s: float = 0.0  # time inside communication steps
    sent_bytes: int = 0  # what its collectives sent from this rank, all levels
    steps: int = 0
    submitted_at: float = 0.0
    first_comm_at: float | None = None
    comm_done_at: float | None = None
    done_at: float | None = None
    error: BaseException | None = None
    spans: list[Span] | None = None
    """With the manager's ``record`` on: what the task did, in order (for timelines)."""
    # hand-over state, guarded by the manager's lock
    _started: bool = False
    _result: Any = None
    _step: Step | None = None
    _comm_done: bool = False
    _failed: bool = False
    _done: threading.Event = field(default_factory=threading.Event)

    @property
    def done(self) -> bool:
        return self._done.is_set()


class TaskManager:
    """Runs step programs on a compute thread and a communication thread (started lazily).

    ``device``: the accelerator the tasks work on; both threads make it their current device
    before anything else (a new thread's current CUDA device is ``cuda:0``, whatever the thread
    that started it uses). It may be set until the first task is submitted."""

    def __init__(self, name: str = "gradsync", device: torch.device | None = None) -> None:
        self.name = name
        self.device = device
        self._cv = threading.Condition()
        self._compute: list[tuple[int, Task]] = []  # heap by submission order
        self._comm: deque[Task] = deque()
        self._seq = 0
        self._error: BaseException | None = None
        self._closing = False
        self._threads: list[threading.Thread] = []
        # bytes the communication steps sent, per level (read and reset with take_traffic)
        self._traffic = P.Traffic()
        self._record = False

    @property
    def record(self) -> bool:
        """Whether tasks submitted from now on keep their :class:`Span` list (a timeline asks)."""
        return self._record

    @record.setter
    def record(self, on: bool) -> None:
        self._record = on
        # the per-collective log only while recording (the communication thread reads the
        # attribute once per step, so switching it here is safe)
        if on and self._traffic.log is None:
            self._traffic.log = []
        elif not on:
            self._traffic.log = None

    # ------------------------------------------------------------------ public
    def submit(
        self,
        program: Program,
        name: str,
        on_done: Callable[[], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> Task:
        """Queue a program. Every rank must submit the same programs in the same order.

        ``on_done`` runs on the compute thread after the finisher; ``on_error`` gets the error
        if the task (or one before it) fails."""
        self.raise_if_failed()
        self._start()
        with self._cv:
            task = Task(self._seq, name, program, on_done, on_error, submitted_at=time.perf_counter())
            if self._record:
                task.spans = []
            self._seq += 1
            heapq.heappush(self._compute, (task.seq, task))
            self._comm.append(task)
            self._cv.notify_all()
            failed = self._error  # a thread that could not start failed the queue before this task
        if failed is not None:
            self._fail(task, failed)
        return task

    def wait(self, tasks: list[Task], timeout: float | None = None) -> None:
        """Block until every task is done; raise :class:`TaskError` if any (or any before) failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for task in tasks:
            left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if not task._done.wait(left):
                started = task.first_comm_at is not None and not task._comm_done
                where = "in a collective" if started else "queued"
                why = f"task {task.name!r} did not finish within {timeout} s ({where})"
                self._fail(task, TimeoutError(why))
                break
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise TaskError(
                f"{self.name}: a synchronization task failed ({type(self._error).__name__}: {self._error}); "
                "the order of collectives is lost, so this engine cannot continue"
            ) from self._error

    def take_traffic(self) -> dict[str, int]:
        """Bytes sent per level since the last call."""
        return self._traffic.take()

    def close(self) -> None:
        """Stop the threads (after the queued tasks)."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5.0)
        self._threads.clear()

    # ------------------------------------------------------------------ threads
    def _start(self) -> None:
        if self._threads:
            return
        _stop_at_exit(self)
        for target, role in ((self._compute_loop, "compute"), (self._comm_loop, "comm")):
            t = threading.Thread(
                target=self._on_device, args=(target,), name=f"{self.name}-{role}", daemon=True
            )
            t.start()
            self._threads.append(t)

    def _on_device(self, loop: Callable[[], None]) -> None:
        try:
            use_device(self.device)
        except BaseException as e:  # every task fails with it, instead of running elsewhere
            with self._cv:
                self._error = self._error or e
                queued = list(self._comm)
            for task in queued:
                self._fail(task, e)
            return
        loop()

    def _fail(self, task: Task, error: BaseException) -> None:
        """Record a failure and fail every task queued after it (call without the lock)."""
        with self._cv:
            if self._error is None:
                self._error = error
            failed = [task] + [t for t in self._comm if t is not task]
            failed = [t for t in failed if not t._failed and not t._done.is_set()]
            for t in failed:
                t._failed = True  # its on_error runs once, whoever else fails it later
                t.error = t.error or error
                t._comm_done = True
            self._comm.clear()
            self._compute.clear()
            self._cv.notify_all()
        # everything queued after it can never run correctly: nobody may wait for it forever
        for t in failed:
            if t.on_error is not None:
                with contextlib.suppress(Exception):
                    t.on_error(t.error or error)
            _release(t)
            t._done.set()

    def _compute_loop(self) -> None:
        while True:
            with self._cv:
                while not self._compute and not self._closing:
                    self._cv.wait()
                if not self._compute:
                    return
                _, task = heapq.heappop(self._compute)
                if task._done.is_set():  # failed meanwhile
                    continue
                value, task._result = task._result, None
            t0 = time.perf_counter()
            try:
                with host_reads.watching():
                    if task._started:
                        step = task.program.send(value)
                    else:
                        task._started = True
                        step = next(task.program)
            except StopIteration as stop:
                t1 = time.perf_counter()
                task.compute_s += t1 - t0
                if task.spans is not None:
                    task.spans.append(Span("compute", t0, t1))
                with self._cv:
                    task._comm_done = True
                    if task.comm_done_at is None:
                        task.comm_done_at = time.perf_counter()
                    self._cv.notify_all()
                self._finish(task, stop.value)
                continue
            except BaseException as e:
                self._fail(task, e)
                continue
            t1 = time.perf_counter()
            task.compute_s += t1 - t0
            if task.spans is not None:
                task.spans.append(Span("compute", t0, t1))
            if task._comm_done:  # set before the task came back here: its last step has run
                self._fail(task, ProgramError(AFTER_LAST))
                continue
            with self._cv:
                task._step = step
                self._cv.notify_all()

    def _finish(self, task: Task, finisher: Callable[[], None] | None) -> None:
        with self._cv:
            failed = self._error
        if failed is not None:  # the step is lost: its results must not reach anything
            self._fail(task, failed)
            return
        t0 = time.perf_counter()
        try:
            with host_reads.watching():
                if finisher is not None:
                    finisher()
                if task.on_done is not None:
                    task.on_done()
        except BaseException as e:
            self._fail(task, e)
            return
        task.done_at = time.perf_counter()
        task.finish_s += task.done_at - t0
        if task.spans is not None:
            task.spans.append(Span("finish", t0, task.done_at))
        task._done.set()

    def _comm_loop(self) -> None:
        P.set_traffic(self._traffic)  # this thread's steps count into the manager's traffic
        while True:
            with self._cv:
                while not self._comm and not self._closing:
                    self._cv.wait()
                if not self._comm:
                    return
                task = self._comm[0]
                while task._step is None and not task._comm_done:
                    self._cv.wait()
                if task._comm_done:
                    if self._comm and self._comm[0] is task:
                        self._comm.popleft()
                    continue
                step, task._step = task._step, None
                assert step is not None  # the wait above ends on a step, or on _comm_done (handled)
            sent_before = self._traffic.total_sent  # only this thread adds to it
            t0 = time.perf_counter()
            if task.first_comm_at is None:
                task.first_comm_at = t0
            try:
                with host_reads.watching():
                    result = step()
            except BaseException as e:
                self._fail(task, e)
                continue
            t1 = time.perf_counter()
            task.sent_bytes += self._traffic.total_sent - sent_before
            task.comm_s += t1 - t0
            task.steps += 1
            log = self._traffic.log
            if log is not None:  # only this thread appends to it
                if task.spans is not None:
                    task.spans.append(Span("comm", t0, t1, list(log)))
                log.clear()
            with self._cv:
                task._result = result
                if isinstance(step, LastStep):  # the program only finishes now: next task's turn
                    task._comm_done = True
                    task.comm_done_at = t1
                    if self._comm and self._comm[0] is task:
                        self._comm.popleft()
                heapq.heappush(self._compute, (task.seq, task))
                self._cv.notify_all()


def _release(task: Task) -> None:
    """Let go of a failed task's suspended program: its frame may hold a collective still in
    flight (an asynchronous gather's work and buffers), which must not outlive the process
    group nor be finalized with the interpreter (gloo aborts the process then)."""
    with contextlib.suppress(ValueError):  # "generator already executing" on another thread
        task.program.close()
    task._result = task._step = None
