"""Network utilization in ``gradsync bench step`` and ``gradsync bench train`` (``--nic``).

On one rank per node (local rank 0) a :class:`~gradsync.observe.nic.NicSampler` reads the NIC
counters every ``--nic-interval-ms`` during a contender's measured steps, and each step's
**communication phase** is recorded on the same clock. The phase is the same for every
contender, so that they compare: from the call of ``loss.backward()`` to the moment the
synchronization is over, which is

- for DDP (and its hooks) the return of ``loss.backward()``: DDP waits for its last bucket's
  all-reduce inside the backward pass;
- for gradsync the engine's ``done_at`` (every gradient synchronized, inside the backward
  pass's final callback);
- for ``local`` the end of the backward pass (no traffic is expected: the row is a baseline).

The phase includes the backward computation that overlaps the communication: what it measures is
how well the link is used while the step is waiting on synchronization or could be sending, not
the raw speed of one transfer. A scheme that sends its few bytes in a burst shows a high peak and
a low mean.

The figures per node, each from the busier direction of the full-duplex link (sent or received,
chosen over the phases, see :func:`~gradsync.observe.nic.phase_throughput`): mean throughput
over the phases (MB/s, 10^6 bytes, and as a share of the link rate), the fastest window (peak),
and the share of phase time with the link at >= 90 % of its rate over a window (busy). A window
is one or more consecutive sampling intervals, long enough that the counters' granularity (a
whole 64 KiB offload packet at a time) is under 10 % of the link rate: ``--nic-window-ms``, by
default 52 ms at 100 Mbit/s and the 10 ms interval at 1 Gbit/s. Every rank all-gathers the
nodes' figures (one small collective per contender, only with ``--nic``), and the row carries
their mean over the nodes; the JSON details keep each node's.

Link rate: ``--nic-rate``, else the emulated cluster's ``TB_RATE``, else the rate the driver
reports for the interface (``/sys/class/net/<if>/speed``), else unknown (shares left out).

References:

- network-bottleneck paper: Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync.apps.commands.bench.support.world import link_bytes_per_s
from gradsync.collectives import Topology
from gradsync.observe.nic import (
    SYSFS_NET,
    NicSampler,
    Panel,
    Sample,
    check_interface_name,
    link_speed_bytes_per_s,
    peak_window_s,
    phase_throughput,
    plot_throughput,
)
from gradsync.units import parse_rate

COLUMNS = ("comm MB/s", "% of link", "peak %", "busy % (≥90 %)")
_PAD_S = 0.05  # plotted before the first and after the last plotted step


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("network utilization (network-bottleneck paper, §2.4)")
    g.add_argument("--nic", action="store_true",
                   help="sample each node's NIC during the measured steps (local rank 0) and report the "
                        "communication phase's throughput against the link rate")  # fmt: skip
    g.add_argument("--nic-png", metavar="PATH",
                   help="also plot throughput over the first measured steps, one panel per contender "
                        "(implies --nic)")  # fmt: skip
    g.add_argument("--nic-interval-ms", type=float, default=10.0, help="sampling interval (default 10)")
    g.add_argument("--nic-if", metavar="IF[,IF]",
                   help="interfaces to sample (default: GLOO_SOCKET_IFNAME's)")  # fmt: skip
    g.add_argument("--nic-rate", metavar="RATE",
                   help="the link rate, e.g. 1gbit (default: TB_RATE on the emulated cluster, else the "
                        "driver's speed)")  # fmt: skip
    g.add_argument("--nic-window-ms", type=float,
                   help="the window of the peak and busy figures (default: the shortest that resolves "
                        "10 %% of the link rate through 64 KiB offload packets, at least the interval: "
                        "52 ms at 100 Mbit/s, 10 ms at 1 Gbit/s)")  # fmt: skip
    g.add_argument("--nic-plot-steps", type=int, default=3, help="measured steps per panel of --nic-png")
    g.add_argument("--nic-sysfs", default=SYSFS_NET, metavar="DIR",
                   help=f"where the interfaces' counters are (default {SYSFS_NET})")  # fmt: skip


def enabled(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "nic", False) or getattr(args, "nic_png", None))


def _interfaces(args: argparse.Namespace) -> list[str] | None:
    if not args.nic_if:
        return None
    return [s.strip() for s in args.nic_if.split(",") if s.strip()]


def check(args: argparse.Namespace) -> None:
    """The ``--nic*`` values (``ValueError`` naming the option)."""
    ms = args.nic_interval_ms
    if not (math.isfinite(ms) and 1.0 <= ms <= 1000.0):
        raise ValueError(f"--nic-interval-ms must be from 1 to 1000, got {ms!r}")
    w = args.nic_window_ms
    if w is not None and not (math.isfinite(w) and ms <= w <= 10_000):
        raise ValueError(f"--nic-window-ms must be from --nic-interval-ms ({ms:g}) to 10000, got {w!r}")
    if args.nic_plot_steps < 1:
        raise ValueError(f"--nic-plot-steps must be at least 1, got {args.nic_plot_steps}")
    if args.nic_if is not None:
        names = _interfaces(args)
        if not names:
            raise ValueError(f"--nic-if must name at least one interface, got {args.nic_if!r}")
        for name in names:
            try:
                check_interface_name(name)
            except ValueError as e:
                raise ValueError(f"--nic-if: {e}") from None
    if args.nic_rate is not None:
        parse_rate(args.nic_rate, "--nic-rate")
    if not os.path.isdir(args.nic_sysfs):
        raise ValueError(f"--nic-sysfs: {args.nic_sysfs!r} is not a directory")
    if args.nic_png is not None:
        if not args.nic_png.lower().endswith(".png"):
            raise ValueError(f"--nic-png must end in .png, got {args.nic_png!r}")
        folder = os.path.dirname(os.path.abspath(args.nic_png))
        if not os.path.isdir(folder):
            raise ValueError(f"--nic-png: the folder {folder!r} does not exist")


def link_rate(args: argparse.Namespace, interfaces: list[str]) -> tuple[float | None, str]:
    """The link rate in bytes/s and where it came from."""
    if args.nic_rate:
        return parse_rate(args.nic_rate, "--nic-rate"), f"--nic-rate {args.nic_rate}"
    tb = os.environ.get("TB_RATE")
    rate = link_bytes_per_s(tb)
    if rate is not None:
        return rate, f"TB_RATE={tb}"
    speeds = [link_speed_bytes_per_s(i, args.nic_sysfs) for i in interfaces]
    if speeds and all(s is not None for s in speeds):
        return sum(s for s in speeds if s is not None), "the driver's speed"
    return None, "unknown"


@dataclass
class NicProbe:
    """One contender's NIC sampling. Every rank makes one (``finish`` is a collective when
    ``--nic`` is on); only local rank 0 samples."""

    args: argparse.Namespace
    topo: Topology
    sampler: NicSampler | None = None
    reason: str | None = None
    link: float | None = None
    link_source: str = "unknown"
    window_s: float | None = None
    phases: list[tuple[float, float]] = field(default_factory=list)
    steps: list[tuple[float, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.on = enabled(self.args)
        if self.on and self.topo.local_rank == 0:
            sampler = NicSampler(
                _interfaces(self.args), self.args.nic_interval_ms / 1e3, sysfs_root=self.args.nic_sysfs
            )
            self.reason = sampler.reason
            if sampler.available:
                self.sampler = sampler
                self.link, self.link_source = link_rate(self.args, sampler.interfaces)
                interval_s = self.args.nic_interval_ms / 1e3
                window_ms = self.args.nic_window_ms
                self.window_s = window_ms / 1e3 if window_ms else peak_window_s(self.link, interval_s)

    def start(self) -> None:
        if self.sampler is not None:
            self.sampler.start()

    def record(self, step_t0: float, phase_t0: float, phase_t1: float, step_t1: float) -> None:
        """One measured step: its span and its communication phase (``time.perf_counter()``)."""
        if self.sampler is not None:
            self.steps.append((step_t0, step_t1))
            self.phases.append((phase_t0, phase_t1))

    def finish(self) -> tuple[dict[str, float | None], dict[str, Any]]:
        """Stop sampling; the row's figures (mean over nodes) and the details (each node's, and
        on rank 0 its node's samples over the first ``--nic-plot-steps`` steps). Every rank must
        call this when ``--nic`` is on."""
        empty: dict[str, float | None] = dict.fromkeys(_ROW_FIELDS)
        if not self.on:
            return empty, {}
        mine = [0.0] * 7
        samples: list[Sample] = []
        if self.sampler is not None:
            samples = self.sampler.stop()
            self.sampler.close()
            got = phase_throughput(samples, self.phases, self.link, window_s=self.window_s)
            nan = float("nan")
            mine = [
                1.0,
                got.mean_bytes_per_s / 1e6,
                nan if got.mean_share is None else 100 * got.mean_share,
                nan if got.peak_share is None else 100 * got.peak_share,
                nan if got.busy_share is None else 100 * got.busy_share,
                got.seconds,
                got.covered_s,
            ]
        t = torch.tensor(mine, dtype=torch.float64)
        parts = [torch.empty_like(t) for _ in range(self.topo.world)]
        dist.all_gather(parts, t)
        nodes = [
            {"node": r // self.topo.per_node, "rank": r, "mb_per_s": p[1], "link_pct": p[2], "peak_pct": p[3],
             "busy_pct": p[4], "phase_s": p[5], "covered_s": p[6]}
            for r, p in enumerate(x.tolist() for x in parts) if p[0] == 1.0
        ]  # fmt: skip
        for n in nodes:
            for k, v in n.items():
                if isinstance(v, float) and math.isnan(v):
                    n[k] = None
        row = {k: _mean([n[src] for n in nodes]) for k, src in _ROW_FIELDS.items()}
        details: dict[str, Any] = {
            "interfaces": self.sampler.interfaces if self.sampler is not None else None,
            "interval_ms": self.args.nic_interval_ms,
            "window_ms": None if self.window_s is None else self.window_s * 1e3,
            "link_bytes_per_s": self.link,
            "link_source": self.link_source,
            "reason": self.reason,
            "nodes": nodes,
        }
        if self.sampler is not None and self.sampler.dropped:
            details["dropped_samples"] = self.sampler.dropped
        if self.topo.rank == 0 and self.sampler is not None and self.steps:
            details["plot"] = _plot_window(samples, self.steps, self.phases, self.args.nic_plot_steps)
        return row, details


_ROW_FIELDS = {"nic_mb_per_s": "mb_per_s", "nic_link_pct": "link_pct", "nic_peak_pct": "peak_pct",
               "nic_busy_pct": "busy_pct"}  # fmt: skip
ROW_FIELDS = tuple(_ROW_FIELDS)
"""The fields this probe adds to a benchmark's row."""


def _mean(values: list[Any]) -> float | None:
    known = [float(v) for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _plot_window(
    samples: list[Sample], steps: list[tuple[float, float]], phases: list[tuple[float, float]], n: int
) -> dict[str, Any]:
    """The samples and phases of the first ``n`` steps, on a clock that starts at the first step
    (counters relative to the first sample kept), as plain lists for the JSON."""
    a, b = steps[0][0] - _PAD_S, steps[min(n, len(steps)) - 1][1] + _PAD_S
    # one sample on each side of the window, so its first and last intervals are complete
    inside = [i for i, s in enumerate(samples) if a <= s.t <= b]
    if not inside:
        return {"samples": [], "phases": []}
    lo, hi = max(inside[0] - 1, 0), min(inside[-1] + 1, len(samples) - 1)
    kept = samples[lo : hi + 1]
    t0, tx0, rx0 = steps[0][0], kept[0].tx, kept[0].rx
    return {
        "samples": [[round(s.t - t0, 6), s.tx - tx0, s.rx - rx0] for s in kept],
        "phases": [[round(p - t0, 6), round(q - t0, 6)] for p, q in phases[:n]],
    }


def cells(r: dict[str, Any]) -> list[str]:
    def f(v: float | None, fmt: str) -> str:
        return "n/a" if v is None else format(v, fmt)

    return [f(r.get("nic_mb_per_s"), ".2f"), f(r.get("nic_link_pct"), ".1f"), f(r.get("nic_peak_pct"), ".1f"),
            f(r.get("nic_busy_pct"), ".1f")]  # fmt: skip


def summary(result: dict[str, Any]) -> dict[str, Any]:
    """What the run's ``nic`` entry says: how the link was measured (from the first contender)."""
    details: dict[str, dict[str, Any]] = result["details"]
    first: dict[str, Any] = next((d["nic"] for d in details.values() if "nic" in d), {})
    keys = ("interfaces", "interval_ms", "window_ms", "link_bytes_per_s", "link_source", "reason")
    return {k: first.get(k) for k in keys}


def say_reason(result: dict[str, Any]) -> None:
    nic = result.get("nic")
    if nic and nic.get("reason"):
        print(f"--nic: no NIC figures on rank 0's node: {nic['reason']}", file=sys.stderr)


def plot(result: dict[str, Any], path: str) -> bool:
    """The PNG of ``--nic-png`` from a result's details (rank 0's node); False when no contender
    has samples to plot."""
    panels = []
    for r in result["rows"]:
        window = result["details"].get(r["contender"], {}).get("nic", {}).get("plot")
        if not window:
            continue
        share = r.get("nic_link_pct")
        pct = "" if share is None else f": {share:.0f} % of the link in the phases"
        panels.append(
            Panel(
                f"{r['contender']} (step {r['step_ms']:.0f} ms{pct})",
                [Sample(t, tx, rx) for t, tx, rx in window["samples"]],
                [(a, b) for a, b in window["phases"]],
            )
        )
    if not panels:
        return False
    nic = result.get("nic") or {}
    window_ms = nic.get("window_ms")
    where = f"{result['nodes']} x {result['per_node']} ranks, link {result.get('link') or 'unknown'}"
    title = f"NIC throughput of node 0, {result['model']}, {where}"
    window_s = window_ms / 1e3 if window_ms else None
    plot_throughput(panels, path, nic.get("link_bytes_per_s"), title=title, window_s=window_s)
    return True
