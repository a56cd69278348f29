"""A node-internal all-reduce (two ranks through the loopback, gloo) on a host whose cores four
ranks share: alone, beside the other node's, and beside threads of matrix products in the other
node's ranks or in every rank. Run with ``torchrun --standalone --nproc-per-node 4``; rank 0 prints
one line per round (milliseconds: the slowest rank's, median of 7)."""

import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
mine = nodes[rank // 2]
numel = int(sys.argv[1]) if len(sys.argv) > 1 else (24 << 20) // 4
buf = torch.ones(numel)
dist.all_reduce(buf, group=mine)  # connections set up
stop = threading.Event()


def spin() -> None:
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    while not stop.is_set():
        torch.mm(a, b)


def case(reducing: set[int], computing: set[int], reps: int = 7) -> float:
    """Median of the slowest rank's all-reduce, nodes ``reducing`` at once, ranks ``computing``
    running one thread of matrix products each."""
    times = []
    for _ in range(reps):
        stop.clear()
        thread = threading.Thread(target=spin) if rank in computing else None
        if thread:
            thread.start()
        dist.barrier()
        time.sleep(0.02)
        t0 = time.perf_counter()
        if rank // 2 in reducing:
            dist.all_reduce(buf, group=mine)
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        stop.set()
        if thread:
            thread.join()
        times.append(float(dt))
    return statistics.median(times) * 1e3


def products(ranks: set[int]) -> float:
    """The slowest rank's 200 matrix products, ``ranks`` at once (the host's share of cores)."""
    dist.barrier()
    t0 = time.perf_counter()
    if rank in ranks:
        a, b = torch.randn(384, 384), torch.randn(384, 384)
        for _ in range(200):
            torch.mm(a, b)
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return float(dt) * 1e3


everyone = {0, 1, 2, 3}
for r in range(2):
    out = {
        "products alone": products({0}),
        "products x4": products(everyone),
        "copy alone": case({0}, set()),
        "copy, both nodes": case({0, 1}, set()),
        "copy beside node 1's compute": case({0}, {2, 3}),
        "copy beside every rank's compute": case({0}, everyone),
        "copy, both nodes, every rank computing": case({0, 1}, everyone),
    }
    if rank == 0:
        size = numel * 4 / 2**20
        print(f"round {r}: {size:.0f} MiB  " + "  ".join(f"{k} {v:.1f}" for k, v in out.items()), flush=True)
dist.destroy_process_group()
