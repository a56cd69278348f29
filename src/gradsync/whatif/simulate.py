"""The discrete-event simulation of one training step of one worker (all workers are alike).

No clock is waited on: the simulation jumps from event to event, so a step of hundreds of buckets
takes milliseconds to simulate.

Three threads, as in the sync engine (:mod:`gradsync.sync.tasks`) and in PyTorch DDP:

- the **training thread** runs data loading, the forward pass, the backward pass (which makes
  each gradient ready at its profiled offset), the hooks' work (DDP's communication hooks compress
  there), waits for the synchronization, then the optimizer;
- the **compute thread** runs the tasks' local work (packing, encoding, decoding); of the stages
  that are ready it runs the oldest task's;
- the **communication thread** runs the tasks' communication, task after task in submission order
  (the order every rank issues its collectives in), each for the time the cost model gives.

A bucket is launched when its last gradient is ready (after a fusion hold for Horovod-style
cycles), buckets in order; launching submits its tasks, each a chain of stages on these threads.

CPU contention: the stages that compute share the host's cores with every other busy thread. The
worker's compute times come from a profile of one worker alone; with ``a`` of its threads busy
and ``ranks_per_host`` workers on a host of ``cores`` cores (every worker doing the same), each
busy thread runs ``max(1, ranks_per_host * a / cores)`` times slower. On a GPU cluster the
compute is on the GPU and ``cores`` is unbounded (no contention); on the emulated cluster, where
all ranks share this machine, ``cores`` is the *effective* number measured by ``gradsync bench
whatif``: ranks x (one worker's step alone) / (every worker's step at once). A collective that
starts while the worker's threads compute also waits for the peers' communication threads to get
a core (:attr:`Cpu.busy_call`, by the phase each worker is in at that moment: the backward pass
alone, or the backward pass and an encode), which the idle probes of the links do not see.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

MAIN, COMPUTE, COMM = "training", "compute", "comm"
THREADS = (MAIN, COMPUTE, COMM)
_EPS = 1e-15


@dataclass
class Stage:
    """``seconds`` of work on ``thread``; ``cpu`` work is slowed by contention, link time is not."""

    thread: str
    seconds: float
    label: str
    cpu: bool = True
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class Task:
    name: str
    bucket: int  # -1: a step-level task (the step check, the flags)
    stages: list[Stage]


@dataclass
class StepProgram:
    """What a contender does in one step, for the simulator.

    ``buckets`` hold tensor indices; launching bucket ``b`` submits ``bucket_tasks[b]``.
    ``hold_s``: a bucket not closed by size (``full[b]`` False) launches no earlier than its first
    gradient's ready time + ``hold_s`` (Horovod's fusion cycle). ``start_tasks`` are submitted with
    the step's first gradient, ``end_tasks`` when the backward pass ends; ``after_sync`` is
    training-thread work once everything is synchronized."""

    name: str
    buckets: list[list[int]] = field(default_factory=list)
    bucket_tasks: list[list[Task]] = field(default_factory=list)
    full: list[bool] = field(default_factory=list)
    hold_s: float = 0.0
    start_tasks: list[Task] = field(default_factory=list)
    end_tasks: list[Task] = field(default_factory=list)
    after_sync: float = 0.0
    cable_bytes: float = 0.0  # bytes per step over each node's cable (one direction)
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Cpu:
    """How busy threads share a host (see the module docstring)."""

    ranks_per_host: int = 1
    cores: float = math.inf
    busy_call: tuple[float, ...] = ()
    """Seconds a collective call waits besides its links while ``k`` of each worker's threads
    compute (``busy_call[k - 1]``; the last for more): on an oversubscribed host the peers'
    communication threads wait for a core at every hand-over, milliseconds per call. Empty: no
    such wait (a GPU cluster, or unknown). ``gradsync bench whatif`` records a probe's reading
    and charges it only with ``--charge-busy-calls`` (the probe misses the engine's waits on
    this project's machine, docs/whatif.md)."""

    transfer_weight: float = 1.0
    """How much of the contention a node-internal transfer feels, against a thread that computes
    (1: as much). A copy through the host's loopback waits on its peer part of the time, so it
    takes less of the cores than a computing thread: a stage marked ``in_node`` runs
    ``1 + (slowdown - 1) * transfer_weight`` times slower. ``gradsync bench whatif`` measures it
    (:func:`transfer_weight`); unknown, it is 1."""

    def slowdown(self, busy: int) -> float:
        if busy <= 0 or math.isinf(self.cores):
            return 1.0
        return max(1.0, self.ranks_per_host * busy / self.cores)

    def call_wait(self, computing: int) -> float:
        """What a collective call starting now waits for, ``computing`` of the worker's threads
        busy computing."""
        if computing <= 0 or not self.busy_call:
            return 0.0
        return self.busy_call[min(computing, len(self.busy_call)) - 1]


NO_CONTENTION = Cpu()


def transfer_weight(ratio: float | None, ranks_per_host: int, cores: float) -> float:
    """:attr:`Cpu.transfer_weight` from ``ratio``: a node-internal all-reduce's time with every node
    of the host at once over one node's alone. With every rank transferring (one busy thread each)
    the simulator slows a transfer by ``1 + (ranks / cores - 1) w``; ``w`` makes that the measured
    ratio (within 0 and 1). 1 where nothing was measured or the host is not oversubscribed."""
    over = ranks_per_host / cores if cores > 0 and math.isfinite(cores) else 1.0
    if ratio is None or not math.isfinite(ratio) or over <= 1.0:
        return 1.0
    return min(max((ratio - 1.0) / (over - 1.0), 0.0), 1.0)


@dataclass
class Span:
    thread: str
    label: str
    start: float
    end: float
    bucket: int = -1
    task: str = ""
    args: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    step_s: float
    backward_end_s: float  # from the step's start
    sync_end_s: float  # the last task's end
    wait_s: float  # the training thread blocked on the synchronization
    comm_busy_s: float
    compute_busy_s: float
    spans: list[Span]
    launches: list[float]  # per bucket

    def to_dict(self) -> dict[str, float]:
        return {
            "step_s": self.step_s, "backward_end_s": self.backward_end_s, "sync_end_s": self.sync_end_s,
            "wait_s": self.wait_s, "comm_busy_s": self.comm_busy_s, "compute_busy_s": self.compute_busy_s,
        }  # fmt: skip


@dataclass
class _Work:
    """An item in progress on a thread."""

    label: str
    remaining: float
    cpu: bool
    start: float
    task: int = -1  # index into the submitted tasks (-1: training-thread work of its own)
    ready: list[int] = field(default_factory=list)  # tensors made ready when it ends
    weight: float = 1.0  # the share of the contention it feels (Cpu.transfer_weight)

    def factor(self, slow: float) -> float:
        """How many times slower than alone it runs while threads contend ``slow`` times."""
        if not self.cpu:
            return 1.0
        return slow if self.weight >= 1.0 else 1.0 + (slow - 1.0) * self.weight


@dataclass
class _Live:
    task: Task
    seq: int
    stage: int = 0  # the next stage to run
    stage_ready: bool = True  # its predecessor has ended
    done_at: float | None = None

    @property
    def current(self) -> Stage | None:
        return self.task.stages[self.stage] if self.stage < len(self.task.stages) else None

    def comm_left(self) -> bool:
        return any(s.thread == COMM for s in self.task.stages[self.stage :])


def main_items(
    data: float, forward: float, backward: float, optimizer: float, ready: list[tuple[int, float]]
) -> list[tuple[str, float, list[int]]]:
    """The training thread's own work: (label, seconds, tensors made ready at its end), with the
    backward pass cut at every distinct ready offset."""
    items: list[tuple[str, float, list[int]]] = []
    if data > 0:
        items.append(("data", data, []))
    items.append(("forward", forward, []))
    at = 0.0
    groups: dict[float, list[int]] = {}
    for i, t in ready:
        groups.setdefault(max(t, 0.0), []).append(i)
    for t in sorted(groups):
        items.append(("backward", t - at, groups[t]))
        at = t
    items.append(("backward", max(backward - at, 0.0), []))
    return items


def simulate(
    program: StepProgram,
    ready: list[tuple[int, float]],
    data: float,
    forward: float,
    backward: float,
    optimizer: float,
    cpu: Cpu = NO_CONTENTION,
    record: bool = False,
) -> StepResult:
    """Simulate one step. ``ready``: (tensor index, ready offset from the backward's start)."""
    nb = len(program.buckets)
    bucket_of: dict[int, int] = {}
    for b, members in enumerate(program.buckets):
        for i in members:
            bucket_of[i] = b
    pending = [len(m) for m in program.buckets]
    first_ready: list[float | None] = [None] * nb
    release: list[float | None] = [None] * nb
    launched: list[float] = [math.nan] * nb
    next_bucket = 0

    items = main_items(data, forward, backward, optimizer, ready)
    pos = 0  # next own item of the training thread
    phase = "own"  # own -> wait -> after -> optimizer -> done
    hooks: list[tuple[int, Stage]] = []  # training-thread stages of tasks, first come first run
    live: list[_Live] = []
    comm_ptr = 0  # the task whose communication the comm thread serves
    running: dict[str, _Work | None] = {MAIN: None, COMPUTE: None, COMM: None}
    spans: list[Span] = []
    busy = {COMPUTE: 0.0, COMM: 0.0}
    t = 0.0
    started_any = False
    backward_end = wait_start = wait_end = math.nan

    def submit(tasks: list[Task]) -> None:
        for task in tasks:
            live.append(_Live(task, len(live)))
            _queue_stage(live[-1])

    def _queue_stage(lv: _Live) -> None:
        st = lv.current
        if st is not None and st.thread == MAIN:
            hooks.append((lv.seq, st))

    def launch_released() -> None:
        nonlocal next_bucket
        while next_bucket < nb:
            at = release[next_bucket]
            if at is None or at > t + _EPS:
                break
            launched[next_bucket] = t
            submit(program.bucket_tasks[next_bucket])
            next_bucket += 1

    def on_ready(indices: list[int]) -> None:
        nonlocal started_any
        if indices and not started_any:
            started_any = True
            submit(program.start_tasks)
        for i in indices:
            b = bucket_of.get(i)
            if b is None:
                continue
            if first_ready[b] is None:
                first_ready[b] = t
            pending[b] -= 1
            if pending[b] == 0:
                hold = 0.0 if program.full[b] else program.hold_s
                release[b] = max(t, (first_ready[b] or t) + hold)
        launch_released()

    def start_idle() -> None:
        nonlocal pos, phase, wait_start, wait_end, backward_end
        nonlocal comm_ptr
        # training thread
        while running[MAIN] is None and phase != "done":
            if hooks:
                seq, hook = hooks.pop(0)
                running[MAIN] = _Work(hook.label, hook.seconds, hook.cpu, t, task=seq)
            elif phase == "own":
                if pos < len(items):
                    label, secs, made = items[pos]
                    pos += 1
                    running[MAIN] = _Work(label, secs, True, t, ready=made)
                else:
                    backward_end = t
                    submit(program.end_tasks)
                    for b in range(nb):  # never-ready buckets (none for a profiled model) go now
                        if release[b] is None:
                            release[b] = t
                    launch_released()
                    phase, wait_start = "wait", t
            elif phase == "wait":
                if next_bucket == nb and all(lv.done_at is not None for lv in live):
                    wait_end = t
                    phase = "after"
                    if record and wait_end > wait_start:
                        spans.append(Span(MAIN, "sync wait", wait_start, wait_end))
                else:
                    break
            elif phase == "after":
                phase = "optimizer"
                if program.after_sync > 0:
                    running[MAIN] = _Work("unpack", program.after_sync, True, t)
            elif phase == "optimizer":
                phase = "finishing"
                running[MAIN] = _Work("optimizer", optimizer, True, t)
            elif phase == "finishing":
                phase = "done"
        # compute thread: the oldest task whose next stage is ready compute work
        if running[COMPUTE] is None:
            for lv in live:
                ready_stage = lv.current
                if ready_stage is not None and lv.stage_ready and ready_stage.thread == COMPUTE:
                    running[COMPUTE] = _Work(
                        ready_stage.label, ready_stage.seconds, ready_stage.cpu, t, task=lv.seq
                    )
                    lv.stage_ready = False
                    break
        # communication thread: task after task in submission order
        while running[COMM] is None and comm_ptr < len(live):
            lv = live[comm_ptr]
            if not lv.comm_left():
                comm_ptr += 1
                continue
            head = lv.current
            if head is not None and lv.stage_ready and head.thread == COMM:
                seconds = head.seconds
                if head.args.get("call"):  # a collective starts: the host's cores may make it wait
                    computing = sum(
                        1
                        for w in (running[MAIN], running[COMPUTE])
                        if w is not None and w.cpu and w.remaining > _EPS
                    )
                    seconds += cpu.call_wait(computing)
                weight = cpu.transfer_weight if head.args.get("in_node") else 1.0
                running[COMM] = _Work(head.label, seconds, head.cpu, t, task=lv.seq, weight=weight)
                lv.stage_ready = False
            break

    def advance(lv: _Live) -> None:
        lv.stage += 1
        lv.stage_ready = True
        if lv.current is None:
            lv.done_at = t
        else:
            _queue_stage(lv)
            if lv.current is not None and lv.current.thread == MAIN:
                lv.stage_ready = False  # queued on the training thread already

    guard = 0
    start_idle()
    while phase != "done":
        guard += 1
        if guard > 10_000_000:
            raise RuntimeError("whatif: the simulation does not terminate (a bug): please report it")
        active = [w for w in running.values() if w is not None]
        n_cpu = sum(1 for w in active if w.cpu)
        slow = cpu.slowdown(n_cpu)
        dt = math.inf
        for w in active:
            dt = min(dt, w.remaining * w.factor(slow))
        timers = [r for b, r in enumerate(release) if r is not None and b >= next_bucket and r > t + _EPS]
        if timers:
            dt = min(dt, min(timers) - t)
        if math.isinf(dt):
            raise RuntimeError(
                f"whatif: the simulated step of {program.name} is stuck (a bug): please report it"
            )
        t += dt
        finished = []
        for thread, work in running.items():
            if work is None:
                continue
            w = work
            w.remaining -= dt / w.factor(slow)
            if w.remaining <= 1e-12:
                finished.append((thread, w))
        for thread, w in finished:
            running[thread] = None
            if thread in busy:
                busy[thread] += t - w.start
            if record and t > w.start:
                task = live[w.task] if w.task >= 0 else None
                stage = task.current if task else None
                bucket, name = (task.task.bucket, task.task.name) if task else (-1, "")
                spans.append(
                    Span(thread, w.label, w.start, t, bucket, name, dict(stage.args) if stage else {})
                )
            if w.task >= 0:
                advance(live[w.task])
            elif w.ready:
                on_ready(w.ready)
        launch_released()
        start_idle()
    sync_end = max((lv.done_at or 0.0 for lv in live), default=backward_end)
    return StepResult(
        step_s=t, backward_end_s=backward_end, sync_end_s=sync_end,
        wait_s=(wait_end - wait_start) if not math.isnan(wait_start) else 0.0,
        comm_busy_s=busy[COMM], compute_busy_s=busy[COMPUTE], spans=spans, launches=launched,
    )  # fmt: skip
