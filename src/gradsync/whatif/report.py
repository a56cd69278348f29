"""The simulator's outputs: a table, markdown, PNG plots (the network-bottleneck paper's figures
3/6, 7 and 8) and a Chrome trace of simulated steps in the timeline format of
:mod:`gradsync.observe.trace`.

References:

- network-bottleneck paper: Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gradsync.observe.trace_events import COMM as COMM_TID
from gradsync.observe.trace_events import COMPUTE as COMPUTE_TID
from gradsync.observe.trace_events import TRACE_FORMAT, TRAINING, metadata_events, slice_event, write_json
from gradsync.whatif.simulate import COMM, COMPUTE, MAIN, Span

COLUMNS = ("contender", "step ms", "exposed sync ms", "scaling factor", "vs local", "MB/cable/step",
           "network use", "notes")  # fmt: skip
_TIDS = {MAIN: TRAINING, COMPUTE: COMPUTE_TID, COMM: COMM_TID}
_X_LABEL = {
    "inter": "inter-node bandwidth (Gbit/s)", "nodes": "nodes", "per_node": "GPUs per node",
    "ratio": "compression ratio", "inter_latency": "inter-node latency (us)",
}  # fmt: skip


def cells(r: dict[str, Any]) -> list[str]:
    return [
        r["contender"], f"{r['step_ms']:.1f}", f"{r['exposed_ms']:.1f}", f"{r['scaling_factor']:.3f}",
        f"{r['scaling_vs_local']:.3f}", f"{r['cable_mb']:.2f}", f"{100 * r['utilization']:.0f}%", r["notes"],
    ]  # fmt: skip


def point_key(r: dict[str, Any]) -> str:
    return f"{r['nodes']}x{r['per_node']}, inter {r['inter']}, {r['inter_latency_us']:g} us" + (
        f", ratio {r['ratio']:g}" if "ratio" in r else ""
    )


def slower_on_faster_links(rows: list[dict[str, Any]], tolerance: float = 0.01) -> list[str]:
    """Warnings for contenders predicted slower on a faster inter-node link than on a slower one,
    everything else alike (by more than ``tolerance``). Where it happens the contender's plan
    differs between the two rates: the planner compresses a bucket only where that halves its
    predicted time, so on a faster link it may keep buckets dense whose compression still paid;
    the engine decides the same way, so the prediction keeps it, and says so."""
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        key = (r["contender"], r["nodes"], r["per_node"], r["inter_latency_us"], r.get("ratio"))
        groups.setdefault(key, []).append(r)
    out = []
    for (name, nodes, per_node, *_), group in groups.items():
        best: dict[str, Any] | None = None  # the fastest step on a slower link so far
        for r in sorted(group, key=lambda r: r["inter_bps"]):
            if best is not None and r["step_ms"] > (1 + tolerance) * best["step_ms"]:
                out.append(
                    f"{name} on {nodes}x{per_node}: {r['step_ms']:.1f} ms at inter {r['inter']} against "
                    f"{best['step_ms']:.1f} ms at {best['inter']} ({r['notes'] or 'its plan'} against "
                    f"{best['notes'] or 'its plan'}): the planner compresses a bucket only where that "
                    "halves its time, and on the faster link it kept more of them dense"
                )
            if best is None or r["step_ms"] < best["step_ms"]:
                best = r
    return out


def markdown(result: dict[str, Any]) -> str:
    out = []
    rows = result["rows"]
    for key in dict.fromkeys(point_key(r) for r in rows):
        out += [f"**{key}**", "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        out += ["| " + " | ".join(cells(r)) + " |" for r in rows if point_key(r) == key]
        out.append("")
    out += [f"note: {n}" for n in result.get("notes", [])]
    return "\n".join(out)


def _x_value(r: dict[str, Any], key: str) -> float:
    if key == "inter":
        return r["inter_bps"] / 1e9
    if key == "inter_latency":
        return float(r["inter_latency_us"])
    return float(r[key])


def plot(result: dict[str, Any], path: str) -> None:
    """Scaling factor against the first swept quantity, one line per contender (and per value of
    any other swept quantity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweeps = result.get("sweeps") or []
    key = sweeps[0][0] if sweeps else None
    others = [k for k, _ in sweeps[1:]]
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    lines: dict[str, list[tuple[float, float]]] = {}
    for r in result["rows"]:
        label = r["template"] + "".join(f", {k}={r.get(k) if k != 'inter' else r['inter']}" for k in others)
        x = _x_value(r, key) if key else 0.0
        lines.setdefault(label, []).append((x, r["scaling_factor"]))
    for label, pts in lines.items():
        pts.sort()
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    if key in ("inter", "ratio", "inter_latency"):
        ax.set_xscale("log")
    ax.set_xlabel(_X_LABEL.get(key or "", "configuration"))
    ax.set_ylabel("scaling factor T_n / (n T_1)")
    ax.set_ylim(0, 1.05)
    ax.grid(True, alpha=0.3)
    ax.set_title(result.get("title", "gradsync whatif"), fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def trace_document(steps: list[tuple[str, list[Span], float]], nodes: int, per_node: int) -> dict[str, Any]:
    """Simulated steps as a ``gradsync.trace/1`` document: one process per contender
    (``steps``: name, spans, step seconds), threads as in a measured trace."""
    events: list[dict[str, Any]] = []
    for pid, (name, spans, step_s) in enumerate(steps):
        meta = metadata_events(pid, pid, 0)
        meta[0]["args"]["name"] = f"{name} (simulated)"
        events += meta
        merged: list[Span] = []
        for s in sorted(spans, key=lambda s: (s.thread, s.start)):
            last = merged[-1] if merged else None
            if (
                last
                and s.thread == MAIN
                and last.thread == MAIN
                and s.label == last.label
                and abs(s.start - last.end) < 1e-12
            ):
                last.end = s.end
            else:
                merged.append(Span(s.thread, s.label, s.start, s.end, s.bucket, s.task, s.args))
        for s in merged:
            args: dict[str, Any] = {**s.args, "simulated": True}
            if s.bucket >= 0:
                args["bucket"] = s.bucket
            if s.task:
                args["task"] = s.task
            name_ = f"{s.task}: {s.label}" if s.task and s.thread != MAIN else s.label
            start, end = round(s.start * 1e6, 3), round(s.end * 1e6, 3)  # both ends alike: no overlap
            e = slice_event(name_, "whatif", _TIDS[s.thread], start, end, args)
            e["pid"], e["dur"] = pid, round(end - start, 3)
            events.append(e)
        events.append(
            {"name": "step end", "ph": "i", "s": "t", "pid": pid, "tid": TRAINING, "ts": step_s * 1e6}
        )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": TRACE_FORMAT, "run_id": "whatif", "rank": None, "ranks": list(range(len(steps))),
            "world": nodes * per_node, "nodes": nodes, "per_node": per_node, "steps": 1,
            "simulated": True, "processes": [s[0] for s in steps],
        },
    }  # fmt: skip


def write_trace(path: str, doc: dict[str, Any]) -> None:
    write_json(Path(path), doc)
