"""Start a gradsync command on every node of the emulated cluster: one torchrun per node (static
rendezvous at node 0's address), each inside its node's namespace with gloo bound to the node's
cable (``GLOO_SOCKET_IFNAME=eth0``) and the link rate in ``TB_RATE`` for the benchmarks' reports.

The wait is bounded; on a timeout, Ctrl-C or SIGTERM every node's process group is terminated
(then killed), and :func:`run_on_cluster` always takes the cluster down again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from gradsync.apps.cluster.netns import ClusterError, ClusterState, down, node_address, node_name, up


def node_command(i: int, nodes: int, per_node: int, port: int, argv: list[str]) -> list[str]:
    """The command that starts node ``i``'s ranks."""
    return [
        "ip",
        "netns",
        "exec",
        node_name(i),
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={per_node}",
        f"--node-rank={i}",
        f"--master-addr={node_address(0)}",
        f"--master-port={port}",
        "-m",
        "gradsync",
        *argv,
    ]


def node_environment(rate: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TB_RATE=rate)
    return env


@contextmanager
def _terminate_on_signal() -> Iterator[None]:
    """SIGTERM behaves like Ctrl-C here, so the clean-up in ``finally`` blocks runs."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
        end = time.monotonic() + grace_s
        while any(p.poll() is None for p in live) and time.monotonic() < end:
            time.sleep(0.1)


def launch(per_node: int, argv: list[str], timeout_s: float, port: int = 29500) -> int:
    """Run ``gradsync ARGV`` with ``per_node`` ranks on every node of the cluster that is up;
    returns the first non-zero exit status (124 on timeout)."""
    if per_node < 1:
        raise ValueError(f"--per-node must be at least 1, got {per_node}")
    if not argv:
        raise ValueError("no gradsync command given (e.g. -- bench step --model vgg)")
    state = ClusterState.load()
    if state is None:
        raise ClusterError("no emulated cluster is up (gradsync cluster up --nodes 2 --rate 100mbit)")
    env = node_environment(state.rate)
    procs: list[subprocess.Popen[bytes]] = []
    with _terminate_on_signal():
        try:
            for i in range(state.nodes):
                cmd = node_command(i, state.nodes, per_node, port, argv)
                procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            end = time.monotonic() + timeout_s
            while any(p.poll() is None for p in procs):
                if time.monotonic() > end:
                    print(
                        f"gradsync cluster: timeout after {timeout_s:g} s, stopping every node",
                        file=sys.stderr,
                    )
                    _stop(procs)
                    return 124
                if any(p.returncode not in (None, 0) for p in procs):
                    break  # one node failed: the others would wait for it until their timeout
                time.sleep(0.2)
        finally:
            _stop(procs)
    codes = [p.returncode for p in procs]
    return next((c for c in codes if c != 0), 0)


def run_on_cluster(
    nodes: int,
    per_node: int,
    rate: str,
    argv: list[str],
    timeout_s: float,
    port: int,
    storage_rate: str | None = None,
) -> int:
    """Bring the cluster up (with the storage node when ``storage_rate`` is given), run the
    command on it, and always take it down again."""
    if per_node < 1:
        raise ValueError(f"--per-node must be at least 1, got {per_node}")
    with _terminate_on_signal():
        up(nodes, rate, storage_rate)
        try:
            return launch(per_node, argv, timeout_s, port)
        finally:
            down()
