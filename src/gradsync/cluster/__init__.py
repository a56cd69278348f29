"""``gradsync cluster``: an emulated multi-node cluster on one machine (network namespaces with
shaped cables) and a launcher that runs a gradsync command on every emulated node."""

from __future__ import annotations

import argparse
import sys

from gradsync.cluster.launch import launch, run_on_cluster
from gradsync.cluster.netns import ClusterError, check, down, status, up

__all__ = [
    "ClusterError",
    "add_arguments",
    "check",
    "down",
    "launch",
    "main",
    "run_on_cluster",
    "up",
]


_STORAGE_HELP = (
    "also a storage node gs-st (10.78.0.250) whose cable runs at this rate (100mbit, none): "
    "serve files from it with gradsync.cluster.storage"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    sub.add_parser("check", help="can this machine run the emulated cluster? (root, netns, veth, htb)")
    q = sub.add_parser("up", help="create NODES network-namespace nodes with cables shaped to RATE")
    q.add_argument("--nodes", type=int, default=2)
    q.add_argument("--rate", default="100mbit", help="per node cable, both directions: 100mbit, 1gbit, none")
    q.add_argument("--storage-link", default=None, help=_STORAGE_HELP)
    sub.add_parser("down", help="remove the emulated cluster")
    sub.add_parser("status", help="nodes, rate and bytes sent per node")
    for name, text in (
        ("launch", "run a gradsync command on every node of the cluster that is up"),
        ("run", "up, run a gradsync command on every node, down (always)"),
    ):
        q = sub.add_parser(name, help=text)
        if name == "run":
            q.add_argument("--nodes", type=int, default=2)
            q.add_argument("--rate", default="100mbit")
            q.add_argument("--storage-link", default=None, help=_STORAGE_HELP)
        q.add_argument("--per-node", type=int, default=2, help="ranks per node")
        q.add_argument(
            "--timeout", type=float, default=1800.0, help="stop every rank after this many seconds"
        )
        q.add_argument(
            "--port", type=int, default=29500, help="rendezvous port on node 0 (inside its namespace)"
        )
        q.add_argument(
            "command", nargs=argparse.REMAINDER, help="-- then the gradsync command and its options"
        )


def main(args: argparse.Namespace) -> int:
    try:
        if args.action == "check":
            ok, why = check()
            print(f"gradsync cluster: {why}")
            return 0 if ok else 1
        if args.action == "up":
            state = up(args.nodes, args.rate, args.storage_link)
            storage = "" if state.storage_rate is None else f", storage node at {state.storage_rate}"
            print(f"gradsync cluster: {state.nodes} nodes up, cables at {state.rate}{storage}")
            return 0
        if args.action == "down":
            print(f"gradsync cluster: removed {down()} namespaces")
            return 0
        if args.action == "status":
            print(status())
            return 0
        argv = list(args.command)
        if argv[:1] == ["--"]:
            argv = argv[1:]
        if args.action == "launch":
            return launch(args.per_node, argv, args.timeout, args.port)
        return run_on_cluster(
            args.nodes, args.per_node, args.rate, argv, args.timeout, args.port, args.storage_link
        )
    except ClusterError as e:
        print(f"gradsync cluster: error: {e}", file=sys.stderr)
        return 1
