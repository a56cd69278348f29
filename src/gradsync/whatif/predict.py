"""Predictions per contender, at one point or over sweeps of the cluster, network and compression.

For each contender :func:`predict_point` builds the simulated step
(:func:`gradsync.whatif.contenders.build_program`), simulates it
(:func:`gradsync.whatif.simulate.simulate`) and reports:

- ``step_ms``: one step of every worker;
- ``exposed_ms``: the step minus the ``local`` step (the same compute under the same contention,
  nothing synchronized): the synchronization the backward pass did not hide;
- ``scaling_factor``: the network-bottleneck paper's T_n / (n T_1) with T_1 one worker's step alone;
- ``cable_mb``: MB per step over each node's cable (one direction), ``utilization``: that over
  what the cable could carry in the step.

A sweep varies ``inter`` (the node cable's rate), ``inter_latency``, ``nodes``, ``per_node`` or
``ratio``: a compression ratio R that sets ``{density}`` = 1 / R and ``{ratio}`` = R in the
contenders' names (``hitopk:density={density}``, ``paper02:ratio={ratio}``); several sweeps are
crossed.

References:

- network-bottleneck paper: Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Any

from gradsync.planner.closed_loop import scaled_codec
from gradsync.units import parse_duration, parse_rate, rate_text
from gradsync.whatif.contenders import Cluster, CodecCosts, build_program, check_contender, trial_families
from gradsync.whatif.modes import exchange_share, is_outer, is_self_syncing, outer_cost
from gradsync.whatif.network import Network
from gradsync.whatif.sharded import is_sharded, sharded_step
from gradsync.whatif.simulate import NO_CONTENTION, Cpu, StepProgram, StepResult, simulate
from gradsync.whatif.workload import Workload

SWEEP_KEYS = ("inter", "inter_latency", "nodes", "per_node", "ratio")


@dataclass(frozen=True)
class Point:
    """One simulated configuration."""

    nodes: int
    per_node: int
    network: Network
    ratio: float | None = None  # the compression ratio a sweep sets

    def label(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "nodes": self.nodes, "per_node": self.per_node,
            "inter": rate_text(self.network.inter_bytes_per_s),
            "inter_bps": self.network.inter_bytes_per_s * 8,
            "inter_latency_us": self.network.params.inter.alpha * 1e6,
        }  # fmt: skip
        if self.ratio is not None:
            out["ratio"] = self.ratio
        return out


def contender_name(template: str, ratio: float | None) -> str:
    """``hitopk:density={density}`` at ratio 100 -> ``hitopk:density=0.01``."""
    if ratio is None:
        if "{" in template:
            raise ValueError(f"--scheme {template!r} has a placeholder: add --sweep ratio=...")
        return template
    return template.replace("{density}", f"{1 / ratio:.6g}").replace("{ratio}", f"{ratio:g}")


def check_contenders(templates: list[str], with_ratio: bool) -> None:
    for t in templates:
        if "{" in t and not with_ratio:
            raise ValueError(
                f"--scheme {t!r} has a placeholder {{density}} or {{ratio}}: add --sweep ratio=..."
            )
        check_contender(contender_name(t, 10.0 if with_ratio else None))


def parse_sweep(text: str) -> tuple[str, list[Any]]:
    """``inter=1,10,25gbit`` (a value without a unit takes the next unit given, else the last),
    ``nodes=2,4,8``, ``ratio=1,10,100``, ``inter_latency=5us,50us``."""
    key, eq, values = text.partition("=")
    key = key.strip().replace("-", "_")
    if not eq or key not in SWEEP_KEYS:
        raise ValueError(f"--sweep takes KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}, got {text!r}")
    items = [v.strip() for v in values.split(",") if v.strip()]
    if not items:
        raise ValueError(f"--sweep {key}= needs at least one value")
    out: list[Any] = []
    if key in ("inter", "inter_latency"):
        # a value without a unit takes the unit of the next value that has one (of the last before
        # it when none follows)
        units = ["".join(c for c in v if c.isalpha() or c == "/") for v in items]
        parse = parse_rate if key == "inter" else parse_duration
        for i, v in enumerate(items):
            after = [u for u in units[i:] if u] or [u for u in units[:i] if u] or [""]
            out.append(parse(v if units[i] else v + after[0], f"--sweep {key}"))
    else:
        for v in items:
            try:
                n = float(v) if key == "ratio" else int(v)
            except ValueError:
                n = -1
            if not n >= 1:
                what = "numbers" if key == "ratio" else "integers"
                raise ValueError(f"--sweep {key}: values must be {what} >= 1, got {v!r}")
            out.append(n)
    return key, out


def points(base: Point, sweeps: list[tuple[str, list[Any]]]) -> list[Point]:
    if not sweeps:
        return [base]
    out = []
    for combo in itertools.product(*(values for _, values in sweeps)):
        p = base
        for (key, _), v in zip(sweeps, combo, strict=True):
            if key == "inter":
                p = replace(p, network=p.network.with_inter(bytes_per_s=v))
            elif key == "inter_latency":
                p = replace(p, network=p.network.with_inter(latency_s=v))
            elif key == "ratio":
                p = replace(p, ratio=float(v))
            elif key == "nodes":
                p = replace(p, nodes=int(v))
            else:
                p = replace(p, per_node=int(v))
        out.append(p)
    return out


TIMES = ("step_s", "backward_end_s", "sync_end_s", "wait_s", "comm_busy_s", "compute_busy_s")
"""A :class:`StepResult`'s times: what a mean of two kinds of step averages."""


def simulate_contender(
    name: str, workload: Workload, point: Point, costs: CodecCosts, cpu: Cpu,
    sync_options: dict[str, str] | None = None, record: bool = False, ddp_bucket_bytes: int | None = None,
    hook_rate: float | None = None, window: tuple[int, int] | None = None,
) -> tuple[StepResult, float, list[str]]:  # fmt: skip
    """The simulated step of one contender, its cable bytes and the program's notes. An outer loop
    (:mod:`gradsync.whatif.modes`): its inner step simulated as DDP on a one-node cluster of the
    node's ranks, plus its exchanges and outer steps spread over the period. FSDP2, HSDP and
    ``replicate`` (:mod:`gradsync.whatif.sharded`): their own unit-by-unit step. A self-syncing
    optimizer: its exchange step and, where its schedule skips exchanges (0/1 Adam), its local
    step, weighed by :func:`~gradsync.whatif.modes.exchange_share` over the optimizer's steps
    ``window`` (None: its steady state)."""
    cluster = Cluster(point.nodes, point.per_node, point.network.params)
    if is_sharded(name):
        w = workload
        own = (hook_rate or 0.0) * w.nbytes  # FSDP2's own work per step, measured on one rank
        sh = sharded_step(
            name, w, cluster.params, point.nodes, point.per_node, costs, cpu.slowdown(1),
            "nccl" if math.isinf(cpu.cores) else "gloo", own,
        )  # fmt: skip
        result = StepResult(
            step_s=sh.step_s, backward_end_s=math.nan, sync_end_s=sh.step_s, wait_s=sh.exposed_s,
            comm_busy_s=sh.comm_s, compute_busy_s=0.0, spans=[], launches=[],
        )  # fmt: skip
        return result, sh.cable_bytes, sh.notes
    kw: dict[str, Any] = {"ddp_bucket_bytes": ddp_bucket_bytes} if ddp_bucket_bytes else {}
    inner = name
    if is_outer(name):
        inner = "ddp" if point.per_node > 1 else "local"
        kw = {}  # DDP's default buckets inside the node
    run_on = Cluster(1, point.per_node, point.network.params) if is_outer(name) else cluster
    inner_rate = None if is_outer(name) else hook_rate  # the outer loop's own work is its meetings'
    program = build_program(inner, workload, run_on, costs, sync_options, hook_rate=inner_rate, **kw)
    ready = [(i, t.ready) for i, t in enumerate(workload.tensors) if t.ready is not None]
    w = workload
    result = simulate(program, ready, w.data, w.forward, w.backward, w.optimizer, cpu, record)
    if is_self_syncing(name) and (share := exchange_share(name, window)) < 1.0:
        alone = build_program(inner, workload, run_on, costs, hook_rate=hook_rate, exchange=False)
        local = simulate(alone, ready, w.data, w.forward, w.backward, w.optimizer, cpu, False)
        mean = replace(
            result, **{k: share * getattr(result, k) + (1.0 - share) * getattr(local, k) for k in TIMES}
        )
        note = (
            f"an exchange on {100 * share:.1f} % of the steps, the others local ({local.step_s * 1e3:.1f} ms)"
        )
        return mean, share * program.cable_bytes, [*program.notes, note]
    if not is_outer(name):
        return _fastest_trial(name, workload, cluster, costs, sync_options, cpu, record, result, program)
    slow = cpu.slowdown(1)  # every rank of the host in the exchange at once, one busy thread each
    oc = outer_cost(
        name, [t.numel for t in w.tensors], cluster.model(), cluster.bytes_model(),
        cluster.params.gamma * slow, result.step_s,
        lambda spec, sizes: scaled_codec(costs(spec, sizes), slow, slow),
        None if hook_rate is None else hook_rate * slow,
    )  # fmt: skip
    notes = [
        *program.notes,
        f"inner step {result.step_s * 1e3:.1f} ms; largest exchange {oc.exchange_s * 1e3:.1f} ms; "
        f"{oc.exposed_s * 1e3:.1f} ms exposed per period",
    ]
    return replace(result, step_s=result.step_s + oc.per_step_s), oc.cable_bytes_per_step, notes


def _fastest_trial(
    name: str, workload: Workload, cluster: Cluster, costs: CodecCosts, sync_options: dict[str, str] | None,
    cpu: Cpu, record: bool, result: StepResult, program: StepProgram,
) -> tuple[StepResult, float, list[str]]:  # fmt: skip
    """A gradsync contender whose closed loop runs trials (:mod:`gradsync.planner.trials`) ends on
    the plan that measured fastest, its first plan or one codec's alone: the fastest simulated
    of them (``result``, ``program``: the first plan's)."""
    notes = list(program.notes)
    w = workload
    ready = [(i, t.ready) for i, t in enumerate(w.tensors) if t.ready is not None]
    best, best_program, kept = result, program, ""
    for family, ids in trial_families(name, w, cluster, costs, sync_options):
        trial = build_program(name, w, cluster, costs, sync_options, allowed=ids)
        got = simulate(trial, ready, w.data, w.forward, w.backward, w.optimizer, cpu, record)
        notes.append(
            f"trial of {family} alone {got.step_s * 1e3:.1f} ms (first plan {result.step_s * 1e3:.1f})"
        )
        if got.step_s < best.step_s:
            best, best_program, kept = got, trial, family
    if kept:
        notes.append(f"the closed loop keeps {kept} alone ({', '.join(best_program.notes)})")
    return best, best_program.cable_bytes, notes


def predict_point(
    workload: Workload,
    point: Point,
    templates: list[str],
    costs: CodecCosts,
    cpu: Cpu = NO_CONTENTION,
    sync_options: dict[str, str] | None = None,
    ddp_bucket_bytes: dict[str, int] | None = None,
    hook_rates: dict[str, float] | None = None,
    windows: dict[str, tuple[int, int]] | None = None,
) -> list[dict[str, Any]]:
    """One row per contender at ``point``; ``hook_rates``: PyTorch hooks' measured work per
    contender name (:func:`~gradsync.whatif.contenders.build_program`'s ``hook_rate``);
    ``windows``: per self-syncing contender, the optimizer steps its mean is over (first, last;
    without one, its steady state: :func:`simulate_contender`)."""
    local, _, _ = simulate_contender("local", workload, point, costs, cpu)
    rows = []
    rate = point.network.inter_bytes_per_s
    for template in templates:
        name = contender_name(template, point.ratio)
        buckets = (ddp_bucket_bytes or {}).get(name)
        res, cable, notes = simulate_contender(
            name, workload, point, costs, cpu, sync_options, ddp_bucket_bytes=buckets,
            hook_rate=(hook_rates or {}).get(name), window=(windows or {}).get(name),
        )  # fmt: skip
        busy = cable / rate if math.isfinite(rate) and point.nodes > 1 else 0.0
        rows.append({
            **point.label(),
            "contender": template if point.ratio is None else name,
            "template": template,
            "step_ms": res.step_s * 1e3,
            "local_ms": local.step_s * 1e3,
            "exposed_ms": max(res.step_s - local.step_s, 0.0) * 1e3,
            "wait_ms": res.wait_s * 1e3,
            "comm_busy_ms": res.comm_busy_s * 1e3,
            "compute_busy_ms": res.compute_busy_s * 1e3,
            "scaling_factor": workload.step / res.step_s,
            "scaling_vs_local": local.step_s / res.step_s,
            "cable_mb": cable / 1e6,
            "utilization": busy / res.step_s if res.step_s > 0 else 0.0,
            "notes": "; ".join(notes),
        })  # fmt: skip
    return rows
