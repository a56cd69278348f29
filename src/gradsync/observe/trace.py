"""A timeline of every synchronization, as a Chrome trace-event JSON file.

The file opens in Perfetto (ui.perfetto.dev) and chrome://tracing. One *process* per rank
(``pid`` = rank, named ``rank R (node N)``), with these tracks:

- ``training thread`` (tid 1): ``forward``, ``backward`` (from the first gradient that became
  ready to the end of the backward pass), ``sync wait`` (the exposed synchronization: from the end
  of the backward pass to the last synchronized gradient) and ``optimizer`` slices, and an
  instant ``bucket B ready`` when the last gradient of bucket B is ready;
- ``compute thread`` (tid 2): the sync engine's local work per bucket: ``encode`` (packing and
  encoding; ``pack`` for a dense bucket), ``merge`` between two collectives, ``decode``
  (decoding and unpacking);
- ``communication thread`` (tid 3): one slice per communication step, named by its collective
  and level (``all_reduce inter``); a step of several collectives has one child slice each.
  ``args`` give ``level`` (intra, inter, world), ``bytes`` sent from this rank and the bucket;
- ``buckets`` (async track): one slice per bucket from its ready time to its last synchronized
  byte; these overlap one another, so they use the async form (each gets its own row rather
  than an overflow track);
- counters: bytes sent per level and the reduction against a dense ring all-reduce, per step.

Flow arrows join the life of each bucket (each part, when a bucket is split): ready (on the
training thread) -> encode -> each collective -> decode.

Slices on one thread never overlap: each thread does one thing at a time, and the times are
rounded to nanoseconds the same way at both ends. Ranks' clocks are aligned at write time: every
rank leaves a barrier and reads its clock, a few rounds, and the median difference to rank 0 is
its offset (accurate to about one small message's latency; ``otherData.clock_spread_us`` says
how far the rounds disagreed). Times are then on rank 0's clock, counted from rank 0's start.

Writing is collective: every rank must call :meth:`TraceRecorder.write` (``GradSync.close()``
does). Each rank writes its own file (``trace.rank1.json`` next to ``trace.json``) and rank 0 also
gathers every rank's events (bytes of JSON over the control group) into the merged file.
:func:`merge_traces` (``gradsync trace merge``) merges per-rank files later, e.g. after a crash.
:func:`check_trace` (``gradsync trace check``) verifies the rules above on any trace file.

The event builders and the file writing live in :mod:`gradsync.observe.trace_events`, the clock
alignment in :mod:`gradsync.observe.trace_clock`, and the reading, merging and checking in
:mod:`gradsync.observe.trace_read`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology
from gradsync.observe.trace_clock import align_clocks
from gradsync.observe.trace_events import (
    COMM,
    COMPUTE,
    TRACE_FORMAT,
    TRAINING,
    flow_event,
    metadata_events,
    rank_file,
    slice_event,
    to_us,
    write_json,
)
from gradsync.sync.stats import StepStats
from gradsync.sync.tasks import Task

DEFAULT_MAX_EVENTS = 2_000_000
"""Per rank; later events are counted as dropped (``otherData.dropped_events``), not kept."""


class TraceRecorder:
    """Records one rank's synchronizations (and forward, backward, optimizer) as trace events.

    ``attach(engine)`` makes the engine keep its tasks' spans and hands each finished step to
    this recorder; :meth:`span` records a slice of the training thread (forward, optimizer);
    :meth:`write` aligns the clocks and writes (collective)."""

    def __init__(
        self, topo: Topology, steps: tuple[int, int] | None = None, max_events: int = DEFAULT_MAX_EVENTS
    ) -> None:
        if steps is not None and not (0 <= steps[0] < steps[1]):
            raise ValueError(f"trace steps must be a range START:STOP with 0 <= START < STOP, got {steps}")
        self.topo = topo
        self.window = steps
        """Record the synchronized steps ``START <= step < STOP`` only (None: every step)."""
        self.rank = topo.rank
        self.max_events = max_events
        self.events: list[dict[str, Any]] = []  # times in seconds, this rank's clock, until write
        self.dropped = 0
        self.steps = 0
        self.busy_s = 0.0
        """Time this recorder spent turning steps into events (on the training thread)."""
        self.started_at = time.perf_counter()
        self._flow = 0
        self._lock = threading.Lock()
        self._engines: list[Any] = []
        self._hooks: list[Any] = []

    # ------------------------------------------------------------------ recording
    def attach(self, engine: Any) -> None:
        """Record ``engine``'s steps (a :class:`~gradsync.integrate.engine.SyncEngine`)."""
        engine.manager.record = True
        engine.observers.append(self.on_step)
        self._engines.append(engine)

    def record_optimizers(self) -> None:
        """Record every optimizer step of this process as an ``optimizer`` slice (global hooks of
        ``torch.optim``, removed by :meth:`detach`)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        started: dict[int, float] = {}

        def pre(opt: Any, args: Any, kwargs: Any) -> None:
            started[id(opt)] = time.perf_counter()

        def post(opt: Any, args: Any, kwargs: Any) -> None:
            t0 = started.pop(id(opt), None)
            if t0 is not None:
                self.span("optimizer", t0, time.perf_counter(), after_step=True)

        self._hooks += [register_optimizer_step_pre_hook(pre), register_optimizer_step_post_hook(post)]

    def detach(self) -> None:
        """Stop recording (the events are kept until :meth:`write`)."""
        for engine in self._engines:
            if self.on_step in engine.observers:
                engine.observers.remove(self.on_step)
            engine.manager.record = False
        self._engines.clear()
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _add(self, events: Iterable[dict[str, Any]]) -> None:
        with self._lock:
            for e in events:
                if len(self.events) >= self.max_events:
                    self.dropped += 1
                else:
                    self.events.append(e)

    def span(self, name: str, start: float, end: float, after_step: bool = False, **args: Any) -> None:
        """A slice of the training thread (``perf_counter()`` times); ``after_step``: it follows
        a synchronized step (the optimizer), else it leads to one (the forward pass)."""
        if self.window is not None and self._engines:
            step = self._engines[0].step - (1 if after_step else 0)
            if not self.window[0] <= step < self.window[1]:
                return
        self._add([slice_event(name, "step", TRAINING, start, end, args)])

    def task(self, task: Task, step: int) -> None:
        """A task run outside an engine's step (an outer-loop exchange): its compute and
        communication slices on gradsync's threads, labelled with its name and ``step``. The
        task's manager must have recorded its spans (``manager.record = True``)."""
        if task.spans is None or (self.window is not None and not self.window[0] <= step < self.window[1]):
            return
        self._add(self._task_events(task, step, -1, True, None))

    def _flow_id(self) -> int:
        self._flow += 1
        return (self.rank << 40) | self._flow  # unique across the merged trace

    def on_step(self, stats: StepStats, tasks: list[Task], task_bucket: list[int]) -> None:
        """One synchronized step of the engine (called on the training thread)."""
        step = stats.step
        if self.window is not None:
            if step + 1 >= self.window[1]:  # the last step of the window: nothing more to keep
                for engine in self._engines:
                    engine.manager.record = False
                    if self.on_step in engine.observers:
                        engine.observers.remove(self.on_step)
            if not self.window[0] <= step < self.window[1]:
                return
        t0 = time.perf_counter()
        self.steps += 1
        ev: list[dict[str, Any]] = []
        by_index = {b.index: b for b in stats.bucket_stats}
        if stats.first_ready_at < stats.backward_end_at:
            ev.append(
                slice_event(
                    "backward", "step", TRAINING, stats.first_ready_at, stats.backward_end_at, {"step": step}
                )
            )
        ev.append(
            slice_event(
                "sync wait",
                "step",
                TRAINING,
                stats.backward_end_at,
                stats.done_at,
                {"step": step, "exposed_ms": round(stats.exposed_s * 1e3, 3), "dense": stats.dense},
            )
        )
        for b in stats.bucket_stats:
            if not b.parts:
                continue
            ev.append(
                {
                    "name": f"bucket {b.index} ready",
                    "cat": "bucket",
                    "ph": "i",
                    "s": "t",
                    "tid": TRAINING,
                    "ts": b.ready_at,
                    "args": {"step": step, "bucket": b.index},
                }
            )
            aid = f"{self.rank}:{step}:{b.index}"
            args = {
                "step": step,
                "bucket": b.index,
                "key": b.key,
                "bytes": b.raw_bytes,
                "wire_bytes": b.wire_bytes,
                "compressed": b.compressed,
                "parts": b.parts,
            }
            name = f"bucket {b.index}"
            ev.append(
                {
                    "name": name,
                    "cat": "bucket",
                    "ph": "b",
                    "id2": {"local": aid},
                    "tid": TRAINING,
                    "ts": b.ready_at,
                    "args": args,
                }
            )
            ev.append(
                {
                    "name": name,
                    "cat": "bucket",
                    "ph": "e",
                    "id2": {"local": aid},
                    "tid": TRAINING,
                    "ts": max(b.done_at, b.ready_at),
                }
            )
        for task, bi in zip(tasks, task_bucket, strict=True):
            if task.spans is None:
                continue
            bs = by_index.get(bi)
            ev += self._task_events(
                task,
                step,
                bi,
                bs.compressed if bs is not None else False,
                bs.ready_at if bs is not None else None,
            )
        t = stats.done_at
        ev.append(
            {
                "name": "bytes sent",
                "ph": "C",
                "tid": TRAINING,
                "ts": t,
                "args": {lvl: stats.sent_bytes.get(lvl, 0) for lvl in ("intra", "inter", "world")},
            }
        )
        if stats.reduction is not None:
            ev.append(
                {
                    "name": "reduction vs dense all-reduce",
                    "ph": "C",
                    "tid": TRAINING,
                    "ts": t,
                    "args": {"x": round(stats.reduction, 3)},
                }
            )
        self._add(ev)
        self.busy_s += time.perf_counter() - t0

    def _task_events(
        self, task: Task, step: int, bucket: int, compressed: bool, ready_at: float | None
    ) -> list[dict[str, Any]]:
        assert task.spans is not None
        ev: list[dict[str, Any]] = []
        label = task.name if bucket < 0 else task.name.split(" [")[0] + task.name.partition("]")[2]
        flow = self._flow_id() if bucket >= 0 and ready_at is not None else None
        flow_name = f"{label} (step {step})"
        if flow is not None:
            assert ready_at is not None
            ev.append(flow_event("s", flow, flow_name, TRAINING, ready_at))
        segment = 0
        for sp in task.spans:
            if sp.kind == "compute":
                name = ("encode" if compressed else "pack") if segment == 0 else "merge"
                if bucket < 0:
                    name = task.name
                segment += 1
                ev.append(
                    slice_event(
                        f"{name} {label}" if bucket >= 0 else name,
                        "compute",
                        COMPUTE,
                        sp.start,
                        sp.end,
                        {"step": step, "bucket": bucket},
                    )
                )
                if flow is not None and segment == 1:  # the arrows: ready, encode, collectives, decode
                    ev.append(flow_event("t", flow, flow_name, COMPUTE, sp.start))
            elif sp.kind == "comm":
                ev += self._comm_events(sp, step, bucket, label)
                if flow is not None:
                    ev.append(flow_event("t", flow, flow_name, COMM, sp.start))
            else:
                ev.append(
                    slice_event(
                        f"decode {label}" if bucket >= 0 else f"{task.name} result",
                        "compute",
                        COMPUTE,
                        sp.start,
                        sp.end,
                        {"step": step, "bucket": bucket},
                    )
                )
                if flow is not None:
                    ev.append(flow_event("f", flow, flow_name, COMPUTE, sp.start))
                    flow = None
        return ev

    def _comm_events(self, sp: Any, step: int, bucket: int, label: str) -> list[dict[str, Any]]:
        calls = sp.calls
        base = {"step": step, "bucket": bucket}
        if not calls:
            return [slice_event(f"wait {label}", "comm", COMM, sp.start, sp.end, base)]
        if len(calls) == 1:
            op, level, nbytes, _ = calls[0]
            return [
                slice_event(
                    f"{op} {level}",
                    "comm",
                    COMM,
                    sp.start,
                    sp.end,
                    {**base, "op": op, "level": level, "bytes": nbytes},
                )
            ]
        levels = sorted({c[1] for c in calls})
        ev = [
            slice_event(
                f"{label}: {len(calls)} collectives",
                "comm",
                COMM,
                sp.start,
                sp.end,
                {**base, "level": "+".join(levels), "bytes": sum(c[2] for c in calls)},
            )
        ]
        prev = sp.start
        for op, level, nbytes, end in calls:
            end = min(max(end, prev), sp.end)  # a child stays inside its parent
            ev.append(
                slice_event(
                    f"{op} {level}",
                    "comm",
                    COMM,
                    prev,
                    end,
                    {**base, "op": op, "level": level, "bytes": nbytes},
                )
            )
            prev = end
        return ev

    # ------------------------------------------------------------------ writing
    def write(self, path: str | os.PathLike[str]) -> Path | None:
        """Align the clocks, write this rank's file and (rank 0) the merged trace ``path``.

        Collective over the topology's control group: every rank calls it. Returns the merged
        file's path on rank 0, this rank's file elsewhere."""
        self.detach()
        offset, spread, origin, run_id = align_clocks(self.topo, self.started_at)
        shift = offset + origin  # local time -> rank 0's clock -> counted from rank 0's start
        own = self._document(shift, spread, offset, run_id)
        mine = rank_file(path, self.rank)
        write_json(mine, own)
        if self.topo.world == 1:
            write_json(Path(path), own)
            return Path(path)
        data = torch.frombuffer(bytearray(json.dumps(own["traceEvents"]).encode()), dtype=torch.uint8)
        parts = P.all_gather_bytes(data.to(self.topo.comm_device), self.topo.control_group, "world")
        if self.rank != 0:
            return mine
        events: list[dict[str, Any]] = []
        for part in parts:
            raw = bytearray(part.numel())
            torch.frombuffer(raw, dtype=torch.uint8).copy_(part)  # no numpy needed
            events += json.loads(raw.decode())
        merged = {**own, "traceEvents": events}
        merged["otherData"] = {**own["otherData"], "rank": None, "ranks": list(range(self.topo.world))}
        write_json(Path(path), merged)
        return Path(path)

    def _document(self, shift: float, spread: float, offset: float, run_id: str) -> dict[str, Any]:
        pid = self.rank
        events = metadata_events(pid, self.rank, self.topo.node)
        with self._lock:
            recorded = list(self.events)
        for e in recorded:
            out = {**e, "pid": pid, "ts": to_us(e["ts"] - shift)}
            if "dur" in e:  # both ends rounded alike: no overlap appears from rounding
                out["dur"] = round(to_us(e["ts"] + e["dur"] - shift) - out["ts"], 3)
            events.append(out)
        return {
            "traceEvents": events,
            "displayTimeUnit": "ms",
            "otherData": {
                "format": TRACE_FORMAT,
                "run_id": run_id,
                "rank": self.rank,
                "world": self.topo.world,
                "nodes": self.topo.nodes,
                "per_node": self.topo.per_node,
                "steps": self.steps,
                "dropped_events": self.dropped,
                "recorder_ms_per_step": round(self.busy_s / max(self.steps, 1) * 1e3, 4),
                "clock_offset_us": round(offset * 1e6, 3),
                "clock_spread_us": round(spread * 1e6, 3),
            },
        }


__all__ = ["DEFAULT_MAX_EVENTS", "TraceRecorder"]
