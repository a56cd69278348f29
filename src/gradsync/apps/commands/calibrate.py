"""``gradsync calibrate`` (under torchrun or ``gradsync cluster launch``): measures the running
cluster's links (latency and rate within and across nodes, the local add rate) and writes the
``gradsync.links/1`` file that ``gradsync whatif --links`` reads."""

from __future__ import annotations

import argparse

from gradsync.apps.command_line import command_line
from gradsync.apps.commands.bench.support.world import add_world_arguments, check_world_options, run_emulated


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--out", required=True, metavar="PATH.json", help="where to write the gradsync.links/1 file"
    )
    p.add_argument("--reps", type=int, default=5, help="timed repetitions per size (default 5)")
    p.add_argument(
        "--emulate", metavar="NODESxPER_NODE", help="run on an emulated cluster of this shape (root)"
    )
    p.add_argument("--link", default="100mbit", help="the emulated cluster's cable rate (with --emulate)")
    add_world_arguments(p, timeout_s=300.0)


def check(args: argparse.Namespace) -> None:
    if args.reps < 1:
        raise ValueError(f"--reps must be at least 1, got {args.reps}")
    check_world_options(args)


def main(args: argparse.Namespace) -> int:
    import json

    import torch.distributed as dist

    from gradsync.apps.commands.bench.support.world import join_world
    from gradsync.collectives.cost import calibrate
    from gradsync.whatif.network import links_document

    status = run_emulated(args, "calibrate")
    if status is not None:
        return status
    owned = not dist.is_initialized()
    topo = join_world(args.timeout, args.nodes, args.per_node)
    params = calibrate(topo, reps=args.reps)
    if topo.rank == 0:
        doc = links_document(params, topo.nodes, topo.per_node, command_line(args))
        with open(args.out, "w") as fh:
            json.dump(doc, fh, indent=1)

        def rate(per_byte: float, unit: float) -> float:
            return 1 / per_byte / unit if per_byte else float("inf")

        i, o = params.intra, params.inter
        print(f"intra: alpha {i.alpha * 1e6:.1f} us, {rate(i.beta, 1e6):.1f} MB/s; "
              f"inter: alpha {o.alpha * 1e6:.1f} us, {rate(o.beta, 1e6):.1f} MB/s; "
              f"add {rate(params.gamma, 1e9):.2f} GB/s -> {args.out}")  # fmt: skip
    if owned and dist.is_initialized():
        dist.destroy_process_group()
    return 0
