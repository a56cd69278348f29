"""The discrete-event simulation of one training step: of one worker where all workers are alike,
of the nodes' leaders and the other ranks apart where they are not (see :func:`simulate`).

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
busy thread runs ``max(1, ranks_per_host * a / cores)`` times slower; where the leaders and the
others are simulated apart, ``max(1, busy threads of all the host's ranks / cores)``. On a GPU cluster the
compute is on the GPU and ``cores`` is unbounded (no contention); on the emulated cluster, where
all ranks share this machine, ``cores`` is the *effective* number measured by ``gradsync bench
whatif``: ranks x (one worker's step alone) / (every worker's step at once). A collective that
starts while the worker's threads compute also waits for the peers' communication threads to get
a core (:attr:`Cpu.busy_call`, by the phase each worker is in at that moment: the backward pass
alone, or the backward pass and an encode), which the idle probes of the links do not see. Ranks
that share cores also drift apart while they compute, and a collective over the cables waits for
the last of them: the wait grows with the time computed since the ranks last met
(:meth:`Cpu.meeting_wait`), so a step that meets often pays more than its one slowest-rank
step shows.
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
    per_node: int = 1  # ranks to a node, the first of them its leader (stages marked ``leaders``)


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

    busy_transfer_weight: float = 1.0
    """:attr:`transfer_weight` while the transferring worker's own training or compute thread
    computes: by default as much as a computing thread (1), the processor sharing every other busy
    thread gets. The measured :attr:`transfer_weight` is a transfer's share beside other
    transfers, which leaves cores free between its hand-overs; beside its own rank's backward
    pass a loopback copy's hand-overs wait for that rank's turn on the cores. On this project's
    2-core machine a node's 24 MiB all-reduce took 1.3-1.4x its time alone beside the other
    node's, and 4.3-6.0x with one thread computing in every rank (issue 44, tenth session:
    ``docs/results/experiments/issue44-busy-transfers/``); charged the idle weight there, the
    outer loop's inner step inside the node came out 10-20 % fast on the 2 x 2 cluster."""

    lag_s: float = 0.0
    """How far the slowest rank falls behind the ranks' mean over a step of every rank computing at
    once (seconds; 0: the ranks keep step, as on a GPU cluster or a host with a core per thread).
    Threads that share cores progress by the scheduler's slices, so the ranks drift apart while
    they compute and every collective waits for the last of them (:meth:`meeting_wait`).
    ``gradsync bench whatif`` measures it as the slowest rank's step minus the ranks' mean step."""

    lag_span_s: float = 0.0
    """The step :attr:`lag_s` was measured over, timed by its slowest rank (the pace the effective
    :attr:`cores` are read at, so the pace the simulated worker computes at)."""

    def meeting_wait(self, computed: float) -> float:
        """What a collective waits for the slowest rank when the simulated worker has computed
        ``computed`` seconds since the ranks last met. The ranks drift apart as a random walk
        does, the lag growing as the square root of the time, ``lag_s * sqrt(computed /
        lag_span_s)``, and never faster than the time itself (a rank cannot fall behind by more
        than it computed). The effective :attr:`cores` come from steps timed by their slowest rank,
        so the simulated compute already carries ``lag_s`` spread evenly over the span (a share
        growing linearly with the time); a meeting waits for the rest. Meetings close together
        thus pay more in all than one per step: the lag grows fastest right after the ranks part."""
        if self.lag_s <= 0 or self.lag_span_s <= 0 or computed <= 0:
            return 0.0
        x = computed / self.lag_span_s
        return max(min(self.lag_s * math.sqrt(x), computed) - self.lag_s * x, 0.0)

    def shared(self, busy: float) -> float:
        """How many times slower than alone each of ``busy`` threads computing at once on the host
        runs (the cores shared evenly)."""
        if busy <= 0 or math.isinf(self.cores):
            return 1.0
        return max(1.0, busy / self.cores)

    def slowdown(self, busy: int) -> float:
        """:meth:`shared` with ``busy`` threads computing on each rank of the host (all alike)."""
        return self.shared(self.ranks_per_host * busy)

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
    shared: bool = True  # a collective's part that waits for the others' (see _Meeting)
    busy_weight: float = 1.0  # the share while its own worker computes (Cpu.busy_transfer_weight)
    wait: float = 0.0
    """Seconds of the clock before the work proper: a collective's wait for its peers to reach it
    (:meth:`Cpu.call_wait`, :meth:`Cpu.meeting_wait`). It takes no core, so contention neither
    slows it nor counts it as a busy thread."""

    def busy(self) -> bool:
        """Whether it takes a share of the cores now."""
        return self.cpu and self.wait <= _EPS

    def time_left(self, slow: float, own_busy: bool = False) -> float:
        return self.wait + self.remaining * self.factor(slow, own_busy)

    def run_for(self, dt: float, slow: float, own_busy: bool = False) -> None:
        """Advance by ``dt`` seconds of the clock: the wait first, then the work."""
        waited = min(dt, self.wait)
        self.wait -= waited
        self.remaining -= (dt - waited) / self.factor(slow, own_busy)

    def factor(self, slow: float, own_busy: bool = False) -> float:
        """How many times slower than alone it runs while threads contend ``slow`` times
        (``own_busy``: while its own worker's other threads compute)."""
        if not self.cpu:
            return 1.0
        return 1.0 + (slow - 1.0) * (self.busy_weight if own_busy else self.weight)


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


class _Worker:
    """One worker's threads in a simulated step (the state :func:`simulate` advances)."""

    def __init__(
        self,
        program: StepProgram,
        items: list[tuple[str, float, list[int]]],
        optimizer: float,
        record: bool,
        leader: bool = True,
    ) -> None:
        self.program = program
        self.leader = leader
        self.items = items
        self.optimizer = optimizer
        self.record = record
        nb = self.nb = len(program.buckets)
        self.bucket_of: dict[int, int] = {i: b for b, members in enumerate(program.buckets) for i in members}
        self.pending = [len(m) for m in program.buckets]
        self.first_ready: list[float | None] = [None] * nb
        self.release: list[float | None] = [None] * nb
        self.launched: list[float] = [math.nan] * nb
        self.next_bucket = 0
        self.pos = 0  # next own item of the training thread
        self.phase = "own"  # own -> wait -> after -> optimizer -> finishing -> done
        self.hooks: list[tuple[int, Stage]] = []  # training-thread stages of tasks, first come first run
        self.live: list[_Live] = []
        self.seen: dict[tuple[str, int], int] = {}  # tasks submitted so far per (name, bucket)
        self.keys: list[tuple[str, int, int]] = []  # per live task: its name, bucket, occurrence
        self.seq_by_key: dict[tuple[str, int, int], int] = {}  # and back
        self.comm_ptr = 0  # the task whose communication the comm thread serves
        self.running: dict[str, _Work | None] = {MAIN: None, COMPUTE: None, COMM: None}
        self.spans: list[Span] = []
        self.busy = {COMPUTE: 0.0, COMM: 0.0}
        self.started_any = False
        self.computed = 0.0  # seconds its threads computed since its collectives last met (Cpu.lag_s)
        self.backward_end = self.wait_start = self.wait_end = math.nan

    def submit(self, tasks: list[Task]) -> None:
        for task in tasks:
            n = self.seen.get((task.name, task.bucket), 0)
            self.seen[(task.name, task.bucket)] = n + 1
            self.keys.append((task.name, task.bucket, n))
            self.seq_by_key[self.keys[-1]] = len(self.live)
            self.live.append(_Live(task, len(self.live)))
            self._queue_stage(self.live[-1])

    def _queue_stage(self, lv: _Live) -> None:
        st = lv.current
        if st is not None and st.thread == MAIN:
            self.hooks.append((lv.seq, st))

    def launch_released(self, t: float) -> None:
        while self.next_bucket < self.nb:
            at = self.release[self.next_bucket]
            if at is None or at > t + _EPS:
                break
            self.launched[self.next_bucket] = t
            self.submit(self.program.bucket_tasks[self.next_bucket])
            self.next_bucket += 1

    def on_ready(self, indices: list[int], t: float) -> None:
        if indices and not self.started_any:
            self.started_any = True
            self.submit(self.program.start_tasks)
        for i in indices:
            b = self.bucket_of.get(i)
            if b is None:
                continue
            if self.first_ready[b] is None:
                self.first_ready[b] = t
            self.pending[b] -= 1
            if self.pending[b] == 0:
                hold = 0.0 if self.program.full[b] else self.program.hold_s
                self.release[b] = max(t, (self.first_ready[b] or t) + hold)
        self.launch_released(t)

    def stage_key(self, lv: _Live) -> tuple[str, int, int, int]:
        """The same stage of the same task on every worker (a collective they all take part in)."""
        return (*self.keys[lv.seq], lv.stage)

    def start_idle(self, t: float, cpu: Cpu, meet: _Meeting | None, me: int) -> None:
        """Start work on every idle thread; ``meet``: the collectives' meeting of the workers
        (None: this worker stands for all, every collective starts when it reaches it)."""
        running = self.running
        # training thread
        while running[MAIN] is None and self.phase != "done":
            if self.hooks:
                seq, hook = self.hooks.pop(0)
                running[MAIN] = _Work(hook.label, self.seconds(hook), hook.cpu, t, task=seq)
            elif self.phase == "own":
                if self.pos < len(self.items):
                    label, secs, made = self.items[self.pos]
                    self.pos += 1
                    running[MAIN] = _Work(label, secs, True, t, ready=made)
                else:
                    self.backward_end = t
                    self.submit(self.program.end_tasks)
                    for b in range(self.nb):  # never-ready buckets (none for a profiled model) go now
                        if self.release[b] is None:
                            self.release[b] = t
                    self.launch_released(t)
                    self.phase, self.wait_start = "wait", t
            elif self.phase == "wait":
                if self.next_bucket == self.nb and all(lv.done_at is not None for lv in self.live):
                    self.wait_end = t
                    self.phase = "after"
                    if self.record and self.wait_end > self.wait_start:
                        self.spans.append(Span(MAIN, "sync wait", self.wait_start, self.wait_end))
                else:
                    break
            elif self.phase == "after":
                self.phase = "optimizer"
                if self.program.after_sync > 0:
                    running[MAIN] = _Work("unpack", self.program.after_sync, True, t)
            elif self.phase == "optimizer":
                self.phase = "finishing"
                running[MAIN] = _Work("optimizer", self.optimizer, True, t)
            elif self.phase == "finishing":
                self.phase = "done"
        # compute thread: the oldest task whose next stage is ready compute work
        if running[COMPUTE] is None:
            for lv in self.live:
                ready_stage = lv.current
                if ready_stage is not None and lv.stage_ready and ready_stage.thread == COMPUTE:
                    running[COMPUTE] = _Work(
                        ready_stage.label, self.seconds(ready_stage), ready_stage.cpu, t, task=lv.seq
                    )
                    lv.stage_ready = False
                    break
        # communication thread: task after task in submission order
        while running[COMM] is None and self.comm_ptr < len(self.live):
            lv = self.live[self.comm_ptr]
            if not lv.comm_left():
                self.comm_ptr += 1
                continue
            head = lv.current
            if head is not None and lv.stage_ready and head.thread == COMM:
                if not self.runs(head):  # the leaders' part: nothing to do or wait for here
                    running[COMM] = _Work(head.label, 0.0, False, t, task=lv.seq, shared=False)
                    lv.stage_ready = False
                    break
                if meet is not None and not meet.arrive(self.stage_key(lv), head, me):
                    break  # the collective waits for the other workers to reach it
                in_node = bool(head.args.get("in_node"))
                wait = 0.0
                if head.args.get("call"):  # a collective starts: the host's cores may make it wait
                    computing = sum(
                        1
                        for w in (running[MAIN], running[COMPUTE])
                        if w is not None and w.cpu and w.remaining > _EPS
                    )
                    wait += cpu.call_wait(computing)
                    # the ranks' lag, where no copy inside the node (charged as a computing thread
                    # beside the backward pass, Cpu.busy_transfer_weight) already waits for them
                    if not in_node or self.program.per_node <= 1:
                        wait += cpu.meeting_wait(self.computed)
                    self.computed = 0.0
                weight = cpu.transfer_weight if in_node else 1.0
                busy_w = cpu.busy_transfer_weight if in_node else 1.0
                running[COMM] = _Work(
                    head.label, head.seconds, head.cpu, t, task=lv.seq, weight=weight, busy_weight=busy_w,
                    wait=wait,
                )  # fmt: skip
                lv.stage_ready = False
            break

    def advance(self, lv: _Live, t: float) -> None:
        lv.stage += 1
        lv.stage_ready = True
        if lv.current is None:
            lv.done_at = t
        else:
            self._queue_stage(lv)
            if lv.current is not None and lv.current.thread == MAIN:
                lv.stage_ready = False  # queued on the training thread already

    def finish(self, thread: str, w: _Work, t: float, meet: _Meeting | None, workers: list[_Worker]) -> None:
        """``w`` ended on ``thread`` at ``t``: record it and move its task on (a collective on every
        worker once the last has ended its part)."""
        self.running[thread] = None
        if thread in self.busy:
            self.busy[thread] += t - w.start
        if self.record and t > w.start:
            task = self.live[w.task] if w.task >= 0 else None
            stage = task.current if task else None
            bucket, name = (task.task.bucket, task.task.name) if task else (-1, "")
            self.spans.append(
                Span(thread, w.label, w.start, t, bucket, name, dict(stage.args) if stage else {})
            )
        if w.task >= 0:
            lv = self.live[w.task]
            stage = lv.current
            if meet is not None and thread == COMM and w.shared and stage is not None:
                key = self.stage_key(lv)
                if meet.leave(key, stage):
                    for other in workers:
                        if other.runs(stage):
                            other.advance(other.live[other.seq_of(key)], t)
            else:
                self.advance(lv, t)
        elif w.ready:
            self.on_ready(w.ready, t)

    def computing(self) -> bool:
        """Whether the worker's training or compute thread is busy computing."""
        return any(
            w is not None and w.cpu and w.remaining > _EPS
            for w in (self.running[MAIN], self.running[COMPUTE])
        )

    def runs(self, stage: Stage) -> bool:
        """Whether this worker runs ``stage`` (a stage of the leaders' only on a leader)."""
        return self.leader or not stage.args.get("leaders")

    def seconds(self, stage: Stage) -> float:
        return stage.seconds if self.runs(stage) else 0.0

    def seq_of(self, key: tuple[str, int, int, int]) -> int:
        return self.seq_by_key[key[:3]]

    def timers(self, t: float) -> list[float]:
        return [
            r for b, r in enumerate(self.release) if r is not None and b >= self.next_bucket and r > t + _EPS
        ]

    def result(self, t: float) -> StepResult:
        sync_end = max((lv.done_at or 0.0 for lv in self.live), default=self.backward_end)
        return StepResult(
            step_s=t, backward_end_s=self.backward_end, sync_end_s=sync_end,
            wait_s=(self.wait_end - self.wait_start) if not math.isnan(self.wait_start) else 0.0,
            comm_busy_s=self.busy[COMM], compute_busy_s=self.busy[COMPUTE], spans=self.spans,
            launches=self.launched,
        )  # fmt: skip


class _Meeting:
    """Where the workers' communication threads meet: a collective's stage starts on every worker
    that takes part once all of them have reached it, and ends on each once all have done their
    part. A stage only the nodes' leaders run (``leaders`` in its args) is the leaders' meeting."""

    def __init__(self, workers: int, leaders: int) -> None:
        self.workers, self.leaders = workers, leaders
        self.arrived: dict[tuple[str, int, int, int], set[int]] = {}
        self.left: dict[tuple[str, int, int, int], int] = {}

    def _needed(self, stage: Stage) -> int:
        return self.leaders if stage.args.get("leaders") else self.workers

    def arrive(self, key: tuple[str, int, int, int], stage: Stage, me: int) -> bool:
        here = self.arrived.setdefault(key, set())
        here.add(me)
        return len(here) == self._needed(stage)

    def leave(self, key: tuple[str, int, int, int], stage: Stage) -> bool:
        self.left[key] = self.left.get(key, 0) + 1
        return self.left[key] == self._needed(stage)


def _run(workers: list[_Worker], weights: list[float], cpu: Cpu, program_name: str) -> float:
    """Advance the workers' threads from event to event until every worker's step is done; the
    time the last one ends. Each worker stands for ``weights`` of the host's ranks, all alike
    (one worker: every rank of the host)."""
    meet = _Meeting(len(workers), sum(1 for wk in workers if wk.leader)) if len(workers) > 1 else None
    t = 0.0

    def start_all() -> None:
        for _ in range(2):  # twice: a collective the last worker reached starts on the earlier ones
            for me, wk in enumerate(workers):
                wk.start_idle(t, cpu, meet, me)

    guard = 0
    start_all()
    while any(wk.phase != "done" for wk in workers):
        guard += 1
        if guard > 10_000_000:
            raise RuntimeError("whatif: the simulation does not terminate (a bug): please report it")
        slow = cpu.shared(
            sum(
                n * sum(1 for w in wk.running.values() if w is not None and w.busy())
                for n, wk in zip(weights, workers, strict=True)
            )
        )
        owns = [wk.computing() for wk in workers]  # the same for the whole interval
        dt = math.inf
        for wk, own in zip(workers, owns, strict=True):
            for w in wk.running.values():
                if w is not None:
                    dt = min(dt, w.time_left(slow, own))
            timers = wk.timers(t)
            if timers:
                dt = min(dt, min(timers) - t)
        if math.isinf(dt):
            raise RuntimeError(
                f"whatif: the simulated step of {program_name} is stuck (a bug): please report it"
            )
        t += dt
        finished = []
        for wk, own in zip(workers, owns, strict=True):
            if own:
                wk.computed += dt
            for thread, work in wk.running.items():
                if work is None:
                    continue
                work.run_for(dt, slow, own)
                if work.remaining <= 1e-12 and work.wait <= 1e-12:
                    finished.append((wk, thread, work))
        for wk, thread, work in finished:
            wk.finish(thread, work, t, meet, workers)
        for wk in workers:
            wk.launch_released(t)
        start_all()
    return t


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
    """Simulate one step. ``ready``: (tensor index, ready offset from the backward's start).

    One worker stands for every rank of the host, all alike. Where they are not (a stage only the
    nodes' leaders run, :attr:`StepProgram.per_node` ranks to a node) and the host's ranks share
    its cores, the leaders and the other ranks are simulated apart, each kind in its own phase (all
    ranks of a kind alike): the leaders' work contends with whatever the others do at that moment
    (waiting, mostly), collectives start once every kind taking part has reached them, and the step
    ends with the later of the two (the leader gives the spans and the other times)."""
    items = main_items(data, forward, backward, optimizer, ready)
    leaders = -(-cpu.ranks_per_host // program.per_node)  # the first rank of each node on the host
    if math.isfinite(cpu.cores) and cpu.ranks_per_host > leaders and _has_roles(program):
        workers = [
            _Worker(program, items, optimizer, record, leader=True),
            _Worker(program, items, optimizer, False, leader=False),
        ]
        weights = [float(leaders), float(cpu.ranks_per_host - leaders)]
    else:
        workers, weights = [_Worker(program, items, optimizer, record)], [float(cpu.ranks_per_host)]
    end = _run(workers, weights, cpu, program.name)
    return workers[0].result(end)


def _has_roles(program: StepProgram) -> bool:
    """Whether some stage only the nodes' leaders run, with ranks besides the leaders. Such stages
    run on the compute and communication threads only: the training thread of every rank must keep
    the same time, since it submits the tasks (in the order every rank issues its collectives)."""
    if program.per_node <= 1:
        return False
    tasks = [*program.start_tasks, *program.end_tasks, *(t for ts in program.bucket_tasks for t in ts)]
    led = [st for task in tasks for st in task.stages if st.args.get("leaders")]
    if any(st.thread == MAIN for st in led):
        label = next(st.label for st in led if st.thread == MAIN)
        raise ValueError(
            f"whatif: {program.name}: a stage only the leaders run is on the training thread ({label!r}); "
            "it must be compute or communication work"
        )
    return bool(led)
