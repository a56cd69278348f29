"""``gradsync bench collectives``: every aggregation scheme on the world it is launched in.

Launch with torchrun (``torchrun --nproc-per-node 4 -m gradsync bench collectives --nodes 2
--per-node 2``) or on the emulated cluster (``launch.sh 2 -m gradsync bench collectives``). For
each scheme and size it reports the median over iterations of the slowest rank's time, algbw
(S / t) and busbw (nccl-tests: all-reduce busbw = algbw * 2(p-1)/p), busbw as a percentage of the
link when ``TB_RATE`` is set, the bytes that crossed each node's cable (read from the NIC
counters of ``GLOO_SOCKET_IFNAME`` when that is a real interface), and the alpha-beta model's
prediction with alpha and beta calibrated at start-up in the same run.

Scheme names: a dense algorithm (``flat``, ``hierarchical``, ``torus2d``, ``hybrid``), optionally
``/fp16`` or ``/bf16`` for low-precision communication; or ``STRATEGY[+local]/CODEC`` with
STRATEGY ``allgather`` (the naive packed all-gather), ``hitopk``, ``ring`` or ``ps`` and any codec
spec (``hitopk/topk:density=0.01``, ``ring+local/onebit``). For compressed schemes algbw is the
effective one: dense bytes over the whole time, encode and decode included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsync.apps.command_line import command_line
from gradsync.apps.commands.bench.support.output import markdown_table, save_result
from gradsync.apps.commands.bench.support.world import CableMeter, join_world, link_bytes_per_s
from gradsync.codecs import build_codec
from gradsync.collectives import Topology, allreduce, compressed_allreduce
from gradsync.collectives.cost import CostModel, CostParams, calibrate, measure_codec
from gradsync.planner.decide import encode_sizes, predict
from gradsync.sync.scheme import Scheme

DEFAULT_SCHEMES = (
    "flat,hierarchical,torus2d,hybrid,torus2d/fp16,"
    "allgather/topk:density=0.01,hitopk/topk:density=0.01,hitopk/mstopk:density=0.01,"
    "ring+local/onebit,ps+local/onebit,ring+local/terngrad,ps+local/terngrad,ring/powersgd:rank=4"
)


@dataclass(frozen=True)
class BenchScheme:
    """A scheme as named on the command line; ``parsed`` is resolved for the topology in ``run``."""

    name: str
    parsed: Scheme

    @classmethod
    def parse(cls, text: str) -> BenchScheme:
        return cls(text.strip(), Scheme.parse(text))


@dataclass
class Row:
    scheme: str
    mbytes: float
    nbytes: int
    time_ms: float
    algbw_gbs: float
    busbw_gbs: float
    busbw_pct_link: float | None
    cable_bytes_per_op: float | None
    model_ms: float | None
    measured_over_model: float | None
    inter_phase_pct_link: float | None = None
    iters: int = 0


def bus_factor(p: int) -> float:
    """nccl-tests all-reduce busbw factor 2(p-1)/p."""
    return 2 * (p - 1) / p if p > 1 else 1.0


def _timed(
    fn: Any, budget: float, min_iters: int, max_iters: int, topo: Topology, prepare: Any = None
) -> tuple[float, int, float | None]:
    """Median slowest-rank seconds, iterations, and bytes per op through this node's NIC.

    ``prepare`` runs before each call, untimed (it restores the input the in-place op consumed).
    """
    prepare = prepare or (lambda: None)
    prepare()
    fn()  # warm-up
    times: list[float] = []
    meter = CableMeter(topo)
    meter.start()
    spent = 0.0
    while len(times) < max_iters:
        prepare()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        agg = torch.tensor(
            [dt, float(len(times) + 1 >= min_iters and spent + dt >= budget)], dtype=torch.float64
        )
        dist.all_reduce(agg, op=dist.ReduceOp.MAX)
        times.append(float(agg[0]))
        spent += float(agg[0])
        if agg[1] > 0:
            break
    cable = meter.stop(len(times))
    return statistics.median(times), len(times), cable


def _runner(scheme: Scheme, topo: Topology, x: torch.Tensor, key: str) -> Any:
    """One in-place all-reduce of ``x`` with the scheme (codecs exactly as written: no error
    feedback is added here)."""
    if scheme.kind == "dense":
        return lambda: allreduce(x, topo, scheme.algorithm, comm_dtype=scheme.comm_dtype, check=False)
    codec = build_codec(scheme.codec or "none")
    strategy, local = scheme.strategy or "allgather", bool(scheme.local)
    return lambda: compressed_allreduce(x, topo, codec, strategy, local, key=key, check=False)


def _inter_phase(scheme: Scheme, topo: Topology, nbytes: int) -> Any:
    """The inter-node phase of hierarchical / torus2d on its own (for its link utilization)."""
    if topo.nodes < 2:
        return None
    if scheme.algorithm == "hierarchical":
        buf = torch.zeros(nbytes // 4)
        return lambda: dist.all_reduce(buf, group=topo.inter_group) if topo.local_rank == 0 else None
    if scheme.algorithm == "torus2d":
        shard = torch.zeros(-(-(nbytes // 4) // topo.per_node))
        return lambda: dist.all_reduce(shard, group=topo.inter_group)
    return None


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    schemes = [BenchScheme.parse(s) for s in args.schemes.split(",") if s.strip()]
    sizes = [float(s) for s in args.sizes_mb.split(",")]
    torch.set_num_threads(args.threads)
    topo = join_world(args.timeout, args.nodes, args.per_node)
    rank0 = topo.rank == 0
    if rank0:
        rate = os.environ.get("TB_RATE", "unknown")
        print(
            f"gradsync bench collectives: {topo.nodes} x {topo.per_node} ranks, link {rate}", file=sys.stderr
        )
    params: CostParams = calibrate(topo, reps=args.calibration_reps)
    model = CostModel(params, topo.nodes, topo.per_node)
    link = link_bytes_per_s(os.environ.get("TB_RATE"))
    rows: list[Row] = []
    p = topo.world
    for named in schemes:
        scheme = named.parsed.resolve(topo.nodes, topo.per_node)
        codec_cost = None
        if scheme.kind == "compressed":
            # the codec's speed on the sizes it will see (shards when aggregating locally)
            codec_cost = measure_codec(
                build_codec(scheme.codec or "none"),
                [max(int(encode_sizes(scheme, s * 2**20, topo.nodes, topo.per_node)), 4) for s in sizes],
                reps=3,
            )
        for mb in sizes:
            nbytes = int(mb * 2**20)
            gen = torch.Generator().manual_seed(topo.rank)
            numel = nbytes // 4
            rows_ = 2 ** (numel.bit_length() // 2)  # a matrix, for the low-rank codecs
            original = (
                torch.randn(numel, generator=gen).view(rows_, -1)
                if numel % rows_ == 0
                else torch.randn(numel)
            )
            x = original.clone()
            fn = _runner(scheme, topo, x, key=f"{named.name}@{mb}")
            t, iters, cable = _timed(
                fn,
                args.budget,
                args.min_iters,
                args.max_iters,
                topo,
                lambda x=x, original=original: x.copy_(original),
            )
            algbw = nbytes / t
            busbw = algbw * bus_factor(p)
            inter_pct = None
            phase = _inter_phase(scheme, topo, nbytes) if scheme.kind == "dense" else None
            if phase is not None and link:
                tp, _, _ = _timed(phase, args.budget / 2, 2, args.max_iters, topo)
                cable_bytes = (
                    2 * (topo.nodes - 1) / topo.nodes * (nbytes // 2 if scheme.comm_dtype else nbytes)
                )
                inter_pct = 100 * cable_bytes / tp / link
            pred = predict(scheme, model, nbytes, codec_cost)
            rows.append(Row(named.name, mb, nbytes, t * 1e3, algbw / 1e9, busbw / 1e9,
                            100 * busbw / link if link else None, cable, pred * 1e3 if pred else None,
                            t / pred if pred else None, inter_pct, iters))  # fmt: skip
            if rank0:
                print(f"  {named.name:32s} {mb:6.1f} MB  {t * 1e3:10.2f} ms", file=sys.stderr, flush=True)
    result = {
        "command": command_line(),
        "nodes": topo.nodes,
        "per_node": topo.per_node,
        "link": os.environ.get("TB_RATE"),
        "calibration": {"intra": asdict(params.intra), "inter": asdict(params.inter), "gamma": params.gamma},
        "rows": [asdict(r) for r in rows],
    }
    return result if rank0 else None


COLUMNS = ("scheme", "MB", "time ms", "algbw GB/s", "busbw GB/s", "busbw % link", "inter phase % link",
           "cable MB/op", "model ms", "measured / model")  # fmt: skip


def _cells(r: dict[str, Any]) -> list[str]:
    def f(v: float | None, fmt: str) -> str:
        return "" if v is None else format(v, fmt)

    return [r["scheme"], f(r["mbytes"], "g"), f(r["time_ms"], ".1f"), f(r["algbw_gbs"], ".4f"),
            f(r["busbw_gbs"], ".4f"), f(r["busbw_pct_link"], ".0f"), f(r["inter_phase_pct_link"], ".0f"),
            f(r["cable_bytes_per_op"] / 2**20 if r["cable_bytes_per_op"] is not None else None, ".2f"),
            f(r["model_ms"], ".1f"), f(r["measured_over_model"], ".2f")]  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    return markdown_table(COLUMNS, [_cells(r) for r in result["rows"]])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schemes", default=DEFAULT_SCHEMES, help="comma-separated schemes (see the module doc)")
    p.add_argument("--sizes-mb", default="1,4,16,64", help="tensor sizes in MiB (default 1,4,16,64)")
    p.add_argument("--nodes", type=int, help="impose a topology (with --per-node) instead of torchrun's")
    p.add_argument("--per-node", type=int)
    p.add_argument("--budget", type=float, default=10.0, help="seconds of timing per scheme and size")
    p.add_argument("--min-iters", type=int, default=2)
    p.add_argument("--max-iters", type=int, default=10)
    p.add_argument("--calibration-reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=600.0, help="process-group timeout in seconds")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")


def check(args: argparse.Namespace) -> None:
    """The option values, before the process group starts (``ValueError`` naming the option)."""
    if (args.nodes is None) != (args.per_node is None):
        raise ValueError("--nodes and --per-node go together")
    if args.min_iters < 1 or args.max_iters < args.min_iters:
        raise ValueError(f"need 1 <= --min-iters <= --max-iters, got {args.min_iters} and {args.max_iters}")
    for s in args.schemes.split(","):
        if s.strip():
            BenchScheme.parse(s)
    try:
        sizes = [float(s) for s in args.sizes_mb.split(",")]
    except ValueError:
        raise ValueError(f"--sizes-mb takes comma-separated numbers, got {args.sizes_mb!r}") from None
    if any(not s > 0 for s in sizes):
        raise ValueError(f"--sizes-mb must be positive, got {args.sizes_mb!r}")


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`)."""
    owned = not dist.is_initialized()  # leave a process group the caller made alone
    result = run(args)
    if result is not None:
        from rich.console import Console
        from rich.table import Table

        table = Table(
            title=f"collectives, {result['nodes']} x {result['per_node']} ranks, link {result['link']}"
        )
        for col in COLUMNS:
            table.add_column(col, justify="left" if col == "scheme" else "right")
        for r in result["rows"]:
            table.add_row(*_cells(r))
        (Console() if sys.stdout.isatty() else Console(width=200)).print(table)
        save_result(result, args.json, args.markdown, markdown(result))
    if owned and dist.is_initialized():
        dist.destroy_process_group()
    return 0
