"""What every distributed benchmark needs: joining the world it was launched in, the link rate
of the emulated cluster, and the bytes that really left a node (read from its NIC)."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import sys

import torch
import torch.distributed as dist

from gradsync.apps.command_line import passed_down
from gradsync.apps.process_group import init_default_group
from gradsync.collectives import Topology
from gradsync.units import parse_rate


def join_world(timeout_s: float, nodes: int | None, per_node: int | None) -> Topology:
    """Initialize the default process group from torchrun's (or launch.sh's) environment and
    return the topology (imposed by ``nodes`` x ``per_node``, else torchrun's)."""
    if (nodes is None) != (per_node is None):
        raise ValueError("--nodes and --per-node go together")
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            raise ValueError("launch with torchrun or launch.sh (RANK, WORLD_SIZE, MASTER_ADDR are not set)")
        init_default_group(datetime.timedelta(seconds=timeout_s))
    return Topology(nodes, per_node) if nodes else Topology()


def add_world_arguments(p: argparse.ArgumentParser, timeout_s: float) -> None:
    """The options every distributed benchmark has: an imposed topology, threads, the timeout."""
    p.add_argument("--nodes", type=int, help="impose a topology (with --per-node) instead of torchrun's")
    p.add_argument("--per-node", type=int)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--timeout", type=float, default=timeout_s, help="process-group timeout in seconds")


def max_over_ranks(values: list[float]) -> list[float]:
    """Each value's maximum over the ranks (the slowest rank's times)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def slowest_and_mean(values: list[float]) -> tuple[list[float], list[float]]:
    """Each value's maximum over the ranks (the slowest rank's times) and its mean over them, from
    one all-gather."""
    mine = torch.tensor(values, dtype=torch.float64)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    stacked = torch.stack(every)
    return stacked.max(dim=0).values.tolist(), stacked.mean(dim=0).tolist()


def link_bytes_per_s(rate: str | None) -> float | None:
    """The testbed's shaped rate (``100mbit``) in bytes/s, through the one rate parser
    (:func:`gradsync.units.parse_rate`); None for an unset or unreadable one (an unshaped link)."""
    if not rate:
        return None
    try:
        return parse_rate(rate.strip(), "TB_RATE", tc_units=True)
    except ValueError:
        return None


def nic_tx_bytes() -> int | None:
    """Bytes sent so far by the interface gloo uses (``GLOO_SOCKET_IFNAME``), if it is a real NIC."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME", "")
    path = f"/sys/class/net/{ifname}/statistics/tx_bytes"
    if not ifname or ifname == "lo" or not os.path.exists(path):
        return None
    with open(path) as fh:
        return int(fh.read())


class CableMeter:
    """Bytes per operation that left each node, averaged over the nodes (None off the testbed).

    Every rank must call :meth:`start` and :meth:`stop` (``stop`` all-reduces)."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self._start: int | None = None

    def start(self) -> None:
        self._start = nic_tx_bytes() if self.topo.local_rank == 0 else None

    def stop(self, operations: int) -> float | None:
        end = nic_tx_bytes() if self.topo.local_rank == 0 else None
        have, sent = False, 0.0
        if self.topo.local_rank == 0 and self._start is not None and end is not None:
            have, sent = True, (end - self._start) / max(operations, 1)
        t = torch.tensor([sent, float(have)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return float(t[0]) / self.topo.nodes if int(t[1]) == self.topo.nodes else None


_EMULATE = re.compile(r"^(\d+)x(\d+)$")


def emulated_shape(text: str) -> tuple[int, int]:
    """``--emulate NODESxPER_NODE`` as two counts."""
    m = _EMULATE.match(text)
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"--emulate takes NODESxPER_NODE, e.g. 2x2, got {text!r}")
    return int(m.group(1)), int(m.group(2))


def without_emulation(argv: list[str]) -> list[str]:
    """The command line without its --emulate and --link options (and their values)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--emulate", "--link"):
            skip = True
        elif not a.startswith(("--emulate=", "--link=")):
            out.append(a)
    return out


def run_emulated(args: argparse.Namespace, command: str) -> int | None:
    """With ``--emulate`` outside a launched world: bring the emulated cluster up, run this same
    command line on it without ``--emulate``/``--link``, take it down, and return the exit status;
    None when the command should run here."""
    if not args.emulate or "RANK" in os.environ:
        return None
    from gradsync.apps.cluster.launch import run_on_cluster
    from gradsync.apps.cluster.netns import ClusterError

    nodes, per_node = emulated_shape(args.emulate)
    full = list(getattr(args, "argv", None) or sys.argv[1:])
    argv = without_emulation(full)
    try:
        with passed_down(full):  # the nodes' processes record the command as typed, --emulate included
            return run_on_cluster(nodes, per_node, args.link, argv, args.timeout, 29500)
    except ClusterError as e:
        print(f"gradsync {command}: cannot emulate a cluster here: {e}", file=sys.stderr)
        return 1


def check_world_options(args: argparse.Namespace) -> None:
    """The options of a benchmark that runs on a launched or emulated world: ``--timeout``,
    ``--nodes``/``--per-node``, ``--emulate``/``--link`` (ValueError naming the option)."""
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout!r}")
    if (args.nodes is None) != (args.per_node is None):
        raise ValueError("--nodes and --per-node go together")
    for name in ("nodes", "per_node"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.emulate and "RANK" not in os.environ:
        emulated_shape(args.emulate)
        parse_rate(args.link, "--link", tc_units=True)
