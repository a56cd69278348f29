"""``gradsync bench train``: gradsync against PyTorch DDP and its communication hooks, in one run.

For one model and per-worker batch, on the world it is launched in (torchrun, or the emulated
cluster with ``--emulate 2x2 --link 100mbit``, which this command sets up, uses and takes down),
every contender trains the same model on the same data for a few unmeasured and measured steps
(the measuring is :mod:`gradsync.apps.commands.bench.step`'s). Per contender: samples/s over the
world, the step split into compute and exposed synchronization, bytes per worker per step that
crossed nodes, speed-up over DDP, and the network-bottleneck paper's scaling factor T_n / (n T_1),
where T_1 is the samples/s of one worker training alone on this machine, measured in the same run
(the other ranks wait). Because the emulated nodes share this machine's cores, the factor against
``local`` (every worker computing at once, no synchronization: the best the n workers can do here)
is reported too.

Writes a table, ``--json`` and a PNG bar chart (``--png``, matplotlib).

References:

- network-bottleneck paper: Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.apps.command_line import command_line
from gradsync.apps.commands.bench import step as bench_step
from gradsync.apps.commands.bench.support import nic as bench_nic
from gradsync.apps.commands.bench.support.output import markdown_table, save_result
from gradsync.apps.commands.bench.support.world import check_world_options, run_emulated
from gradsync.apps.models import parameter_count
from gradsync.codecs.config import split_spec_list
from gradsync.collectives import Topology
from gradsync.observe.profiler import default_loss

DEFAULT_CONTENDERS = (
    "local,ddp,ddp-fp16,ddp-powersgd:rank=1,ddp-powersgd:rank=4,auto,hierarchical,hitopk:density=0.01,"
    "allgather/mstopk:density=0.01,dgc:density=0.01,powersgd:rank=4,ring/powersgd:rank=1,ps+local/terngrad,ring+local/terngrad,"
    "ps+local/onebit,ring+local/onebit"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    bench_step.add_arguments(p)
    p.set_defaults(contenders=DEFAULT_CONTENDERS, warmup=3, steps=3)
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds of all contenders (default 3); the ratios are reported as the median "
        "over the rounds with their spread",
    )
    p.add_argument(
        "--emulate",
        metavar="NODESxPER_NODE",
        help="run on an emulated cluster of this shape (root; gradsync cluster run)",
    )
    p.add_argument("--link", default="100mbit", help="the emulated cluster's cable rate (with --emulate)")
    p.add_argument("--png", metavar="PATH", help="a bar chart of samples/s per contender")


def _single_worker(base: nn.Module, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace) -> float:
    """Median step time (s) of one worker training alone: rank 0 trains, the others wait."""
    times: list[float] = []
    if dist.get_rank() == 0:
        model = copy.deepcopy(base)
        opt = bench_step.inner_optimizer(model, args)
        for i in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            default_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= args.warmup:
                times.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(times) if times else 0.0], dtype=torch.float64)
    dist.broadcast(t, 0)
    return float(t[0])


def round_order(contenders: list[str], r: int) -> list[str]:
    """The contenders' order in round ``r``: as given, every other round reversed, so that a
    drift of the machine's speed over the run does not always favour the same contender."""
    return list(contenders) if r % 2 == 0 else list(reversed(contenders))


_MEDIAN_FIELDS = ("step_ms", "mean_step_ms", "forward_ms", "backward_ms", "optimizer_ms", "exposed_ms",
                  "compress_ms", "comm_ms", "cable_mb", *bench_nic.ROW_FIELDS)  # fmt: skip


def merge_rounds(rounds: list[bench_step.StepRow]) -> bench_step.StepRow:
    """One contender's rounds as one row: the median over the rounds of each time, the last
    round's plan summary, every round's step time in ``round_step_ms``."""
    out = copy.copy(rounds[-1])
    for name in _MEDIAN_FIELDS:
        values = [v for r in rounds if (v := getattr(r, name)) is not None]
        setattr(out, name, statistics.median(values) if values else None)
    levels = sorted({k for r in rounds for k in r.sent_mb})
    out.sent_mb = {k: statistics.median(r.sent_mb.get(k, 0.0) for r in rounds) for k in levels}
    out.steps = sum(r.steps for r in rounds)
    out.round_step_ms = [r.step_ms for r in rounds]
    return out


def measure_contenders(
    contenders: list[str], base: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor,
    args: argparse.Namespace, before_round: Callable[[int], None] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """Each contender's measured step (:func:`gradsync.apps.commands.bench.step._measure`) in ``args.rounds``
    interleaved rounds (:func:`round_order`); a contender's model is built afresh in each round
    and its plan and compression state carried (:class:`gradsync.apps.commands.bench.step.Carry`). A DDP
    contender's exposed synchronization is its backward pass beyond ``local``'s. ``before_round(r)``
    runs on every rank before round ``r`` (0-based), e.g. a probe of the host at that moment."""
    rounds = max(int(getattr(args, "rounds", 1)), 1)
    carry = {name: bench_step.Carry() for name in contenders}
    measured: dict[str, list[bench_step.StepRow]] = {name: [] for name in contenders}
    details: dict[str, Any] = {}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for name in round_order(contenders, r):
            row, extra = bench_step.measure_contender(name, base, topo, x, y, args, carry[name])
            measured[name].append(row)
            if "closed_loop" in details.get(name, {}):  # the re-plans happened in the first round
                extra["closed_loop"] = details[name]["closed_loop"]
            details[name] = extra
            if topo.rank == 0:
                where = f"round {r + 1}/{rounds}  " if rounds > 1 else ""
                print(f"  {where}{name:36s} step {row.step_ms:9.1f} ms", file=sys.stderr, flush=True)
    rows = {name: merge_rounds(measured[name]) for name in contenders}
    local = rows.get("local")
    for name, row in rows.items():
        if bench_step.is_ddp(name) and local is not None:
            row.exposed_ms = max(row.backward_ms - local.backward_ms, 0.0)
    return [asdict(rows[name]) for name in contenders], details


def derive(rows: list[dict[str, Any]], world: int, per_node: int, batch: int, single_s: float) -> None:
    """Add samples/s, compute ms, crossing bytes, speed-up over DDP and scaling factors to each row."""
    by_name = {r["contender"]: r for r in rows}
    ddp, local = by_name.get("ddp"), by_name.get("local")
    single_rate = batch / single_s if single_s > 0 else None
    for r in rows:
        r["samples_per_s"] = world * batch / (r["step_ms"] / 1e3)
        r["sync_ms"] = r["exposed_ms"] or 0.0
        r["compute_ms"] = r["step_ms"] - r["sync_ms"]
        if r["cable_mb"] is not None:
            r["crossing_mb_per_worker"] = r["cable_mb"] / per_node
        else:  # off the testbed only gradsync knows what it sent across nodes
            r["crossing_mb_per_worker"] = r["sent_mb"].get("inter") if r["sent_mb"] else None
        r["speedup_vs_ddp"] = ddp["step_ms"] / r["step_ms"] if ddp else None
        r["scaling_factor"] = r["samples_per_s"] / (world * single_rate) if single_rate else None
        r["scaling_vs_local"] = local["step_ms"] / r["step_ms"] if local else None


def round_ratios(faster: dict[str, Any], slower: dict[str, Any]) -> dict[str, Any] | None:
    """How many times faster ``faster`` stepped than ``slower``, round by round (the two ran side
    by side in every round): the median over the rounds, the smallest and the largest, and every
    round's. None without per-round times."""
    a, b = faster.get("round_step_ms") or [], slower.get("round_step_ms") or []
    if not a or len(a) != len(b):
        return None
    ratios = [sb / sa for sa, sb in zip(a, b, strict=True) if sa > 0]
    if not ratios:
        return None
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "rounds": ratios}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline ratios: the best gradsync contender against DDP and against the best DDP hook,
    and ``auto`` against DDP, the best hook and the best fixed per-step gradsync contender (outer
    loops are not among those: they change what is trained), and the best outer loop against DDP
    and the best contender that synchronizes every step. Each ratio is
    of the medians over the rounds; ``*_rounds`` holds the per-round ratios' median and spread."""
    ours = [r for r in rows if r["contender"] != "local" and not bench_step.is_ddp(r["contender"])]
    hooks = [r for r in rows if r["contender"].startswith("ddp-")]
    ddp = next((r for r in rows if r["contender"] == "ddp"), None)
    out: dict[str, Any] = {}

    def ratio(key: str, a: dict[str, Any], b: dict[str, Any], into: dict[str, Any] = out) -> None:
        into[key] = a["samples_per_s"] / b["samples_per_s"]
        spread = round_ratios(a, b)
        if spread is not None:
            into[key + "_rounds"] = spread

    if ours:
        best = max(ours, key=lambda r: r["samples_per_s"])
        out["best"] = best["contender"]
        out["best_scaling_factor"] = best["scaling_factor"]
        out["best_scaling_vs_local"] = best["scaling_vs_local"]
        top = max(hooks, key=lambda r: r["samples_per_s"]) if hooks else None
        if ddp:
            ratio("best_over_ddp", best, ddp)
        if top:
            out["best_hook"] = top["contender"]
            ratio("best_over_best_hook", best, top)
        autos = [r for r in ours if is_automatic(r["contender"])]
        # (auto is compared with the per-step schemes: an outer loop changes what is trained)
        fixed = [
            r for r in ours if not is_automatic(r["contender"]) and not bench_step.is_outer(r["contender"])
        ]
        best_fixed = max(fixed, key=lambda r: r["samples_per_s"]) if fixed else None
        if best_fixed is not None and autos:
            out["best_fixed"] = best_fixed["contender"]
        for auto in autos:
            # "auto" itself keeps the flat keys; every other automatic contender (auto@...,
            # auto:candidates=...) gets the same keys under others[name]
            name = auto["contender"]
            keys: dict[str, Any] = out if name == "auto" else {}
            if name != "auto":
                out.setdefault("others", {})[name] = keys
            keys["auto_scaling_vs_local"] = auto["scaling_vs_local"]
            if ddp:
                ratio("auto_over_ddp", auto, ddp, keys)
            if top:
                ratio("auto_over_best_hook", auto, top, keys)
            if best_fixed is not None:
                ratio("auto_over_best_fixed", auto, best_fixed, keys)
    # the outer loop against every contender that synchronizes each step (gradsync's schemes,
    # PyTorch's hooks, the self-syncing optimizers; not plain DDP)
    outers = [r for r in rows if bench_step.is_outer(r["contender"])]
    per_step = [
        r for r in rows if r["contender"] not in ("local", "ddp") and not bench_step.is_outer(r["contender"])
    ]
    if outers and per_step:
        best_outer = max(outers, key=lambda r: r["samples_per_s"])
        rival = max(per_step, key=lambda r: r["samples_per_s"])
        out["best_outer"], out["best_per_step"] = best_outer["contender"], rival["contender"]
        ratio("outer_over_best_per_step", best_outer, rival)
        if ddp:
            ratio("outer_over_ddp", best_outer, ddp)
    return out


def is_automatic(name: str) -> bool:
    """A contender whose plan gradsync chooses: ``auto``, ``auto@...``, ``auto:candidates=...``."""
    scheme = bench_step.contender_options(name)[0]
    return scheme == "auto" or scheme.startswith("auto:")


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    contenders = [bench_step.check_contender(c) for c in split_spec_list(args.contenders)]
    bench_step.SyncConfig.from_options(bench_step.parse_sync_options(args.sync_option))
    topo, base, x, y = bench_step.join_with_batch(args)
    rank0 = topo.rank == 0
    link = os.environ.get("TB_RATE")
    if rank0:
        print(
            f"gradsync bench train: {bench_step.model_label(args)} ({parameter_count(base) / 1e6:.1f} M "
            f"parameters), batch {args.batch_size} per worker, {topo.nodes} x {topo.per_node} ranks, "
            f"link {link or 'unknown'}",
            file=sys.stderr,
            flush=True,
        )
    single_s = _single_worker(base, x, y, args)
    rows, details = measure_contenders(contenders, base, topo, x, y, args)
    derive(rows, topo.world, topo.per_node, args.batch_size, single_s)
    if not rank0:
        return None
    result = {
        "command": command_line(args),
        "model": bench_step.model_label(args),
        "parameters": parameter_count(base),
        "batch_size": args.batch_size,
        "nodes": topo.nodes,
        "per_node": topo.per_node,
        "link": link,
        "single_worker_step_ms": single_s * 1e3,
        "rows": rows,
        "summary": summarize(rows),
        "details": details,
    }
    if bench_nic.enabled(args):
        result["nic"] = bench_nic.summary(result)
    return result


COLUMNS = (
    "contender",
    "samples/s",
    "step ms",
    "compute ms",
    "exposed sync ms",
    "MB/worker/step across nodes",
    "speed-up vs DDP",
    "scaling factor",
    "vs local",
)


def _num(v: float | None, fmt: str) -> str:
    """A figure for the table, or "n/a" where it could not be measured (a ratio to a contender
    that was not run, the crossing bytes of DDP off the testbed)."""
    return "n/a" if v is None else format(v, fmt)


def _cells(r: dict[str, Any]) -> list[str]:
    f = _num

    return [
        r["contender"],
        f(r["samples_per_s"], ".1f"),
        f(r["step_ms"], ".1f"),
        f(r["compute_ms"], ".1f"),
        f(r["exposed_ms"], ".1f"),
        f(r["crossing_mb_per_worker"], ".2f"),
        f(r["speedup_vs_ddp"], ".2f"),
        f(r["scaling_factor"], ".2f"),
        f(r["scaling_vs_local"], ".2f"),
    ]


def headline(summary: dict[str, Any]) -> str | None:
    """The summary as one line (None when no gradsync contender ran); a ratio whose reference
    (``ddp``, a DDP hook, ``local``) was not among the contenders is left out or shown "n/a"."""
    if "best" not in summary:
        return None
    parts = [f"best gradsync contender {summary['best']}:"]
    if "best_over_ddp" in summary:
        parts.append(f"{summary['best_over_ddp']:.2f}x DDP's samples/s,")
    if "best_hook" in summary:
        hook = summary["best_hook"]
        parts.append(f"{summary['best_over_best_hook']:.2f}x the best PyTorch hook's ({hook}),")
    parts.append(
        f"scaling factor {_num(summary['best_scaling_factor'], '.2f')} "
        f"(vs local {_num(summary['best_scaling_vs_local'], '.2f')})"
    )
    line = " ".join(parts)
    for name, keys in [("auto", summary), *summary.get("others", {}).items()]:
        auto = [
            f"{keys[key]:.2f}x {what}{_spread(keys.get(key + '_rounds'))}"
            for key, what in (
                ("auto_over_ddp", "DDP"),
                ("auto_over_best_hook", f"the best hook ({summary.get('best_hook')})"),
                ("auto_over_best_fixed", f"the best fixed gradsync contender ({summary.get('best_fixed')})"),
            )
            if key in keys
        ]
        if auto:
            line += f"\n{name}: " + ", ".join(auto)
    if "best_outer" in summary:
        spread = _spread(summary.get("outer_over_best_per_step_rounds"))
        outer = [
            f"{summary['outer_over_best_per_step']:.2f}x the best contender synchronizing every step "
            f"({summary['best_per_step']}){spread}"
        ]
        if "outer_over_ddp" in summary:
            spread = _spread(summary.get("outer_over_ddp_rounds"))
            outer.append(f"{summary['outer_over_ddp']:.2f}x DDP{spread}")
        line += f"\nouter loop {summary['best_outer']}: " + ", ".join(outer)
    return line


def _spread(rounds: dict[str, Any] | None) -> str:
    """`` (rounds: median 1.04, 0.98-1.09)`` for a per-round ratio summary, empty without one."""
    if not rounds or len(rounds["rounds"]) < 2:
        return ""
    return f" (per round: median {rounds['median']:.2f}, {rounds['min']:.2f}-{rounds['max']:.2f})"


def columns(result: dict[str, Any]) -> tuple[str, ...]:
    """The table's columns: the NIC figures' only with ``--nic``."""
    return COLUMNS + bench_nic.COLUMNS if "nic" in result else COLUMNS


def cells(result: dict[str, Any], r: dict[str, Any]) -> list[str]:
    return _cells(r) + bench_nic.cells(r) if "nic" in result else _cells(r)


def markdown(result: dict[str, Any]) -> str:
    return markdown_table(columns(result), [cells(result, r) for r in result["rows"]])


def plot(result: dict[str, Any], path: str) -> None:
    """Samples/s per contender as horizontal bars (PyTorch's in grey, gradsync's in blue)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [r["contender"] for r in rows]
    rates = [r["samples_per_s"] for r in rows]
    colors = ["#999999" if bench_step.is_ddp(n) else "#cccccc" if n == "local" else "#1f77b4" for n in names]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    ax.barh(range(len(rows)), rates, color=colors)
    ax.set_yticks(range(len(rows)), names)
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        if r["speedup_vs_ddp"] is not None:
            ax.text(rates[i], i, f" {r['speedup_vs_ddp']:.2f}x DDP", va="center", fontsize=8)
    ax.set_xlabel("samples/s (all workers)")
    where = f"{result['nodes']} x {result['per_node']} ranks, link {result['link'] or 'unknown'}"
    ax.set_title(f"{result['model']} ({result['parameters'] / 1e6:.1f} M parameters), {where}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check(args: argparse.Namespace) -> None:
    """The option values, before any process group or emulated cluster (``ValueError`` naming the
    option)."""
    bench_step.check_sizes(args, ("steps", "threads", "rounds"))
    if args.warmup < 2:
        raise ValueError(f"--warmup must be at least 2 (the PowerSGD hook's dense start), got {args.warmup}")
    names = split_spec_list(args.contenders)
    if not names:
        raise ValueError(f"--contenders must name at least one contender, got {args.contenders!r}")
    for c in names:
        bench_step.check_contender(c)
        if names.count(c) > 1:
            raise ValueError(f"--contenders names {c!r} more than once")
    check_world_options(args)
    bench_step.SyncConfig.from_options(bench_step.parse_sync_options(args.sync_option))
    bench_nic.check(args)


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`)."""
    status = run_emulated(args, "bench train")
    if status is not None:
        return status
    owned = not dist.is_initialized()
    result = run(args)
    if result is not None:
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=f"training throughput, {result['model']}, {result['nodes']} x {result['per_node']} "
            f"ranks, link {result['link']}"
        )
        for col in columns(result):
            table.add_column(col, justify="left" if col == "contender" else "right")
        for r in result["rows"]:
            table.add_row(*cells(result, r))
        (Console() if sys.stdout.isatty() else Console(width=260)).print(table)
        bench_nic.say_reason(result)
        line = headline(result["summary"])
        if line is not None:
            print(line)
        save_result(result, args.json, args.markdown, markdown(result))
        if args.png:
            plot(result, args.png)
        if args.nic_png and bench_nic.plot(result, args.nic_png):
            print(f"NIC throughput plot: {args.nic_png}")
    if owned and dist.is_initialized():
        dist.destroy_process_group()
    return 0
