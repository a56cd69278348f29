"""The trace events gradsync writes, and the files they go to.

The format's id (:data:`TRACE_FORMAT`), the thread ids of a rank's tracks and their names, the
builders of a complete slice, a flow step and a rank's metadata events, where each rank writes
its own part of a trace (:func:`rank_file`) and the atomic JSON write. The timeline these make is
described in :mod:`gradsync.observe.trace`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

TRACE_FORMAT = "gradsync.trace/1"

TRAINING, COMPUTE, COMM = 1, 2, 3
THREAD_NAMES = {TRAINING: "training thread", COMPUTE: "compute thread", COMM: "communication thread"}


def to_us(t: float) -> float:
    """Seconds -> microseconds rounded to the nanosecond (both ends of a slice round alike)."""
    return round(t * 1e6, 3)


def rank_file(path: str | os.PathLike[str], rank: int) -> Path:
    """Where rank ``rank`` writes its own part of the trace ``path``: ``trace.rank1.json``."""
    p = Path(path)
    suffix = p.suffix or ".json"
    return p.with_name(f"{p.name[: -len(p.suffix)] if p.suffix else p.name}.rank{rank}{suffix}")


def slice_event(
    name: str, cat: str, tid: int, start: float, end: float, args: dict[str, Any]
) -> dict[str, Any]:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "tid": tid,
        "ts": start,
        "dur": max(end - start, 0.0),
        "args": args,
    }


def flow_event(ph: str, flow: int, name: str, tid: int, ts: float) -> dict[str, Any]:
    e: dict[str, Any] = {"name": name, "cat": "flow", "ph": ph, "id": flow, "tid": tid, "ts": ts}
    if ph == "f":
        e["bp"] = "e"  # bind to the slice that encloses it (the decode), not the next one
    return e


def metadata_events(pid: int, rank: int, node: int) -> list[dict[str, Any]]:
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
