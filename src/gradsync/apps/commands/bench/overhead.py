"""``gradsync bench overhead``: what recording a timeline costs a training step.

Launch it like the other distributed benchmarks (torchrun, or ``gradsync cluster launch``). For
one model and scheme it trains, in the same session and on the same data, two contenders in
interleaved rounds (off, on, on, off, off, on ...: neither always goes first):

- ``off``: ``gradsync.wrap(model, scheme)``, tracing off (the default);
- ``on``: the same with ``trace=...`` recording every measured step.

Per round and contender: the median over the measured steps of the slowest rank's step time.
Reported: the per-round ratio on / off (median, min, max over the rounds), the time writing the
trace took (clock alignment, gathering, JSON; once, at the end, not in any step), and what the
per-step bookkeeping that runs with tracing off costs (the per-bucket statistics), timed on the
live engine against the step time.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.apps.command_line import command_line
from gradsync.apps.commands.bench.support.output import save_result
from gradsync.apps.commands.bench.support.world import add_world_arguments, join_world, max_over_ranks
from gradsync.apps.models import build_model_for, models_for
from gradsync.collectives import Topology
from gradsync.sync import Scheme


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vgg", choices=models_for("classify"))
    p.add_argument("--scheme", default="hitopk:density=0.01")
    p.add_argument("--batch-size", type=int, default=16, help="samples per worker")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6, help="rounds of (off, on) or (on, off)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps per contender and round")
    p.add_argument("--steps", type=int, default=10, help="measured steps per contender and round")
    add_world_arguments(p, timeout_s=900.0)
    p.add_argument("--json", metavar="PATH")


def check(args: argparse.Namespace) -> None:
    for name in ("batch_size", "image_size", "rounds", "warmup", "steps", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if (args.nodes is None) != (args.per_node is None):
        raise ValueError("--nodes and --per-node go together")
    Scheme.parse(args.scheme)


def _contender(
    traced: bool,
    base: nn.Module,
    topo: Topology,
    x: torch.Tensor,
    y: torch.Tensor,
    args: argparse.Namespace,
    tmp: str,
) -> dict[str, float]:
    trace = os.path.join(tmp, "trace.json") if traced else None
    model = gradsync.wrap(copy.deepcopy(base), args.scheme, topo, trace=trace)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    out = {"step_s": max_over_ranks([statistics.median(times)])[0]}
    if model.tracer is not None:  # what the recorder itself spent per step, slowest rank
        out["recorder_s"] = max_over_ranks([model.tracer.busy_s / max(model.tracer.steps, 1)])[0]
    if not traced:  # the bookkeeping every step does with tracing off, on the live engine
        engine = model.engine
        reps = 200
        t0 = time.perf_counter()
        for _ in range(reps):
            engine.current_bucket_stats()
        out["bookkeeping_s"] = max_over_ranks([(time.perf_counter() - t0) / reps])[0]
    t0 = time.perf_counter()
    model.close()  # writes the trace when traced
    out["close_s"] = max_over_ranks([time.perf_counter() - t0])[0]
    return out


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    torch.set_num_threads(args.threads)
    topo = join_world(args.timeout, args.nodes, args.per_node)
    torch.manual_seed(0)
    base = build_model_for(args.model, "classify", (3, args.image_size, args.image_size), 10)
    g = torch.Generator().manual_seed(topo.rank)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    y = torch.randint(0, 10, (args.batch_size,), generator=g)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            order = (False, True) if r % 2 == 0 else (True, False)
            got = {traced: _contender(traced, base, topo, x, y, args, tmp) for traced in order}
            rows.append(
                {
                    "round": r,
                    "off": got[False],
                    "on": got[True],
                    "ratio": got[True]["step_s"] / got[False]["step_s"],
                }
            )
            if topo.rank == 0:
                print(
                    f"  round {r}: off {got[False]['step_s'] * 1e3:.1f} ms, "
                    f"on {got[True]['step_s'] * 1e3:.1f} ms, on/off {rows[-1]['ratio']:.3f}",
                    file=sys.stderr,
                    flush=True,
                )
    ratios = [row["ratio"] for row in rows]
    off = statistics.median(row["off"]["step_s"] for row in rows)
    book = statistics.median(row["off"]["bookkeeping_s"] for row in rows)
    result = {
        "command": command_line(),
        "model": args.model,
        "scheme": args.scheme,
        "nodes": topo.nodes,
        "per_node": topo.per_node,
        "link": os.environ.get("TB_RATE"),
        "rounds": rows,
        "on_over_off": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "step_ms_off": off * 1e3,
        "trace_write_s": statistics.median(row["on"]["close_s"] - row["off"]["close_s"] for row in rows),
        "bookkeeping_us": book * 1e6,
        "bookkeeping_share": book / off,
        "recorder_us": statistics.median(row["on"]["recorder_s"] for row in rows) * 1e6,
        "recorder_share": statistics.median(row["on"]["recorder_s"] for row in rows) / off,
    }
    return result if topo.rank == 0 else None


def markdown(result: dict[str, Any]) -> str:
    o = result["on_over_off"]
    return (
        f"| {result['model']} | {result['scheme']} | {result['nodes']} x {result['per_node']} | "
        f"{result['step_ms_off']:.1f} | {o['median']:.3f} ({o['min']:.3f}-{o['max']:.3f}) | "
        f"{result['bookkeeping_us']:.0f} us ({100 * result['bookkeeping_share']:.3f}%) | "
        f"{result['trace_write_s']:.2f} |"
    )


def main(args: argparse.Namespace) -> int:
    owned = not dist.is_initialized()  # leave a process group the caller made alone
    try:
        result = run(args)
        if result is not None:
            o = result["on_over_off"]
            print(
                f"tracing on / off: median {o['median']:.3f} (min {o['min']:.3f}, max {o['max']:.3f}) over "
                f"{len(result['rounds'])} rounds; step {result['step_ms_off']:.1f} ms with tracing off"
            )
            print(
                f"bookkeeping with tracing off: {result['bookkeeping_us']:.0f} us per step "
                f"({100 * result['bookkeeping_share']:.3f}% of the step); writing the trace: "
                f"{result['trace_write_s']:.2f} s once; the recorder: "
                f"{result['recorder_us']:.0f} us per step "
                f"({100 * result['recorder_share']:.3f}%)"
            )
            save_result(result, args.json, None, markdown(result))
    finally:
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    return 0
