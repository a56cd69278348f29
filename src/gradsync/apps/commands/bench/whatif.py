"""``gradsync bench whatif``: the simulator's prediction next to the measured step, per contender, in
one run on the world it is launched in (``--emulate 2x2 --link 100mbit`` sets up the emulated
cluster, as ``bench train`` does).

Everything the prediction uses is measured in the same run, before the contenders train, and
none of it is a contender's own step time:

1. the links: :func:`gradsync.collectives.cost.calibrate` (alpha, beta per level, the add rate),
   the engine's own calibration, and how world all-gathers run against that model, small and
   large (:func:`gradsync.collectives.cost.measure_efficiency`);
2. the model: ``gradsync profile`` of one worker training alone (the other ranks wait), each
   gradient's ready time and the phases;
3. CPU contention (the emulated nodes share this machine's cores): one worker's training step
   alone and every worker's at once; the effective cores are ranks x alone / together
   (:class:`gradsync.whatif.simulate.Cpu`), read from ``local``'s rounds where it is a contender
   (:func:`cores_from_local`); how far the slowest rank lags the ranks' mean over such a step,
   from the same rounds (:func:`ranks_lag`); and what a small collective waits for while one or
   two threads of every rank compute (:func:`busy_calls`; recorded, charged only with
   ``--charge-busy-calls``);
4. the codecs: their encode and decode timed alone on rank 0.

Then the contenders are measured as ``bench train`` measures them (:mod:`gradsync.apps.commands.bench.step`),
and rank 0 simulates each one. The table gives predicted and measured step times and the error;
the headline the largest and the median absolute error.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.apps.command_line import command_line
from gradsync.apps.commands.bench import step as bench_step
from gradsync.apps.commands.bench import train as bench_train
from gradsync.apps.commands.bench.support.output import markdown_table, save_result
from gradsync.apps.commands.bench.support.own_work import measure_in_subprocess
from gradsync.apps.commands.bench.support.world import run_emulated
from gradsync.apps.models import parameter_count
from gradsync.codecs.config import split_spec_list
from gradsync.collectives.topology import Topology
from gradsync.observe.profiler import default_loss
from gradsync.whatif.modes import is_outer, is_self_syncing
from gradsync.whatif.sharded import is_sharded

DEFAULT_CONTENDERS = (
    "local,ddp,ddp-fp16,ddp-powersgd:rank=1,hierarchical,hitopk:density=0.01,powersgd:rank=4,auto"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    bench_train.add_arguments(p)
    p.set_defaults(contenders=DEFAULT_CONTENDERS, warmup=3, steps=5)
    p.add_argument("--profile-steps", type=int, default=10, help="profiled steps of one worker (default 10)")
    p.add_argument(
        "--replay",
        metavar="RESULT.json",
        help="predict again from a result's stored measurements (profile, links, contention, codec costs, "
        "measured steps); nothing runs",
    )
    p.add_argument(
        "--costs",
        metavar="PATH.json",
        help="predict with what synchronization cost in a running engine (gradsync train --save-costs, "
        "gradsync.engine-costs/1) instead of the links calibrated here and the codecs timed alone",
    )
    p.add_argument(
        "--charge-busy-calls",
        action="store_true",
        help="charge every collective the wait the busy-call probe measured for the worker's phase "
        "(Cpu.busy_call; off by default: on this machine the probe misses the engine's waits, see "
        "docs/whatif.md); with --replay, on a stored result",
    )
    p.add_argument(
        "--ranks-per-host",
        type=int,
        help="ranks sharing this machine's cores (default: the world on the emulated cluster, else per node)",
    )


def check(args: argparse.Namespace) -> None:
    if args.replay is not None:
        if not os.path.isfile(args.replay):
            raise ValueError(f"--replay {args.replay!r}: no such file")
        return
    bench_train.check(args)
    from gradsync.whatif.contenders import check_contender

    for c in split_spec_list(args.contenders):
        check_contender(c)
    if args.profile_steps < 1:
        raise ValueError(f"--profile-steps must be at least 1, got {args.profile_steps}")
    if args.ranks_per_host is not None and args.ranks_per_host < 1:
        raise ValueError(f"--ranks-per-host must be at least 1, got {args.ranks_per_host}")
    if args.costs is not None:
        from gradsync.planner.engine_costs import EngineCosts

        EngineCosts.load(args.costs)


def _train_steps(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, warmup: int, steps: int, together: bool
) -> tuple[float, float]:
    """Median step time and the median of the ranks' mean step; ``together``: every rank trains,
    steps start together (a barrier) and each step counts as its slowest rank's, as
    :mod:`gradsync.apps.commands.bench.step` measures (alone, the two are the same)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    slowest, mean = [], []
    for i in range(warmup + steps):
        if together:
            dist.barrier()
        t0 = time.perf_counter()
        default_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        most = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        total = most.clone()
        if together:
            dist.all_reduce(most, op=dist.ReduceOp.MAX)
            dist.all_reduce(total)
            total /= dist.get_world_size()
        if i >= warmup:
            slowest.append(float(most))
            mean.append(float(total))
    return statistics.median(slowest), statistics.median(mean)


def contention(base: nn.Module, x: torch.Tensor, y: torch.Tensor, ranks: int, steps: int) -> dict[str, float]:
    """One worker's step alone (rank 0; the others wait) and every worker's at once, measured as
    the benchmark measures a step (the slowest rank's): the effective cores the ranks share. Also
    the ranks' mean step at once: how far the slowest rank lags the others (the simulator's one
    worker has no such spread; recorded for the model of each rank's own progress, issue 44)."""
    alone = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        alone[0] = _train_steps(copy.deepcopy(base), x, y, 2, steps, together=False)[0]
    dist.broadcast(alone, 0)
    together, mean = _train_steps(copy.deepcopy(base), x, y, 2, steps, together=True)
    a = float(alone[0])
    return {
        "alone_ms": a * 1e3, "together_ms": together * 1e3, "together_mean_ms": mean * 1e3,
        "effective_cores": ranks * a / together,
    }  # fmt: skip


def node_transfer_ratio(topo: Topology, reps: int = 5) -> float | None:
    """A node-internal all-reduce of :data:`~gradsync.collectives.cost.INTRA_LARGE_BYTES` with
    every node of the host at once over the first node's alone (the median of ``reps`` timings of
    the slowest rank each): how the host's nodes' copies slow each other, which sets
    :attr:`~gradsync.whatif.simulate.Cpu.transfer_weight`. None with one rank per node.

    (The same beside a thread computing in every rank, tried for
    :attr:`~gradsync.whatif.simulate.Cpu.busy_transfer_weight`, read 2.96x in one run and 81x in
    the next on this project's machine: not a number to predict from, issue 44.)"""
    from gradsync.collectives import primitives as P
    from gradsync.collectives.cost import INTRA_LARGE_BYTES, time_slowest

    if topo.per_node <= 1 or topo.world <= 1:
        return None
    buf = torch.zeros(INTRA_LARGE_BYTES // 4, device=topo.comm_device)
    P.all_reduce(buf, topo.intra_group, "calibrate")  # connections set up, not timed

    def ring(everyone: bool) -> None:
        if everyone or topo.node == 0:
            P.all_reduce(buf, topo.intra_group, "calibrate")

    alone = time_slowest(topo, lambda: ring(False), reps)
    together = time_slowest(topo, lambda: ring(True), reps)
    return together / alone if alone > 0 else None


@contextlib.contextmanager
def computing_threads(count: int) -> Iterator[None]:
    """``count`` threads of 512 x 512 matrix products in this process while the block runs
    (compute that holds no lock of Python's, as the backward pass and an encode keep a worker's
    threads busy)."""
    stop = threading.Event()

    def burn() -> None:
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        while not stop.is_set():
            torch.mm(a, b)

    workers = [threading.Thread(target=burn, daemon=True) for _ in range(count)]
    for w in workers:
        w.start()
    try:
        yield
    finally:
        stop.set()
        for w in workers:
            w.join()


HOST_PROBE_ELEMENTS = 16 << 20
"""Float32 elements in each buffer of :func:`host_probe`'s memory-bound kernel (64 MiB: beyond
the caches, as a large bucket's error feedback and an optimizer's pass over the weights are)."""


def host_probe(ranks_per_host: int, seconds: float = 0.25) -> dict[str, float]:
    """How the host serves its ranks at this moment, for two kinds of work: ``stream`` (an in-place
    add over :data:`HOST_PROBE_ELEMENTS`-element buffers, bound by the memory's bandwidth, as
    error feedback, packing and the optimizer's step are) and ``compute`` (512 x 512 matrix
    products, bound by the cores, as convolutions are). For each: ``ranks_per_host`` x rank 0's
    time alone (the other ranks wait; the faster of two tries, as the others' waiting may still
    take a slice) / the slowest rank's with every rank at once, the same number of kernels each
    (about ``seconds`` of work alone, many scheduler slices): the effective cores that kind of work
    gets. Every rank must call it; every rank gets the same numbers.

    On this project's 2-core machine the two readings part ways, and the memory's part drifts:
    one streaming process got 1.09-1.15 x one's throughput from two cores at one moment, 1.93
    at another minutes later, while matrix products stayed at 1.98-2.03 (issue 44). ``bench
    whatif`` takes one before every round and reports their spread next to the errors."""
    a, b = torch.ones(HOST_PROBE_ELEMENTS), torch.ones(HOST_PROBE_ELEMENTS)
    m1, m2 = torch.randn(512, 512), torch.randn(512, 512)
    kernels = {"stream": lambda: a.add_(b, alpha=0.5), "compute": lambda: torch.mm(m1, m2)}
    out: dict[str, float] = {}
    for kind, kernel in kernels.items():
        kernel()  # first-call allocations
        t0 = time.perf_counter()
        for _ in range(5):
            kernel()
        once = torch.tensor([(time.perf_counter() - t0) / 5], dtype=torch.float64)
        dist.broadcast(once, 0)  # rank 0's estimate: every rank runs the same count
        count = max(int(seconds / max(float(once), 1e-6)), 5)

        def run(everyone: bool, kernel: Callable[[], Any] = kernel, count: int = count) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            if everyone or dist.get_rank() == 0:
                for _ in range(count):
                    kernel()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t)

        alone = min(run(False), run(False))
        together = run(True)
        out[f"{kind}_cores"] = ranks_per_host * alone / together if together > 0 else math.nan
    return out


BUSY_CALL_BYTES = 16 << 10
"""Per rank, the all-gather :func:`busy_calls` times: the size of a step's small collectives (a
dense bucket of biases, a compressed small layer)."""


def busy_calls(threads: int = 2, reps: int = 41) -> list[float]:
    """What a small collective call waits for while each rank's threads compute: for ``k`` = 1 ..
    ``threads`` busy threads per rank (a loop of 512 x 512 matrix products each, compute that
    holds no lock of Python's, as the backward pass and an encode keep a worker's threads busy),
    the median all-gather of :data:`BUSY_CALL_BYTES` over the world minus its median with the
    threads idle (seconds, at least 0). The median: the waits have a long tail (a call now and
    then waits for a whole time slice of every peer), which one step's few calls rarely meet."""
    numel = BUSY_CALL_BYTES // 4
    one = torch.ones(numel)
    out = [torch.empty(numel) for _ in range(dist.get_world_size())]

    def timed() -> float:
        dist.all_gather(out, one)  # the first call sets up the connections
        times = []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_gather(out, one)
            times.append(time.perf_counter() - t0)
        t = torch.tensor([statistics.median(times)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    idle = timed()
    waits = []
    for k in range(1, threads + 1):
        with computing_threads(k):
            waits.append(max(timed() - idle, 0.0))
    return waits


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    from gradsync.collectives.cost import calibrate, measure_efficiency
    from gradsync.observe.hook_costs import cross_entropy_of, gradient_bytes, powersgd_hook_rate
    from gradsync.observe.profiler import profile_step
    from gradsync.planner.engine_costs import EngineCosts
    from gradsync.whatif.codec_costs import CodecTable
    from gradsync.whatif.contenders import codec_spec_of, powersgd_rank

    contenders = split_spec_list(args.contenders)
    options = bench_step.parse_sync_options(args.sync_option)
    topo, base, x, y = bench_step.join_with_batch(args)
    rank0 = topo.rank == 0
    link = os.environ.get("TB_RATE")
    ranks_per_host = args.ranks_per_host or (topo.world if link else topo.per_node)

    def say(text: str) -> None:
        if rank0:
            print(text, file=sys.stderr, flush=True)

    size = f"{parameter_count(base) / 1e6:.1f} M parameters"
    say(f"gradsync bench whatif: {bench_step.model_label(args)} ({size}), batch {args.batch_size} per "
        f"worker, {topo.nodes} x {topo.per_node} ranks, link {link or 'unknown'}")  # fmt: skip
    t0 = time.perf_counter()
    engine = EngineCosts.load(args.costs) if args.costs else None
    if engine is not None:
        params = engine.params
        say(f"  links and codecs from the engine's refitted costs {args.costs}: {params}")
    else:
        params = calibrate(topo, reps=5)
        params = replace(params, efficiency=params.efficiency + measure_efficiency(topo, params, reps=5))
        say(f"  links calibrated in {time.perf_counter() - t0:.1f} s: {params}")
    profile, hook_rates = None, {}
    if rank0:
        profile = profile_step(copy.deepcopy(base), (x, y), steps=args.profile_steps, warmup=3,
                               overhead=False, model_name=args.model, batch_size=args.batch_size)  # fmt: skip
        hook_rates = {c: powersgd_hook_rate(base, cross_entropy_of(x, y), powersgd_rank(c),
                                            bench_step.powersgd_bucket_mb(base), x.device)
                      for c in contenders if c.startswith("ddp-powersgd")}  # fmt: skip
        for c, rate in hook_rates.items():
            say(
                f"  {c}: PyTorch's hook works {rate * gradient_bytes(base) * 1e3:.1f} ms a step (timed alone)"
            )
        own = [c for c in contenders if is_self_syncing(c) or is_sharded(c) or is_outer(c)]
        if own:  # their own step's work, in a process of its own (a world of one rank)
            keys = ("model", "batch_size", "image_size", "classes", "seq_len", "vocab", "dim", "layers",
                    "optimizer", "threads")  # fmt: skip
            work = measure_in_subprocess({k: getattr(args, k, None) for k in keys}, own)
            for c, rate in work.items():
                what = "its meetings add" if is_outer(c) else "its step adds"
                when = "per period (float32)" if is_outer(c) else "per step"
                say(f"  {c}: {what} {rate * gradient_bytes(base) * 1e3:.1f} ms of work {when} alone")
            hook_rates.update(work)
    dist.barrier()
    cont = contention(base, x, y, ranks_per_host, max(args.steps, 3))
    say(f"  contention: one worker {cont['alone_ms']:.1f} ms alone, {cont['together_ms']:.1f} ms with "
        f"{ranks_per_host} at once (the ranks' mean {cont['together_mean_ms']:.1f}): "
        f"{cont['effective_cores']:.2f} effective cores")  # fmt: skip
    busy_call_ms = [] if torch.cuda.is_available() else [w * 1e3 for w in busy_calls()]
    if busy_call_ms:  # on GPUs the threads that compute are not the host's
        say(f"  a small collective waits {', '.join(f'{w:.1f}' for w in busy_call_ms)} ms more "
            f"with 1, 2 threads computing per rank")  # fmt: skip
    transfers = None if torch.cuda.is_available() else node_transfer_ratio(topo)
    if transfers is not None:
        say(f"  the node's all-reduce with every node at once: {transfers:.2f}x one node's alone")
    costs = CodecTable()
    if engine is not None:  # the codecs as they ran in the engine; others are timed here
        costs.entries.update(engine.codecs)
    if rank0:
        for c in contenders:
            for spec in codec_spec_of(c, options):
                costs(spec, [])
    dist.barrier()
    host: list[dict[str, float]] = []

    def probe_host(r: int) -> None:  # the host's cores and memory as this round starts
        host.append(host_probe(ranks_per_host))
        say(f"  round {r + 1}: the host gives streaming work {host[-1]['stream_cores']:.2f} and "
            f"computing work {host[-1]['compute_cores']:.2f} effective cores")  # fmt: skip

    gpu = torch.cuda.is_available()  # on GPUs the work that matters is not the host's
    rows, details = bench_train.measure_contenders(
        contenders, base, topo, x, y, args, None if gpu else probe_host
    )
    if not rank0:
        return None
    assert profile is not None
    result = {
        "command": command_line(args),
        "model": bench_step.model_label(args), "parameters": parameter_count(base),
        "batch_size": args.batch_size,
        "nodes": topo.nodes, "per_node": topo.per_node, "link": link,
        "links": {"intra": asdict(params.intra), "inter": asdict(params.inter), "gamma": params.gamma,
                  "call": params.call, "efficiency": dict(params.efficiency)},
        "contention": {**cont, "ranks_per_host": ranks_per_host, "busy_call_ms": busy_call_ms,
                       "node_transfer_ratio": transfers, "cpus": host_cpus(), "rounds": host},
        "profile_step_ms": profile.phases["step"].median * 1e3,
        "profile": profile.to_dict(),
        "codecs": costs.to_dict(),
        "sync_options": options,
        "hook_rates": hook_rates,
        "engine_costs": args.costs,
        "measured": rows, "details": details,
    }  # fmt: skip
    return compare(result, args.charge_busy_calls)


def cores_from_local(cont: dict[str, Any], rows: list[dict[str, Any]]) -> float | None:
    """The effective cores from the ``local`` contender (no synchronization: every worker's step
    at once), measured in the same interleaved rounds as the other contenders: ranks x one
    worker's step alone / local's step. The contention measurement before the rounds is one
    pass at another moment, and this machine's speed drifts by 10-30 % between such moments, so
    it is only the fallback (no ``local`` among the contenders). None without ``local``.

    At most the CPUs the ranks run on (``cont["cpus"]``, where recorded): more is not a share of
    the host but a drift between the moment one worker was timed alone and the rounds (issue 44:
    ``local`` ran 140 ms against 193 in its first round, 2.36 "cores" of two, and the compressed
    contenders, whose steps had not sped up, came out 20-36 % fast; bounded, 13-25 %)."""
    local = [r for r in rows if r["contender"] == "local" and r.get("step_ms")]
    if not local or not cont.get("alone_ms"):
        return None
    return bounded_cores(float(cont["ranks_per_host"] * cont["alone_ms"] / local[0]["step_ms"]), cont)


def compute_speed(result: dict[str, Any]) -> float:
    """The factor on the profile's compute times: one worker's step alone as timed just before the
    rounds (the contention measurement's ``alone_ms``, the same step as the profile's, taken by
    the same loop) over the profile's step, timed minutes earlier. The effective cores are read
    against that same ``alone_ms`` (:func:`cores_from_local`), so the profile's speed must be its
    too; this machine's speed drifts by 10-30 % between such moments (issue 44, thirteenth
    session: the profile's step took 125-165 ms, the worker alone 117-150, between 0.71 and 1.14
    times the profile). 1 where either is missing (older results)."""
    alone, profiled = (result.get("contention") or {}).get("alone_ms"), result.get("profile_step_ms")
    if not alone or not profiled or alone <= 0 or profiled <= 0:
        return 1.0
    return float(alone) / float(profiled)


def bounded_cores(cores: float, cont: dict[str, Any]) -> float:
    """``cores`` at most the CPUs the ranks run on, where the result records them."""
    cpus = cont.get("cpus")
    return min(cores, float(cpus)) if cpus else cores


def measured_windows(result: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """Per self-syncing contender, the optimizer steps ``bench train`` measured (its
    ``details.optimizer_steps``), which 0/1 Adam's predicted mean follows. Results stored before
    they were recorded: from step 2 (the earliest after a warm-up of one) over the measured
    count, where 0/1 Adam's default schedule still exchanges on every step."""
    details = result.get("details") or {}
    out = {}
    for r in rows:
        name = r["contender"]
        if not is_self_syncing(name):
            continue
        steps = details.get(name, {}).get("optimizer_steps")
        out[name] = (int(steps[0]), int(steps[1])) if steps else (2, 1 + int(r.get("steps") or 1))
    return out


def host_cpus() -> int:
    """The CPUs this process may run on (the ranks of an emulated cluster share them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def ranks_lag(cont: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """:attr:`~gradsync.whatif.simulate.Cpu.lag_s` and ``lag_span_s``: the slowest rank's step minus
    the ranks' mean step, and the slowest rank's step, of ``local`` (every rank computing at once,
    in the same interleaved rounds as the effective cores of :func:`cores_from_local`), else of
    the contention measurement before the rounds; ``from`` says which. Empty where neither
    recorded the ranks' mean (older results) or the ranks did not fall behind each other."""
    pairs = [("contention", cont.get("together_ms"), cont.get("together_mean_ms"))]
    local = next((r for r in rows if r["contender"] == "local"), None)
    if local is not None:
        pairs.insert(0, ("local", local.get("step_ms"), local.get("mean_step_ms")))
    for source, slowest, mean in pairs:
        if slowest and mean:
            if slowest <= mean:
                return {}
            return {"lag_s": (slowest - mean) / 1e3, "lag_span_s": slowest / 1e3, "from": source}
    return {}


def compare(result: dict[str, Any], charge_busy_calls: bool = False) -> dict[str, Any]:
    """Simulate every measured contender from the result's stored measurements and put the
    predictions next to the measured steps (``rows``, ``summary``, ``predicted``). With
    ``charge_busy_calls`` each collective also waits what the busy-call probe measured for the
    worker's phase when it starts (:attr:`~gradsync.whatif.simulate.Cpu.busy_call`)."""
    from gradsync.collectives.cost import CostParams, Link
    from gradsync.observe.profile_format import Profile
    from gradsync.whatif.codec_costs import CodecTable
    from gradsync.whatif.network import Network
    from gradsync.whatif.predict import Point, predict_point
    from gradsync.whatif.simulate import Cpu, transfer_weight
    from gradsync.whatif.workload import Workload

    speed = compute_speed(result)
    workload = Workload.from_profile(Profile.from_dict(result["profile"])).scaled(speed)
    links = result["links"]
    efficiency = tuple((str(k), float(v)) for k, v in (links.get("efficiency") or {}).items())
    params = CostParams(
        Link(**links["intra"]), Link(**links["inter"]), links["gamma"], call=links.get("call", 0.0),
        efficiency=efficiency,
    )  # fmt: skip
    costs = CodecTable.from_dict(result["codecs"], "the result's codecs")
    cont = result["contention"]
    rows = result["measured"]
    cores = cores_from_local(cont, rows)
    # absent in older results
    busy_call = tuple(w / 1e3 for w in cont.get("busy_call_ms", ())) if charge_busy_calls else ()
    effective = cores if cores is not None else bounded_cores(cont["effective_cores"], cont)
    # absent in older results: a node-internal transfer feels the contention as a thread computing
    weight = transfer_weight(cont.get("node_transfer_ratio"), cont["ranks_per_host"], effective)
    lag = ranks_lag(cont, rows)
    cpu = Cpu(cont["ranks_per_host"], effective, busy_call, weight,
              lag_s=lag.get("lag_s", 0.0), lag_span_s=lag.get("lag_span_s", 0.0))  # fmt: skip
    point = Point(result["nodes"], result["per_node"], Network(params, "calibrated in the run"))
    contenders = [r["contender"] for r in rows]
    one_bucket = int(workload.nbytes + (1 << 20))  # bench step's PowerSGD hook runs on one bucket (gloo)
    gpu = torch.cuda.is_available()
    ddp_buckets = {c: one_bucket for c in contenders if c.startswith("ddp-powersgd") and not gpu}
    # the hooks' work as measured running (results stored before it was: the codec's timing)
    hooks = result.get("hook_rates") or {}
    windows = measured_windows(result, rows)
    predicted = predict_point(
        workload, point, contenders, costs, cpu, result.get("sync_options"), ddp_buckets, hooks, windows
    )
    table = []
    for meas, pred in zip(rows, predicted, strict=True):
        err = pred["step_ms"] / meas["step_ms"] - 1
        table.append({
            "contender": meas["contender"], "measured_ms": meas["step_ms"], "predicted_ms": pred["step_ms"],
            "error": err, "measured_exposed_ms": meas["exposed_ms"],
            "predicted_exposed_ms": pred["exposed_ms"],
            "measured_plan": meas["compressed_buckets"], "predicted_plan": pred["notes"],
        })  # fmt: skip
    errors = [abs(r["error"]) for r in table if r["contender"] != "local"]
    used = {"effective_cores_used": cpu.cores, "from": "local" if cores is not None else "contention",
            "transfer_weight": cpu.transfer_weight, "busy_transfer_weight": cpu.busy_transfer_weight,
            "busy_call_ms_charged": [w * 1e3 for w in cpu.busy_call],
            "lag_ms": cpu.lag_s * 1e3, "lag_span_ms": cpu.lag_span_s * 1e3,
            "lag_from": lag.get("from"), "compute_scale": speed}  # fmt: skip
    summary: dict[str, Any] = {"max_abs_error": max(errors), "median_abs_error": statistics.median(errors)}
    summary.update(worst_round(rows, predicted))
    summary.update(advise_check(rows, predicted))
    summary.update(host_spread(cont))
    summary.update(hook_sent(result, workload, contenders))
    # again with what one engine of this run measured: its closed loop's refitted links, call
    # cost, efficiencies per class of collective and codecs (as gradsync whatif --costs would)
    source = next(
        (c for c in contenders if (result.get("details") or {}).get(c, {}).get("engine_costs")), None
    )
    if source is not None:
        from gradsync.planner.engine_costs import EngineCosts

        engine = EngineCosts.from_dict(result["details"][source]["engine_costs"], f"{source}'s engine costs")
        refit_costs = CodecTable.from_dict(result["codecs"], "the result's codecs")
        refit_costs.entries.update(engine.codecs)
        refit_point = Point(result["nodes"], result["per_node"], Network(engine.params, f"{source}'s refit"))
        again = predict_point(
            workload,
            refit_point,
            contenders,
            refit_costs,
            cpu,
            result.get("sync_options"),
            ddp_buckets,
            hooks,
            windows,
        )
        for row, pred in zip(table, again, strict=True):
            row["refit_ms"] = pred["step_ms"]
            row["refit_error"] = pred["step_ms"] / row["measured_ms"] - 1
        refit_errors = [abs(r["refit_error"]) for r in table if r["contender"] != "local"]
        summary.update(
            refit_from=source, refit_efficiency=dict(engine.params.efficiency),
            refit_max_abs_error=max(refit_errors), refit_median_abs_error=statistics.median(refit_errors),
        )  # fmt: skip
    return {**result, "rows": table, "predicted": predicted, "contention_used": used, "summary": summary}


def hook_sent(result: dict[str, Any], workload: Any, contenders: list[str]) -> dict[str, Any]:
    """Per PyTorch PowerSGD hook contender, the share of its gradient's elements the hook sent in
    the run, by its own counters (``details[name]["hook_sent"]``, absent in older results), beside
    the share the simulator sends for it (:func:`gradsync.collectives.cost.powersgd_hook_split`
    over the profile's shapes), and the steps it compressed."""
    from gradsync.collectives.cost import powersgd_hook_split
    from gradsync.whatif.contenders import powersgd_rank

    out = {}
    for name in contenders:
        measured = ((result.get("details") or {}).get(name) or {}).get("hook_sent")
        if not name.startswith("ddp-powersgd") or not measured:
            continue
        tensors = [t for t in workload.tensors if t.ready is not None]
        if not tensors:
            continue
        split = powersgd_hook_split([t.dims for t in tensors], powersgd_rank(name), tensors[0].itemsize)
        out[name] = {
            "measured_sent_fraction": measured["sent_fraction"],
            "predicted_sent_fraction": (split.dense + split.p + split.q) / (split.dense + split.matrices),
            "compressed_steps": measured["compressed_steps"],
        }
    return {"hook_sent": out} if out else {}


def worst_round(rows: list[dict[str, Any]], predicted: list[dict[str, Any]]) -> dict[str, Any]:
    """The prediction's largest error against any single round's measured step (``local`` aside)."""
    worst: dict[str, Any] = {}
    for meas, pred in zip(rows, predicted, strict=True):
        if meas["contender"] == "local":
            continue
        for i, step in enumerate(meas.get("round_step_ms") or [meas["step_ms"]]):
            err = pred["step_ms"] / step - 1
            if not worst or abs(err) > abs(worst["worst_round_error"]):
                worst = {
                    "worst_round_error": err,
                    "worst_round_contender": meas["contender"],
                    "worst_round": i + 1,
                }
    return worst


def host_spread(cont: dict[str, Any]) -> dict[str, Any]:
    """The lowest and highest reading of each kind of :func:`host_probe` over the rounds (absent
    in older results and on GPUs): how steady the host was while the contenders were measured."""
    rounds = cont.get("rounds") or []
    out = {}
    for kind in ("stream", "compute"):
        values = [float(r[f"{kind}_cores"]) for r in rounds if f"{kind}_cores" in r]
        if values:
            out[f"host_{kind}_cores"] = [min(values), max(values)]
    return out


def advise_check(rows: list[dict[str, Any]], predicted: list[dict[str, Any]]) -> dict[str, Any]:
    """What ``gradsync advise`` would choose from these predictions (speed alone: dense when within
    its margin of the fastest), against the measured fastest mode (``local`` is not a mode)."""
    from gradsync.apps.commands.advise import DENSE_MARGIN, advise_point

    modes = [p for p in predicted if p["contender"] != "local"]
    measured = {r["contender"]: r["step_ms"] for r in rows if r["contender"] != "local"}
    if not modes:
        return {}
    choice = advise_point(modes, DENSE_MARGIN, math.inf)["choice"]
    fastest = min(measured, key=lambda c: measured[c])
    if choice is None:
        return {}
    return {
        "advise_choice": choice, "measured_fastest": fastest,
        "advise_choice_over_fastest": measured[choice] / measured[fastest],
    }  # fmt: skip


COLUMNS = ("contender", "measured ms", "predicted ms", "error", "measured exposed ms", "predicted exposed ms",
           "compressed buckets (measured)", "plan (predicted)")  # fmt: skip


REFIT_COLUMNS = ("predicted with the refit ms", "error (refit)")


def columns(result: dict[str, Any]) -> tuple[str, ...]:
    return COLUMNS + REFIT_COLUMNS if "refit_from" in result["summary"] else COLUMNS


def cells(r: dict[str, Any]) -> list[str]:
    exp = r["measured_exposed_ms"]
    out = [
        r["contender"], f"{r['measured_ms']:.1f}", f"{r['predicted_ms']:.1f}", f"{100 * r['error']:+.1f}%",
        "" if exp is None else f"{exp:.1f}", f"{r['predicted_exposed_ms']:.1f}", r["measured_plan"],
        r["predicted_plan"],
    ]  # fmt: skip
    if "refit_ms" in r:
        out += [f"{r['refit_ms']:.1f}", f"{100 * r['refit_error']:+.1f}%"]
    return out


def summary_lines(s: dict[str, Any]) -> list[str]:
    lines = [f"largest error {100 * s['max_abs_error']:.1f}%, median {100 * s['median_abs_error']:.1f}%"]
    if "worst_round_error" in s:
        lines.append(
            f"largest error against a single round: {100 * s['worst_round_error']:+.1f}% "
            f"({s['worst_round_contender']}, round {s['worst_round']})"
        )
    if "advise_choice" in s:
        lines.append(
            f"advise's first choice from these predictions: {s['advise_choice']}, measured "
            f"{s['advise_choice_over_fastest']:.2f}x the step of the measured fastest mode "
            f"({s['measured_fastest']})"
        )
    if "host_stream_cores" in s and "host_compute_cores" in s:
        (s0, s1), (c0, c1) = s["host_stream_cores"], s["host_compute_cores"]
        lines.append(
            f"the host over the rounds: streaming work {s0:.2f}-{s1:.2f} effective cores, computing "
            f"work {c0:.2f}-{c1:.2f} (probed before each round)"
        )
    for name, h in (s.get("hook_sent") or {}).items():
        lines.append(
            f"{name} sent {100 * h['measured_sent_fraction']:.2f} % of the gradient's elements by its own "
            f"counters over {h['compressed_steps']:.0f} compressed steps; the simulator sends "
            f"{100 * h['predicted_sent_fraction']:.2f} %"
        )
    if "refit_from" in s:
        eff = ", ".join(f"{k} x{v:.2f}" for k, v in s["refit_efficiency"].items()) or "none"
        lines.append(
            f"with {s['refit_from']}'s refitted costs (efficiencies: {eff}): largest error "
            f"{100 * s['refit_max_abs_error']:.1f}%, median {100 * s['refit_median_abs_error']:.1f}%"
        )
    return lines


def markdown(result: dict[str, Any]) -> str:
    lines = [markdown_table(columns(result), [cells(r) for r in result["rows"]])]
    lines += summary_lines(result["summary"])
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`)."""
    status = run_emulated(args, "bench whatif")
    if status is not None:
        return status
    owned = not dist.is_initialized()
    if args.replay is not None:
        import json

        with open(args.replay) as fh:
            stored = json.load(fh)
        result: dict[str, Any] | None = compare(stored, args.charge_busy_calls)
    else:
        result = run(args)
    if result is not None:
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"predicted vs measured step, {result['model']}, {result['nodes']} x "
                      f"{result['per_node']} ranks, link {result['link']}")  # fmt: skip
        for col in columns(result):
            table.add_column(col, justify="left" if col == "contender" or "plan" in col else "right")
        for r in result["rows"]:
            table.add_row(*cells(r))
        (Console() if sys.stdout.isatty() else Console(width=220)).print(table)
        for line in summary_lines(result["summary"]):
            print(line)
        save_result(result, args.json, args.markdown, markdown(result))
    if owned and dist.is_initialized():
        dist.destroy_process_group()
    return 0
