"""How much longer an all-gather across the emulated nodes takes while each rank's cores are busy
(issue 31's call-delay experiment, README.md beside this file).

One rank per node on the emulated cluster (root)::

    ../shared/testbed/cluster.sh up 2 200mbit
    ../shared/testbed/launch.sh 1 docs/results/experiments/issue31-call-delay/contended_gather.py
    ../shared/testbed/cluster.sh down

For 84 kB, 335 kB and 1.34 MB per rank it prints the median over 8 all-gathers (in fixed slots,
as the engine gathers payloads) of the slowest rank's time: idle, with one thread per rank
multiplying matrices, and with a second one encoding (top-k at 1 %).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gradsync.codecs import build_codec
from gradsync.collectives import Topology
from gradsync.collectives import primitives as P


def busy_matmul(stop: threading.Event) -> None:
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    while not stop.is_set():
        a @ b


def busy_encode(stop: threading.Event) -> None:
    codec = build_codec("mstopk:density=0.01")
    x = torch.randn(4 << 20)
    while not stop.is_set():
        codec.encode(x)


def gather(topo: Topology, nbytes: int, reps: int = 8) -> float:
    data = torch.zeros(nbytes, dtype=torch.uint8)
    times = []
    for _ in range(reps):
        dist.barrier(group=topo.control_group)
        t0 = time.perf_counter()
        P.start_all_gather_fixed(data, nbytes, topo.world_group, "inter").wait()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=topo.control_group)
        times.append(float(dt))
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topo = Topology()
    conditions: list[tuple[str, list[Callable[[threading.Event], None]]]] = [
        ("alone", []), ("1 busy", [busy_matmul]), ("2 busy", [busy_matmul, busy_encode]),
    ]  # fmt: skip
    for nbytes in (84_000, 335_000, 1_340_000):
        out = []
        for name, work in conditions:
            stop = threading.Event()
            threads = [threading.Thread(target=f, args=(stop,), daemon=True) for f in work]
            for t in threads:
                t.start()
            time.sleep(0.05)
            dt = gather(topo, nbytes)
            stop.set()
            for t in threads:
                t.join()
            out.append(f"{name}: {dt * 1e3:.1f} ms {(topo.world - 1) * nbytes / dt / 1e6:.1f} MB/s")
        if topo.rank == 0:
            print(f"{nbytes / 1e3:.0f} kB per rank: " + "; ".join(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
