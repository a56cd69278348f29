"""``gradsync bench gpu-step``: what gradsync's synchronization work costs a real training step on
one GPU, next to PyTorch DDP and DDP with its PowerSGD hook.

Run it as a plain command on a machine with one GPU (no torchrun): it trains one model (the
project's ResNet-50 at batch 64 under bf16 autocast by default; ``--model bert-base``, or
``--model transformer --dim 768 --layers 12`` for a GPT-2-small-sized one) on random inputs that
live on the device, so nothing but the step is timed. The contenders, each its own copy of the
model from the same weights:

- ``local``: the step with no synchronization at all: the reference every overhead is taken
  against;
- ``ddp`` and ``ddp-powersgd:rank=R`` (``--baselines``): PyTorch DDP and DDP with PyTorch's own
  PowerSGD hook, on a one-rank process group (NCCL on the GPU, gloo on the CPU). At world 1
  NCCL's all-reduce moves nothing and costs next to nothing, so DDP's row is its bucketing (the
  copies into its buckets and back) and the hook's row the hook's compression compute;
- every scheme of ``--schemes`` (fixed: ``plan="compress"``, every tensor the scheme may
  compress is compressed), and ``auto`` with the plan it makes for ``--auto-nodes`` nodes of one
  GPU each on a ``--auto-link`` cable (the HiPress paper's selective compression, from this
  run's first step and its codec timings on this device: the first plan, before the closed loop
  would re-plan from measurements).

How gradsync's work is run with one rank (:attr:`gradsync.sync.SyncConfig.rehearse`): a world of
one normally synchronizes nothing and gradsync's engine skips the codec. Two ranks cannot share
one GPU under NCCL (it refuses two ranks on one device), and gloo stages CUDA tensors through
the host and turns the resident (host-free) codec path off, so neither measures what a GPU
cluster runs. So the gradsync contenders run in a world of one with ``rehearse=True``: every
bucket is packed, encoded, "gathered" from its one rank (the collective over one rank is the
identity: nothing stands in for a network), decoded and written back, with error feedback, by
the same step programs a multi-rank world runs. What this leaves out is a peer's share of the
work that grows with the world (decoding p payloads instead of one, merging) and every transfer:
the figures are the floor of a rank's synchronization work at that plan.

Timing (DESIGN.md, "how to measure"): every contender is warmed up (``--warmup`` steps; gradsync
makes its first plan after its first step), then ``--rounds`` rounds, each running every
contender for one unmeasured and ``--steps`` measured steps, in an order that rotates from round
to round. A step (forward, backward with the synchronization, optimizer step) is timed with CUDA
events around it on the GPU (``time.perf_counter`` on the CPU). Per contender and round: the
median step; reported: the median over the rounds and their min-max, and the overhead over
``local``'s step of the same round, in ms and as a % of that step (median and min-max over the
rounds). For gradsync also the engine's own account of its threads' busy time per step
(packing, encoding, decoding, unpacking: :class:`~gradsync.sync.StepStats`'s ``compute_s`` and
``decode_s``) and its exposed time (from the end of the backward pass to the last synchronized
gradient). Those are host clocks: on a GPU in resident mode they time the launching of the work,
not the GPU's; the step overhead is the figure that holds the GPU's time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import statistics
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.apps.command_line import command_line
from gradsync.apps.commands.bench.step import (
    ROUND_WARMUP,
    bench_batch,
    bench_model,
    check_contender,
    check_sizes,
    ddp_model,
    is_ddp,
    model_label,
)
from gradsync.apps.commands.bench.support.output import markdown_table, save_result
from gradsync.apps.commands.bench.support.timing import StepClock
from gradsync.apps.models import models_for, parameter_count
from gradsync.collectives import Topology
from gradsync.collectives.cost import CostModel
from gradsync.observe.profiler import default_loss
from gradsync.sync import SyncConfig
from gradsync.sync.config import parse_options
from gradsync.units import parse_rate
from gradsync.whatif.network import from_rates

DEFAULT_SCHEMES = "hitopk:density=0.01,topk:density=0.01,chunktopk:density=0.01,powersgd:rank=4,onebit,fp16"
DEFAULT_BASELINES = "ddp,ddp-powersgd:rank=4"


def world_of_one_note(device: torch.device) -> str:
    """What the rows mean with one rank (printed and kept in the result)."""
    backend = "NCCL" if device.type == "cuda" else "gloo"
    return (
        f"one rank: {backend}'s all-reduce at world 1 moves nothing, so ddp's row is DDP's bucketing "
        "and ddp-powersgd's the hook's compression compute; gradsync's rows run every bucket's "
        "encode and decode in a world of one (rehearse=True), with no transfer: the floor of one "
        "rank's synchronization work under that plan"
    )


QUIET = ("gradsync: the scheme .* compresses nothing", "gradsync: plan='compress' asked to compress")
"""The plan reports' warnings, recorded in the result instead (the first plan of a world of one
compresses nothing: its links are free)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="resnet50", choices=models_for("classify") + models_for("lm"))
    p.add_argument("--batch-size", type=int, default=64, help="samples (sequences) per step")
    p.add_argument("--image-size", type=int, default=224, help="image classifiers' input size")
    p.add_argument("--classes", type=int, default=1000, help="image classifiers' class count")
    p.add_argument("--seq-len", type=int, default=128, help="language models' sequence length")
    p.add_argument("--vocab", type=int, default=30522, help="language models' vocabulary")
    p.add_argument("--dim", type=int, help="the Transformer's width (768: GPT-2 small; a multiple of 4)")
    p.add_argument("--layers", type=int, help="the Transformer's block count (12: GPT-2 small)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (auto: the GPU when there is one)")
    p.add_argument("--autocast", default="auto", choices=("auto", "bf16", "none"),
                   help="the forward pass's autocast (auto: bf16 on a GPU, none on the CPU)")  # fmt: skip
    p.add_argument("--schemes", default=DEFAULT_SCHEMES,
                   help="comma-separated gradsync schemes, each compressing every tensor it may "
                        f"(plan=compress; default {DEFAULT_SCHEMES})")  # fmt: skip
    p.add_argument("--auto-link", default="25gbit",
                   help="the node cable auto plans for, e.g. 25gbit (none: no auto contender)")  # fmt: skip
    p.add_argument("--auto-nodes", type=int, default=4, help="the nodes (one GPU each) auto plans for")
    p.add_argument("--auto-scheme", default="auto", help="auto, or auto:candidates=A,B,...")
    p.add_argument("--baselines", default=DEFAULT_BASELINES,
                   help="comma-separated: ddp, ddp-fp16, ddp-powersgd:rank=R (empty: none)")  # fmt: skip
    p.add_argument("--sync-option", action="append", metavar="KEY=VALUE",
                   help="a gradsync SyncConfig option for every gradsync contender (repeatable)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=5, help="rounds of every contender, in rotating order")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps of each contender before round 1")
    p.add_argument("--steps", type=int, default=10, help="measured steps per contender and round")
    p.add_argument("--threads", type=int, help="torch's CPU threads (default: torch's own)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")


def _names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def pick_device(text: str) -> torch.device:
    """``--device``: ``auto`` (the current GPU, else the CPU), ``cpu``, ``cuda`` or ``cuda:N``."""
    if text == "auto":
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device takes auto, cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {text}: CUDA is not available here")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device {text}: this machine has {torch.cuda.device_count()} GPU(s)")
        device = torch.device("cuda", index)
    return device


def check(args: argparse.Namespace) -> None:
    """The option values, before anything runs (``ValueError`` naming the option)."""
    check_sizes(args, ("rounds", "steps", "warmup", "threads"))
    if args.auto_nodes < 2:
        raise ValueError(f"--auto-nodes must be at least 2 (one node sends nothing), got {args.auto_nodes}")
    if args.warmup < 2:
        raise ValueError(
            f"--warmup must be at least 2 (gradsync plans after its first step), got {args.warmup}"
        )
    pick_device(args.device)
    options = parse_options(args.sync_option)
    schemes = _names(args.schemes)
    for name in schemes:
        SyncConfig.from_options({**options, "scheme": name})
    for name in _names(args.baselines):
        if not is_ddp(name):
            raise ValueError(f"--baselines takes ddp, ddp-fp16 and ddp-powersgd:rank=R, got {name!r}")
        check_contender(name)
    if args.auto_link != "none":
        parse_rate(args.auto_link, "--auto-link")
        if not args.auto_scheme.strip().startswith("auto"):
            raise ValueError(f"--auto-scheme takes auto or auto:candidates=..., got {args.auto_scheme!r}")
        SyncConfig.from_options({**options, "scheme": args.auto_scheme})
    names = [*(_names(args.baselines)), *schemes, *([args.auto_scheme] if args.auto_link != "none" else [])]
    if len(set(names)) < len(names):
        raise ValueError(f"a contender is named twice: {', '.join(names)}")
    if not names:
        raise ValueError("nothing to measure: give --schemes, --baselines or --auto-link")


@dataclass
class Contender:
    """One contender's model, optimizer and what its rounds measured."""

    name: str
    kind: str  # local, ddp or gradsync
    model: nn.Module
    optimizer: torch.optim.Optimizer
    synced: gradsync.GradSync | None = None
    plans_for_target: bool = False  # auto: the plan for --auto-nodes x 1 on --auto-link
    rounds: list[float] = field(default_factory=list)  # the median step of each round, seconds
    engine: list[tuple[float, float, float]] = field(default_factory=list)  # per round: busy, comm, exposed
    plan: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def _quiet_plans() -> Iterator[None]:
    with warnings.catch_warnings():
        for text in QUIET:
            warnings.filterwarnings("ignore", message=text, category=RuntimeWarning)
        yield


def _join_world_of_one(device: torch.device) -> tuple[bool, Topology]:
    """A one-rank default process group for DDP (NCCL on a GPU, gloo on the CPU; an in-process
    store, no port), unless one exists; returns whether it was made here, and gradsync's topology."""
    owned = not dist.is_initialized()
    if owned:
        options: dict[str, Any] = {"store": dist.HashStore(), "rank": 0, "world_size": 1}
        options["timeout"] = datetime.timedelta(seconds=600)
        if device.type == "cuda":  # NCCL told its device, as init_default_group does for a rank
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", device_id=device, **options)
        else:
            dist.init_process_group("gloo", **options)
    elif dist.get_world_size() > 1:
        raise ValueError(
            f"gradsync bench gpu-step runs in one process (a world of one), not under a launcher "
            f"with {dist.get_world_size()} ranks"
        )
    return owned, Topology(device=device)


def _step(c: Contender, x: torch.Tensor, y: torch.Tensor, amp: torch.dtype | None) -> None:
    """One training step: forward (under autocast to ``amp``), backward with the contender's
    synchronization, optimizer step."""
    cast = torch.autocast(x.device.type, dtype=amp) if amp is not None else contextlib.nullcontext()
    with cast:
        loss = default_loss(c.model(x), y)
    loss.backward()
    c.optimizer.step()
    c.optimizer.zero_grad(set_to_none=True)


def _build(
    args: argparse.Namespace, base: nn.Module, topo: Topology, device: torch.device
) -> list[Contender]:
    options = parse_options(args.sync_option)
    out = []

    def add(
        name: str, kind: str, model: nn.Module, synced: gradsync.GradSync | None = None, target: bool = False
    ) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        out.append(Contender(name, kind, model, opt, synced, plans_for_target=target))

    add("local", "local", copy.deepcopy(base).to(device))
    for name in _names(args.baselines):  # the PowerSGD hook's dense start ends inside the warm-up
        add(name, "ddp", ddp_model(name, copy.deepcopy(base).to(device), max(2, args.warmup // 2)))
    fixed = [(s, "compress") for s in _names(args.schemes)]
    planned = [(args.auto_scheme, "auto")] if args.auto_link != "none" else []
    for scheme, plan in fixed + planned:
        config = {
            **options,
            "plan": plan,
            "scheme": scheme,
            "rehearse": True,
            "replan": 0,
            "replan_trials": 0,
        }
        synced = gradsync.wrap(copy.deepcopy(base).to(device), topology=topo, log_plan=False, **config)
        add(scheme, "gradsync", synced, synced, target=plan == "auto")
    return out


def _warm_up(
    c: Contender, args: argparse.Namespace, x: torch.Tensor, y: torch.Tensor, amp: torch.dtype | None
) -> None:
    """``--warmup`` unmeasured steps; ``auto`` takes its plan for the target cluster after the
    first (its own first plan is a world of one's, where nothing pays to compress)."""
    with _quiet_plans():
        for i in range(args.warmup):
            _step(c, x, y, amp)
            if i == 0 and c.synced is not None and c.plans_for_target:
                engine = c.synced.engine
                links = from_rates(args.auto_link).params
                engine.use_plan(engine.replanner.plan_for(CostModel(links, args.auto_nodes, 1)))
    if c.synced is not None:
        engine = c.synced.engine
        report = engine.report
        c.plan = {
            "summary": report.summary if report is not None else "",
            "table": c.synced.plan_table(),
            "compressed_buckets": sum(b.compress for b in engine.plan.buckets) if engine.plan else 0,
            "buckets": len(engine.plan.buckets) if engine.plan else 0,
        }


def _round(
    c: Contender,
    args: argparse.Namespace,
    x: torch.Tensor,
    y: torch.Tensor,
    amp: torch.dtype | None,
    clock: StepClock,
) -> None:
    """One round of ``c``: ``ROUND_WARMUP`` unmeasured steps, then ``--steps`` timed ones."""
    for _ in range(ROUND_WARMUP):
        _step(c, x, y, amp)
    busy: list[tuple[float, float, float]] = []
    for _ in range(args.steps):
        clock.start()
        _step(c, x, y, amp)
        clock.stop()
        st = c.synced.last_stats if c.synced is not None else None
        if st is not None:
            busy.append((st.compute_s + st.decode_s, st.comm_s, st.exposed_s))
    c.rounds.append(statistics.median(clock.seconds()))
    if busy:
        work, comm, exposed = (statistics.median(col) for col in zip(*busy, strict=True))
        c.engine.append((work, comm, exposed))


def spread(values: list[float], scale: float = 1.0) -> dict[str, float]:
    """Median, min and max of ``values`` times ``scale``."""
    return {
        "median": statistics.median(values) * scale,
        "min": min(values) * scale,
        "max": max(values) * scale,
    }


def summarize(contenders: list[Contender]) -> list[dict[str, Any]]:
    """Each contender's row: its step and its overhead over ``local``'s step of the same round."""
    local = next(c for c in contenders if c.kind == "local")
    rows = []
    for c in contenders:
        over = [a - b for a, b in zip(c.rounds, local.rounds, strict=True)]
        share = [(a - b) / b for a, b in zip(c.rounds, local.rounds, strict=True)]
        row: dict[str, Any] = {
            "contender": c.name,
            "kind": c.kind,
            "step_ms": spread(c.rounds, 1e3),
            "round_step_ms": [t * 1e3 for t in c.rounds],
            "overhead_ms": spread(over, 1e3),
            "overhead_pct": spread(share, 100.0),
        }
        if c.engine:
            busy, comm, exposed = zip(*c.engine, strict=True)
            row["engine_busy_ms"] = spread(list(busy), 1e3)
            row["engine_comm_ms"] = spread(list(comm), 1e3)
            row["exposed_ms"] = spread(list(exposed), 1e3)
        if c.plan:
            row["plan"] = c.plan
        rows.append(row)
    return rows


def _describe_device(device: torch.device) -> str:
    if device.type == "cuda":
        return f"{device} {torch.cuda.get_device_name(device)}"
    return "cpu"


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = pick_device(args.device)
    amp = None
    if args.autocast == "bf16" or (args.autocast == "auto" and device.type == "cuda"):
        amp = torch.bfloat16
    if args.threads:
        torch.set_num_threads(args.threads)
    owned, topo = _join_world_of_one(device)
    contenders: list[Contender] = []
    try:
        torch.manual_seed(0)
        base = bench_model(args)
        x, y = (t.to(device) for t in bench_batch(args, torch.Generator().manual_seed(0)))
        print(
            f"gradsync bench gpu-step: {model_label(args)} ({parameter_count(base) / 1e6:.1f} M parameters), "
            f"batch {args.batch_size}, {_describe_device(device)}, autocast {amp or 'none'}",
            file=sys.stderr,
            flush=True,
        )
        contenders = _build(args, base, topo, device)
        for c in contenders:
            _warm_up(c, args, x, y, amp)
        clock = StepClock(device)
        for r in range(args.rounds):
            shift = r % len(contenders)
            for c in contenders[shift:] + contenders[:shift]:
                _round(c, args, x, y, amp, clock)
            local = contenders[0].rounds[-1]
            print(
                f"  round {r + 1}/{args.rounds}: local {local * 1e3:.2f} ms; "
                + ", ".join(f"{c.name} {100 * (c.rounds[-1] - local) / local:+.1f}%" for c in contenders[1:]),
                file=sys.stderr,
                flush=True,
            )
        rows = summarize(contenders)
    finally:
        for c in contenders:
            if c.synced is not None:
                c.synced.close()
        if owned and dist.is_initialized():
            dist.destroy_process_group()
    result: dict[str, Any] = {
        "command": command_line(args),
        "model": model_label(args),
        "parameters": parameter_count(base),
        "batch_size": args.batch_size,
        "device": _describe_device(device),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "autocast": "bf16" if amp is not None else "none",
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
        "rounds": args.rounds,
        "warmup": args.warmup,
        "steps": args.steps,
        "auto": None
        if args.auto_link == "none"
        else {"scheme": args.auto_scheme, "nodes": args.auto_nodes, "per_node": 1, "link": args.auto_link},
        "note": world_of_one_note(device),
        "rows": rows,
    }
    result["summary"] = verdict(result, args.auto_scheme)
    return result


def verdict(result: dict[str, Any], auto: str) -> dict[str, Any]:
    """The issue's question, where both sides ran: the share of the step auto's plan spends on
    synchronization work (median over the rounds) against 5 % and against the PowerSGD hook's."""
    rows = {r["contender"]: r for r in result["rows"]}
    out: dict[str, Any] = {}
    if auto in rows and result["auto"] is not None:
        share = rows[auto]["overhead_pct"]["median"]
        out["auto_overhead_pct"] = share
        out["auto_within_5pct"] = share <= 5.0
        hook = next((r for r in result["rows"] if r["contender"].startswith("ddp-powersgd")), None)
        if hook is not None:
            out["powersgd_hook"] = hook["contender"]
            out["powersgd_hook_overhead_pct"] = hook["overhead_pct"]["median"]
            out["auto_at_most_hook"] = share <= hook["overhead_pct"]["median"]
    return out


COLUMNS = ("contender", "step ms (min-max)", "overhead ms (min-max)", "overhead % of local (min-max)",
           "engine busy ms", "exposed ms", "compressed buckets")  # fmt: skip


def cells(r: dict[str, Any]) -> list[str]:
    def ranged(s: dict[str, float], fmt: str = ".2f") -> str:
        return f"{s['median']:{fmt}} ({s['min']:{fmt}} to {s['max']:{fmt}})"

    plan = r.get("plan")
    return [
        r["contender"],
        ranged(r["step_ms"]),
        ranged(r["overhead_ms"]) if r["kind"] != "local" else "",
        ranged(r["overhead_pct"], ".1f") if r["kind"] != "local" else "",
        f"{r['engine_busy_ms']['median']:.2f}" if "engine_busy_ms" in r else "",
        f"{r['exposed_ms']['median']:.2f}" if "exposed_ms" in r else "",
        f"{plan['compressed_buckets']}/{plan['buckets']}" if plan else "",
    ]


def markdown(result: dict[str, Any]) -> str:
    return markdown_table(COLUMNS, [cells(r) for r in result["rows"]])


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`)."""
    result = run(args)
    from rich.console import Console
    from rich.table import Table

    auto = result["auto"]
    where = (
        f"{result['model']}, batch {result['batch_size']}, {result['device']}, autocast {result['autocast']}"
    )
    table = Table(title=f"one training step, {where}")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col == "contender" else "right")
    for r in result["rows"]:
        table.add_row(*cells(r))
    (Console() if sys.stdout.isatty() else Console(width=200)).print(table)
    print(f"note: {result['note']}")
    if auto is not None:
        print(f"{auto['scheme']}: the plan it makes for {auto['nodes']} x 1 GPUs on a {auto['link']} cable")
    s = result["summary"]
    if "auto_overhead_pct" in s:
        line = f"auto spends {s['auto_overhead_pct']:.1f}% of the local step on synchronization work"
        if "powersgd_hook_overhead_pct" in s:
            line += f" ({s['powersgd_hook']}: {s['powersgd_hook_overhead_pct']:.1f}%)"
        print(line)
    save_result(result, args.json, args.markdown, markdown(result))
    return 0
