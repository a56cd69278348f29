"""Reading traces back: load a trace file, merge the per-rank files of one run, check a trace
against the format's rules and iterate its slices (``gradsync trace merge`` / ``check``).
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from typing import Any

from gradsync.observe.trace_events import TRACE_FORMAT


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
