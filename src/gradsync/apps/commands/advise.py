"""``gradsync advise``: "will it help?" answered before launch. Every mode gradsync offers, ranked by
predicted time per sample on the cluster, with what each is known to cost in quality.

    gradsync advise --profile docs/results/profile-vgg16-cpu.json --cluster 4x8 --inter 10gbit
    gradsync advise --profile docs/results/profile-resnet50-cpu.json --step-time 90ms --cluster 16x8 \\
        --sweep inter=1,10,100gbit --sweep nodes=1,4,16,128

It takes ``gradsync whatif``'s options (the profile, the cluster, the links or rates, the compute
scale; ``--scheme`` lists the modes, by default every family: DDP and its hooks, gradsync's
per-step schemes and ``auto``, the self-syncing Adam optimizers, the outer loop dense and
compressed) and predicts each with the same simulator (docs/whatif.md). For each point it prints
the modes fastest first, their speed against DDP, and the measured quality cost of their family
(:mod:`gradsync.whatif.quality`, cited by file), and then its advice:

- **dense** when the fastest lossless mode (DDP, hierarchical all-reduce) is within
  ``--dense-margin`` (5 %) of the fastest mode: compression would not pay for its risk;
- otherwise the fastest mode, and, when that mode's family has cost more than ``--quality-budget``
  (5 %) perplexity in the project's measurements, also the fastest mode within that budget.

With ``--sweep`` the last table lists the advice per point: where it switches from dense to a
compressed mode, and to the outer loop.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gradsync.apps.commands import whatif

ADVISE_MODES = ",".join((
    "ddp", "ddp-fp16", "ddp-powersgd:rank=4", "hierarchical", "hitopk:density=0.01", "powersgd:rank=4",
    "auto", "onebit-adam", "zeroone-adam", "outer@every=10", "outer@every=10@codec=terngrad:bits=4",
    "outer@every=10@codec=terngrad:bits=4@fragments=4@delay=2", "fsdp", "hsdp", "hsdp/topk:density=0.01",
))  # fmt: skip


DENSE_MARGIN = 0.05
"""Dense synchronization is advised when its step is within this fraction of the fastest mode's."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    whatif.add_arguments(p, pictures=False)
    p.set_defaults(scheme=ADVISE_MODES)
    p.add_argument("--dense-margin", type=float, default=DENSE_MARGIN,
                   help="advise dense synchronization when it is within this fraction of the fastest "
                        "mode (default 0.05)")  # fmt: skip
    p.add_argument("--quality-budget", type=float, default=5.0,
                   help="perplexity gap in percent (5 means 5 %%) a mode's family may have shown in the "
                        "project's measurements to be advised without a warning; a mode nobody measured "
                        "is never within it (default 5)")  # fmt: skip


def check(args: argparse.Namespace) -> None:
    whatif.check(args)
    if not 0 <= args.dense_margin < 1:
        raise ValueError(f"--dense-margin must be in [0, 1), got {args.dense_margin}")
    if not args.quality_budget >= 0:
        raise ValueError(f"--quality-budget must be a non-negative percentage, got {args.quality_budget}")


def advise_point(rows: list[dict[str, Any]], dense_margin: float, budget: float) -> dict[str, Any]:
    """The ranking and the advice for one point's predicted ``rows`` (see the module). What is not
    a training mode (``local``, the ``paper02`` formula) is ranked for reference, never advised;
    a mode whose family nobody measured is never offered as within the quality budget."""
    from gradsync.whatif.quality import quality_of

    ranked = sorted(rows, key=lambda r: r["step_ms"])
    quality = {r["contender"]: quality_of(r["contender"], r.get("nodes")) for r in rows}
    ddp = next((r for r in rows if r["contender"] == "ddp"), None)
    out: dict[str, Any] = {
        "ranking": [
            {
                "contender": r["contender"],
                "step_ms": r["step_ms"],
                "vs_fastest": r["step_ms"] / ranked[0]["step_ms"],
                "speedup_vs_ddp": ddp["step_ms"] / r["step_ms"] if ddp else None,
                "quality": quality[r["contender"]].text(),
                "quality_worst_pct": quality[r["contender"]].worst,
                "lossless": quality[r["contender"]].lossless,
                "mode": quality[r["contender"]].is_mode,
            }
            for r in ranked
        ]
    }
    modes = [r for r in ranked if quality[r["contender"]].is_mode]
    if not modes:
        out["choice"], out["kind"] = None, "none"
        out["advice"] = "nothing to advise: none of these is a training mode"
        return out
    fastest = modes[0]
    dense = [r for r in modes if quality[r["contender"]].lossless]
    if dense and dense[0]["step_ms"] <= (1 + dense_margin) * fastest["step_ms"]:
        best = dense[0]
        out["choice"], out["kind"] = best["contender"], "dense"
        if best is fastest:
            where = "is the fastest mode"
        else:
            gain = best["step_ms"] / fastest["step_ms"] - 1
            where = f"is within {gain * 100:.1f} % of the fastest mode ({fastest['contender']})"
        out["advice"] = (
            f"dense synchronization: {best['contender']} {where}; compression would not pay for its risk here"
        )
        return out
    out["choice"], out["kind"] = fastest["contender"], "compressed"
    lead = f" ({ddp['step_ms'] / fastest['step_ms']:.2f}x DDP)" if ddp else ""
    q = quality[fastest["contender"]]
    text = f"{fastest['contender']}{lead}; measured quality cost of its family: {q.text()}"
    if not q.within(budget):
        safe = [r for r in modes if quality[r["contender"]].within(budget)]
        if safe:
            s = safe[0]
            out["within_budget"] = s["contender"]
            slower = s["step_ms"] / fastest["step_ms"]
            text += (
                f". Within a {budget:g} % quality budget: {s['contender']} ({slower:.2f}x the fastest's "
                f"step; {quality[s['contender']].text()})"
            )
    out["advice"] = text
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from gradsync.whatif.report import point_key

    result = whatif.run(args)
    points: list[dict[str, Any]] = []
    rows = result["rows"]
    for key in dict.fromkeys(point_key(r) for r in rows):
        mine = [r for r in rows if point_key(r) == key]
        advice = advise_point(mine, args.dense_margin, args.quality_budget)
        first = mine[0]
        points.append({
            "point": key,
            **{k: first[k] for k in ("nodes", "per_node", "inter", "inter_bps") if k in first},
            **advice,
        })  # fmt: skip
    result["advice"] = points
    return result


def markdown(result: dict[str, Any]) -> str:
    from gradsync.apps.commands.bench.support.output import markdown_table

    parts = []
    for p in result["advice"]:
        parts.append(f"### {p['point']}\n")
        cells = [
            [
                str(i + 1), r["contender"], f"{r['step_ms']:.1f}", f"{r['vs_fastest']:.2f}",
                f"{r['speedup_vs_ddp']:.2f}" if r["speedup_vs_ddp"] is not None else "n/a", r["quality"],
            ]
            for i, r in enumerate(p["ranking"])
        ]  # fmt: skip
        cols = ("rank", "mode", "step ms", "x fastest", "x DDP", "measured quality cost")
        parts.append(markdown_table(cols, cells))
        parts.append(f"\n**advice**: {p['advice']}\n")
    parts += [f"note: {n}" for n in result.get("notes", [])]
    if len(result["advice"]) > 1:
        cells = [
            [p["point"], p["choice"] or "", p["kind"], p.get("within_budget", "")] for p in result["advice"]
        ]
        parts.append("### advice per point\n")
        parts.append(markdown_table(("point", "first choice", "kind", "within the quality budget"), cells))
    return "\n".join(parts) + "\n"


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from gradsync.apps.commands.bench.support.output import save_result

    result = run(args)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    for p in result["advice"]:
        table = Table(title=f"advise: {result['model']}, {p['point']}")
        for col in ("rank", "mode", "step ms", "x fastest", "x DDP", "measured quality cost"):
            table.add_column(col, justify="left" if col in ("mode", "measured quality cost") else "right")
        for i, r in enumerate(p["ranking"]):
            x_ddp = f"{r['speedup_vs_ddp']:.2f}" if r["speedup_vs_ddp"] is not None else "n/a"
            table.add_row(str(i + 1), r["contender"], f"{r['step_ms']:.1f}", f"{r['vs_fastest']:.2f}", x_ddp,
                          r["quality"])  # fmt: skip
        console.print(table)
        console.print(f"advice: {p['advice']}")
    for note in result.get("notes", []):
        print(f"note: {note}")
    if len(result["advice"]) > 1:
        table = Table(title="advice per point")
        for col in ("point", "first choice", "kind", "within the quality budget"):
            table.add_column(col)
        for p in result["advice"]:
            table.add_row(p["point"], p["choice"] or "", p["kind"], p.get("within_budget", ""))
        console.print(table)
    save_result(result, args.json, args.markdown, markdown(result))
    return 0
