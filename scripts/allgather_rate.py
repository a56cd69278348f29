"""How fast gloo's all-gather moves data between the emulated nodes, one all-gather or in slices
(issue 31: why two ranks gather in slices, ``_gather`` in ``src/gradsync/collectives/primitives.py``).

Run one rank per node on the emulated cluster (root), e.g.::

    ../shared/testbed/cluster.sh up 2 200mbit
    ../shared/testbed/launch.sh 1 scripts/allgather_rate.py
    ../shared/testbed/cluster.sh down

For 0.25, 1 and 4 MB per rank it prints the time of one ``all_gather_into_tensor`` on the
inter-node group and the rate into each node, of an all-reduce of the gathered size, of four
concurrent all-gathers of quarter slices, and of a batched send/receive exchange; each the median
over 4 repetitions of the slowest rank's time. Measured here (2 nodes at 200 Mbit/s, 25 MB/s):
one all-gather 15.8-17.5 MB/s, four slices 21-27 MB/s; 4 nodes at 250 Mbit/s: one all-gather
23-29 MB/s, slices no faster.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from gradsync.collectives import Topology


def timed(fn: Callable[[], object], reps: int = 4) -> float:
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
    return statistics.median(times)


def measure(mb: float, group: dist.ProcessGroup, m: int, peers: list[int]) -> str:
    """One line of figures for ``mb`` MB per rank (see the module)."""
    n = int(mb * 2**20)
    x = torch.zeros(n, dtype=torch.uint8)
    out = torch.empty(n * m, dtype=torch.uint8)
    whole = timed(lambda: dist.all_gather_into_tensor(out, x, group=group))
    summed = torch.zeros(n * m // 4, dtype=torch.float32)
    reduce = timed(lambda: dist.all_reduce(summed, group=group))
    k = 4
    outs = [torch.empty(n // k * m, dtype=torch.uint8) for _ in range(k)]
    slices = [x[i * (n // k) : (i + 1) * (n // k)] for i in range(k)]

    def sliced() -> None:
        pairs = zip(outs, slices, strict=True)
        works = [dist.all_gather_into_tensor(o, s, group=group, async_op=True) for o, s in pairs]
        for w in works:
            w.wait()

    def exchange() -> None:
        ops = []
        for peer in peers:
            ops.append(dist.P2POp(dist.isend, x, peer, group=group))
            ops.append(dist.P2POp(dist.irecv, torch.empty_like(x), peer, group=group))
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    in_slices, p2p = timed(sliced), timed(exchange)
    into = (m - 1) * n
    return (
        f"{mb} MB per rank: all_gather {whole * 1e3:.1f} ms ({into / whole / 1e6:.1f} MB/s in), "
        f"all_reduce of {n * m / 1e6:.1f} MB {reduce * 1e3:.1f} ms, "
        f"4 slices {in_slices * 1e3:.1f} ms ({into / in_slices / 1e6:.1f} MB/s in), "
        f"send/receive {p2p * 1e3:.1f} ms"
    )


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    topo = Topology()
    group = topo.inter_group
    peers = [r for r in dist.get_process_group_ranks(group) if r != dist.get_rank()]
    for mb in (0.25, 1, 4):
        line = measure(mb, group, topo.nodes, peers)
        if topo.rank == 0:
            print(line, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
