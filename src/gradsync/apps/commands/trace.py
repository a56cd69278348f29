"""``gradsync trace``: merge, check and draw the timelines that ``--trace`` writes.

- ``gradsync trace merge OUT RANKFILE...`` (or ``merge OUT --from trace.json``, which finds
  ``trace.rank*.json``): one trace from the per-rank files of one run, when rank 0 could not
  gather them (a crashed run, or nodes without a shared file system);
- ``gradsync trace check FILE``: the format's rules (see :func:`gradsync.observe.trace.check_trace`);
  exit 1 and the problems when it breaks one;
- ``gradsync trace plot FILE --out PNG [--steps START:STOP]``: a Gantt chart of the timeline
  (matplotlib), one row per rank and thread, for a quick look or a document without a browser.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
from pathlib import Path
from typing import Any

from gradsync.observe.trace import COMM, COMPUTE, TRAINING
from gradsync.observe.trace_events import THREAD_NAMES, write_json
from gradsync.observe.trace_read import check_trace, load_trace, merge_traces


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="trace_command", required=True)
    q = sub.add_parser("merge", help="merge the per-rank files of one traced run")
    q.add_argument("out", help="the merged trace to write")
    q.add_argument("files", nargs="*", help="per-rank files (trace.rank0.json ...)")
    q.add_argument("--from", dest="base", metavar="TRACE", help="merge TRACE's rank files (TRACE.rank*.json)")
    q = sub.add_parser("check", help="check a trace against the trace-event format's rules")
    q.add_argument("file")
    q = sub.add_parser("plot", help="draw a trace as a Gantt chart (PNG)")
    q.add_argument("file")
    q.add_argument("--out", required=True, help="the PNG to write")
    q.add_argument("--steps", default=None, metavar="START:STOP", help="the synchronized steps to draw")


def _steps(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    m = re.fullmatch(r"(\d+):(\d+)", text.strip())
    if not m or int(m.group(1)) >= int(m.group(2)):
        raise ValueError(f"--steps takes START:STOP with 0 <= START < STOP, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def _rank_files(base: str) -> list[str]:
    p = Path(base)
    stem = p.name[: -len(p.suffix)] if p.suffix else p.name
    found = glob.glob(str(p.with_name(f"{glob.escape(stem)}.rank*{p.suffix or '.json'}")))
    return sorted(found, key=lambda f: int(re.findall(r"\.rank(\d+)\.", f)[-1]))


def check(args: argparse.Namespace) -> None:
    if args.trace_command == "merge":
        if bool(args.files) == bool(args.base):
            raise ValueError("trace merge: give the rank files or --from TRACE, one of the two")
        files = args.files or _rank_files(args.base)
        if not files:
            raise ValueError(f"trace merge: no rank files next to {args.base!r} (expected *.rank0.json ...)")
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"trace merge: no such file: {missing[0]!r}")
        args.files = files
    elif args.trace_command in ("check", "plot") and not os.path.isfile(args.file):
        raise ValueError(f"trace {args.trace_command}: no such file: {args.file!r}")
    if args.trace_command == "plot":
        _steps(args.steps)
        if not args.out.lower().endswith(".png"):
            raise ValueError(f"trace plot: --out must name a .png file, got {args.out!r}")


def main(args: argparse.Namespace) -> int:
    if args.trace_command == "merge":
        merged = merge_traces([load_trace(f) for f in args.files])
        problems = check_trace(merged)
        write_json(Path(args.out), merged)
        print(f"gradsync trace: merged {len(args.files)} ranks into {args.out}", file=sys.stderr)
        for line in problems[:20]:
            print(f"  problem: {line}", file=sys.stderr)
        return 1 if problems else 0
    doc = load_trace(args.file)
    if args.trace_command == "check":
        problems = check_trace(doc)
        n = len(doc["traceEvents"])
        if problems:
            print(f"{args.file}: {len(problems)} problems in {n} events", file=sys.stderr)
            for line in problems[:50]:
                print(f"  {line}", file=sys.stderr)
            return 1
        print(f"{args.file}: {n} events, no problems")
        return 0
    plot_gantt(doc, args.out, _steps(args.steps))
    print(f"gradsync trace: wrote {args.out}", file=sys.stderr)
    return 0


_COLORS = {
    "forward": "#4c72b0",
    "backward": "#dd8452",
    "sync wait": "#c44e52",
    "optimizer": "#55a868",
    "encode": "#8172b3",
    "pack": "#937860",
    "merge": "#da8bc3",
    "decode": "#64b5cd",
    "intra": "#2ca02c",
    "inter": "#d62728",
    "world": "#7f7f7f",
}


def _color(e: dict[str, Any]) -> str:
    if e.get("tid") == COMM:
        return _COLORS.get(str(e.get("args", {}).get("level", "world")).split("+")[-1], "#7f7f7f")
    first = str(e["name"]).split(" ")[0]
    return _COLORS.get(e["name"], _COLORS.get(first, "#bbbbbb"))


def plot_gantt(doc: dict[str, Any], out: str, steps: tuple[int, int] | None = None) -> None:
    """Draw the trace's slices, one row per rank and thread, times in ms (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    events = [e for e in doc["traceEvents"] if e.get("ph") in ("X", "i")]
    if not events:
        raise ValueError("trace plot: the trace has no slices (were the traced steps ever run?)")
    stepped = [e for e in events if "step" in e.get("args", {})]
    lo, hi = min(e["ts"] for e in events), max(e["ts"] + e.get("dur", 0) for e in events)
    if steps is not None:
        chosen = [e for e in stepped if steps[0] <= e["args"]["step"] < steps[1]]
        if not chosen:
            raise ValueError(f"trace plot: no events of steps {steps[0]}:{steps[1]} in the trace")
        lo = min(e["ts"] for e in chosen)
        hi = max(e["ts"] + e.get("dur", 0) for e in chosen)
        # the forward pass and the optimizer that lead into and follow these steps
        before = [e["ts"] for e in events if e["name"] == "forward" and e["ts"] < lo]
        lo = max(before, default=lo)
    pids = sorted({e["pid"] for e in events})
    tids = (TRAINING, COMPUTE, COMM)
    rows = [(p, t) for p in pids for t in tids]
    fig, ax = plt.subplots(figsize=(14, 0.5 * len(rows) + 1.6))
    for y, (pid, tid) in enumerate(rows):
        bars, colors = [], []
        for e in events:
            if e["pid"] != pid or e.get("tid") != tid or e["ph"] != "X":
                continue
            start, end = e["ts"], e["ts"] + e["dur"]
            if end < lo or start > hi:
                continue
            bars.append(((start - lo) / 1e3, max(e["dur"], 1.0) / 1e3))
            colors.append(_color(e))
        ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colors, linewidth=0)
        for e in events:
            if e["pid"] == pid and e.get("tid") == tid and e["ph"] == "i" and lo <= e["ts"] <= hi:
                ax.plot([(e["ts"] - lo) / 1e3] * 2, [y - 0.45, y + 0.45], color="black", linewidth=0.6)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"rank {p}: {THREAD_NAMES[t]}" for p, t in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_xlim(0, (hi - lo) / 1e3)
    title = "gradsync timeline" + (f", steps {steps[0]} to {steps[1] - 1}" if steps else "")
    ax.set_title(title + " (black ticks: a bucket's last gradient is ready)")
    legend = [Patch(color=c, label=k if k not in ("intra", "inter", "world") else f"collective {k}")
              for k, c in _COLORS.items()]  # fmt: skip
    ax.legend(handles=legend, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=6, fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
