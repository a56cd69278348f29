"""``gradsync cluster``: an emulated multi-node cluster on one machine (network namespaces with
shaped cables, :mod:`gradsync.apps.cluster`) and a launcher that runs a gradsync command on every
emulated node."""

from __future__ import annotations

import argparse
import sys

from gradsync.apps.cluster.launch import launch, run_on_cluster
from gradsync.apps.cluster.netns import ClusterError, check_rate, down, status, up
from gradsync.apps.cluster.netns import check as check_machine

_STORAGE_HELP = (
    "also a storage node gs-st (10.78.0.250) whose cable runs at this rate (100mbit, none): "
    "serve files from it with gradsync.apps.cluster.storage"
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


def _command(args: argparse.Namespace) -> list[str]:
    argv = list(args.command)
    return argv[1:] if argv[:1] == ["--"] else argv


def check(args: argparse.Namespace) -> None:
    """The counts, the rates and the command, before any namespace is made."""
    nodes = getattr(args, "nodes", None)
    if nodes is not None and not 1 <= nodes <= 64:
        raise ValueError(f"--nodes must be an integer from 1 to 64, got {nodes}")
    if getattr(args, "rate", None) is not None:
        check_rate(args.rate, "--rate")
    if getattr(args, "storage_link", None) is not None:
        check_rate(args.storage_link, "--storage-link")
    if args.action in ("launch", "run"):
        if args.per_node < 1:
            raise ValueError(f"--per-node must be at least 1, got {args.per_node}")
        if not _command(args):
            raise ValueError("no gradsync command given (e.g. -- bench step --model vgg)")


def main(args: argparse.Namespace) -> int:
    try:
        if args.action == "check":
            ok, why = check_machine()
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
        argv = _command(args)
        if args.action == "launch":
            return launch(args.per_node, argv, args.timeout, args.port)
        return run_on_cluster(
            args.nodes, args.per_node, args.rate, argv, args.timeout, args.port, args.storage_link
        )
    except ClusterError as e:
        print(f"gradsync cluster: error: {e}", file=sys.stderr)
        return 1
