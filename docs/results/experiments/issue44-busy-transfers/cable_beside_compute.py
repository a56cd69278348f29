"""One rank of the cable probe (``run.sh`` starts it on every node of an emulated 4 x 1 cluster):
world all-reduces and all-gathers over the shaped cables, with the rank idle and then beside one
thread of matrix products in its own process, as a training rank's collectives run beside its
backward pass. Rank 0 prints, per round, size and state, the slowest rank's milliseconds over
9 calls (each after a barrier)."""

import datetime
import statistics
import threading
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
world = dist.get_world_size()
REPS = 9
CASES = (("ar", 64 << 10), ("ar", 1 << 20), ("ar", 8 << 20), ("ag", 256 << 10), ("ag", 2 << 20))


def timed(kind: str, nbytes: int) -> list[float]:
    x = torch.ones(nbytes // 4)
    outs = [torch.empty_like(x) for _ in range(world)]
    res = []
    for _ in range(REPS):
        dist.barrier()
        time.sleep(0.01)
        t0 = time.perf_counter()
        if kind == "ar":
            dist.all_reduce(x)
        else:
            dist.all_gather(outs, x)
        dt = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        res.append(float(dt) * 1e3)
    return res


stop = threading.Event()


def compute() -> None:
    a, b = torch.randn(384, 384), torch.randn(384, 384)
    while not stop.is_set():
        torch.mm(a, b)


for r in range(2):
    out = {f"idle {kind} {n >> 10}K": timed(kind, n) for kind, n in CASES}
    stop.clear()
    worker = threading.Thread(target=compute)
    worker.start()
    time.sleep(0.2)
    out |= {f"busy {kind} {n >> 10}K": timed(kind, n) for kind, n in CASES}
    stop.set()
    worker.join()
    if dist.get_rank() == 0:
        for k, v in out.items():
            print(
                f"round {r} {k:18s} median {statistics.median(v):7.1f} mean {statistics.mean(v):7.1f} "
                f"min {min(v):7.1f} max {max(v):7.1f}",
                flush=True,
            )
dist.destroy_process_group()
