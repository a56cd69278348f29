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
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology
from gradsync.sync.stats import StepStats
from gradsync.sync.tasks import Task

TRACE_FORMAT = "gradsync.trace/1"

TRAINING, COMPUTE, COMM = 1, 2, 3
THREAD_NAMES = {TRAINING: "training thread", COMPUTE: "compute thread", COMM: "communication thread"}
DEFAULT_MAX_EVENTS = 2_000_000
"""Per rank; later events are counted as dropped (``otherData.dropped_events``), not kept."""


def _us(t: float) -> float:
    """Seconds -> microseconds rounded to the nanosecond (both ends of a slice round alike)."""
    return round(t * 1e6, 3)


def rank_file(path: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its own part of the trace ``path``: ``trace.rank1.json``."""
    p = Path(path)
    suffix = p.suffix or ".json"
    return p.with_name(f"{p.name[: -len(p.suffix)] if p.suffix else p.name}.rank{rank}{suffix}")


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
        """Record ``engine``'s steps (a :class:`~gradsync.sync.engine.SyncEngine`)."""
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
        self._add([_slice(name, "step", TRAINING, start, end, args)])

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
                _slice(
                    "backward", "step", TRAINING, stats.first_ready_at, stats.backward_end_at, {"step": step}
                )
            )
        ev.append(
            _slice(
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
            ev.append(_flow("s", flow, flow_name, TRAINING, ready_at))
        segment = 0
        for sp in task.spans:
            if sp.kind == "compute":
                name = ("encode" if compressed else "pack") if segment == 0 else "merge"
                if bucket < 0:
                    name = task.name
                segment += 1
                ev.append(
                    _slice(
                        f"{name} {label}" if bucket >= 0 else name,
                        "compute",
                        COMPUTE,
                        sp.start,
                        sp.end,
                        {"step": step, "bucket": bucket},
                    )
                )
                if flow is not None and segment == 1:  # the arrows: ready, encode, collectives, decode
                    ev.append(_flow("t", flow, flow_name, COMPUTE, sp.start))
            elif sp.kind == "comm":
                ev += self._comm_events(sp, step, bucket, label)
                if flow is not None:
                    ev.append(_flow("t", flow, flow_name, COMM, sp.start))
            else:
                ev.append(
                    _slice(
                        f"decode {label}" if bucket >= 0 else f"{task.name} result",
                        "compute",
                        COMPUTE,
                        sp.start,
                        sp.end,
                        {"step": step, "bucket": bucket},
                    )
                )
                if flow is not None:
                    ev.append(_flow("f", flow, flow_name, COMPUTE, sp.start))
                    flow = None
        return ev

    def _comm_events(self, sp: Any, step: int, bucket: int, label: str) -> list[dict[str, Any]]:
        calls = sp.calls
        base = {"step": step, "bucket": bucket}
        if not calls:
            return [_slice(f"wait {label}", "comm", COMM, sp.start, sp.end, base)]
        if len(calls) == 1:
            op, level, nbytes, _ = calls[0]
            return [
                _slice(
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
            _slice(
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
                _slice(
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
        events = _metadata(pid, self.rank, self.topo.node)
        with self._lock:
            recorded = list(self.events)
        for e in recorded:
            out = {**e, "pid": pid, "ts": _us(e["ts"] - shift)}
            if "dur" in e:  # both ends rounded alike: no overlap appears from rounding
                out["dur"] = round(_us(e["ts"] + e["dur"] - shift) - out["ts"], 3)
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


def _slice(name: str, cat: str, tid: int, start: float, end: float, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "tid": tid,
        "ts": start,
        "dur": max(end - start, 0.0),
        "args": args,
    }


def _flow(ph: str, flow: int, name: str, tid: int, ts: float) -> dict[str, Any]:
    e: dict[str, Any] = {"name": name, "cat": "flow", "ph": ph, "id": flow, "tid": tid, "ts": ts}
    if ph == "f":
        e["bp"] = "e"  # bind to the slice that encloses it (the decode), not the next one
    return e


def _metadata(pid: int, rank: int, node: int) -> list[dict[str, Any]]:
    ev: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": pid,
            "tid": 0,
            "args": {"name": f"rank {rank} (node {node})"},
        },
        {"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0, "args": {"sort_index": rank}},
    ]
    for tid, name in THREAD_NAMES.items():
        ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
        ev.append(
            {"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}
        )
    return ev


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write ``doc`` as compact JSON, atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as fh:
        json.dump(doc, fh, separators=(",", ":"))
    os.replace(tmp, path)


def align_clocks(topo: Topology, started_at: float, rounds: int = 9) -> tuple[float, float, float, str]:
    """This rank's clock minus rank 0's (seconds), the spread of the rounds, rank 0's start time
    on rank 0's clock, and a run id shared by every rank. Collective over the control group."""
    if topo.world == 1 or not topo.is_bound:
        return 0.0, 0.0, started_at, uuid.uuid4().hex[:12]
    dev, group = topo.comm_device, topo.control_group
    diffs: list[list[float]] = []
    for _ in range(rounds):
        P.all_reduce(torch.zeros(1, device=dev), group, "world")  # leave together
        now = time.perf_counter()
        table = torch.empty(topo.world, dtype=torch.float64, device=dev)
        P.all_gather(table, torch.tensor([now], dtype=torch.float64, device=dev), group, "world")
        times = table.tolist()
        diffs.append([t - times[0] for t in times])
    mine = [d[topo.rank] for d in diffs]
    offset = statistics.median(mine)
    spread = max(
        max(abs(d[r] - statistics.median(x[r] for x in diffs)) for d in diffs) for r in range(topo.world)
    )
    # rank 0's start and a run id: 64-bit words from rank 0
    run = int(uuid.uuid4().int & ((1 << 62) - 1))
    word = torch.tensor([started_at, float(run)], dtype=torch.float64, device=dev)
    P.broadcast(word, 0, group, "world")
    origin0, run_f = word.tolist()
    return offset, spread, origin0, f"{int(run_f):x}"[:12]


# ---------------------------------------------------------------------- reading
def load_trace(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A trace file as a dict (``{"traceEvents": [...]}``; a bare event list is accepted)."""
    with open(path) as fh:
        doc = json.load(fh)
    if isinstance(doc, list):
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome trace (no traceEvents list)")
    return doc


def merge_traces(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """One trace from the per-rank traces of one run (each rank once, same run id)."""
    if not docs:
        raise ValueError("trace merge: no traces given")
    ranks, runs = [], set()
    for d in docs:
        other = d.get("otherData", {})
        if other.get("format") != TRACE_FORMAT:
            raise ValueError(
                f"trace merge: not a gradsync trace (format {other.get('format')!r}, "
                f"expected {TRACE_FORMAT!r})"
            )
        if other.get("rank") is None:
            raise ValueError("trace merge: give the per-rank files (trace.rankR.json), not a merged trace")
        ranks.append(other["rank"])
        runs.add(other.get("run_id"))
    if len(runs) > 1:
        raise ValueError(
            f"trace merge: the files come from different runs (run ids {sorted(map(str, runs))})"
        )
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"trace merge: a rank appears twice ({sorted(ranks)})")
    events: list[dict[str, Any]] = []
    for d in sorted(docs, key=lambda d: d["otherData"]["rank"]):
        events += d["traceEvents"]
    other = {**docs[0]["otherData"], "rank": None, "ranks": sorted(ranks)}
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": other}


_REQUIRED = {
    "X": ("name", "ts", "dur", "pid", "tid"),
    "i": ("name", "ts", "pid", "tid"),
    "b": ("name", "cat", "ts", "pid"),
    "e": ("name", "cat", "ts", "pid"),
    "s": ("name", "cat", "id", "ts", "pid", "tid"),
    "t": ("name", "cat", "id", "ts", "pid", "tid"),
    "f": ("name", "cat", "id", "ts", "pid", "tid"),
    "C": ("name", "ts", "pid", "args"),
    "M": ("name", "pid", "args"),
}


def check_trace(doc: dict[str, Any]) -> list[str]:
    """Problems with a trace against the trace-event format's rules, as gradsync writes it
    (empty: fine): known phases with their fields and finite times; slices on one thread
    nest (a partial overlap would land on an overflow track); every async begin has its end,
    later, with the same name; every flow starts once, ends once, in time order; counters
    carry numbers."""
    problems: list[str] = []
    events = doc.get("traceEvents")
    if not isinstance(events, list):
        return ["no traceEvents list"]
    slices: dict[tuple[Any, Any], list[tuple[float, float, str]]] = {}
    asyncs: dict[tuple[Any, Any, str], list[tuple[str, float]]] = {}
    flows: dict[Any, list[tuple[str, float]]] = {}
    for i, e in enumerate(events):
        ph = e.get("ph")
        if ph not in _REQUIRED:
            problems.append(f"event {i}: unknown phase {ph!r}")
            continue
        missing = [k for k in _REQUIRED[ph] if k not in e]
        if missing:
            problems.append(f"event {i} ({ph} {e.get('name')!r}): missing {missing}")
            continue
        if ph != "M" and not _finite(e["ts"]):
            problems.append(f"event {i} ({e['name']!r}): ts {e['ts']!r} is not a finite number")
            continue
        if ph == "X":
            if not _finite(e["dur"]) or e["dur"] < 0:
                problems.append(f"event {i} ({e['name']!r}): dur {e['dur']!r} is not a duration")
                continue
            # ends to the nanosecond, the format's precision (ts + dur may carry float noise)
            slices.setdefault((e["pid"], e["tid"]), []).append(
                (e["ts"], round(e["ts"] + e["dur"], 3), e["name"])
            )
        elif ph in ("b", "e"):
            ident = e.get("id2", {}).get("local") if isinstance(e.get("id2"), dict) else e.get("id")
            if ident is None:
                problems.append(f"event {i} ({ph} {e['name']!r}): async event without id or id2")
                continue
            asyncs.setdefault((e["pid"], ident, e["cat"]), []).append((ph + e["name"], e["ts"]))
        elif ph in ("s", "t", "f"):
            flows.setdefault((e["cat"], e["id"]), []).append((ph, e["ts"]))
        elif ph == "C" and (not e["args"] or not all(_finite(v) for v in e["args"].values())):
            problems.append(f"event {i} (counter {e['name']!r}): args must be numbers")
    for (pid, tid), spans in slices.items():
        problems += _check_nesting(pid, tid, spans)
    for (pid, ident, cat), marks in asyncs.items():
        if len(marks) != 2 or marks[0][0][0] != "b" or marks[1][0][0] != "e":
            problems.append(
                f"pid {pid}: async {cat} {ident!r} is not one begin then one end ({len(marks)} events)"
            )
        elif marks[0][0][1:] != marks[1][0][1:] or marks[1][1] < marks[0][1]:
            problems.append(f"pid {pid}: async {cat} {ident!r} ends before it begins or under another name")
    for (cat, ident), marks in flows.items():
        kinds = [k for k, _ in marks]
        if kinds.count("s") != 1 or kinds.count("f") != 1 or kinds[0] != "s" or kinds[-1] != "f":
            problems.append(f"flow {cat} {ident}: expected one start first and one end last, got {kinds}")
        elif any(b[1] < a[1] for a, b in itertools.pairwise(marks)):
            problems.append(f"flow {cat} {ident}: its steps go back in time")
    return problems


def _check_nesting(pid: Any, tid: Any, spans: list[tuple[float, float, str]]) -> list[str]:
    """Slices of one thread must nest: each one inside the slice still open, or after it."""
    out = []
    stack: list[tuple[float, float, str]] = []
    for s in sorted(spans, key=lambda x: (x[0], -x[1])):
        while stack and stack[-1][1] <= s[0]:
            stack.pop()
        if stack and s[1] > stack[-1][1]:
            top = stack[-1]
            out.append(
                f"pid {pid} tid {tid}: {s[2]!r} [{s[0]}, {s[1]}] overlaps {top[2]!r} [{top[0]}, {top[1]}] "
                "without nesting"
            )
            if len(out) > 5:
                break
            continue
        stack.append(s)
    return out


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


def iter_slices(doc: dict[str, Any], tid: int | None = None) -> Iterator[dict[str, Any]]:
    """The complete (``X``) events of a trace, optionally of one thread."""
    for e in doc["traceEvents"]:
        if e.get("ph") == "X" and (tid is None or e.get("tid") == tid):
            yield e
