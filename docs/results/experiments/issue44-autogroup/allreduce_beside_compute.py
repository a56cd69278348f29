"""One rank of the probe (run.sh starts it on every node): small gloo all-reduces timed with the
rank idle, then beside one thread of matrix products in the same process, as a training rank's
gloo threads run beside its own compute. Rank 0 prints one JSON line: per size and state, the
all-reduce's milliseconds (each after a barrier)."""

import datetime
import json
import statistics
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

REPS = 30
SIZES = (24 << 10, 96 << 10)  # bytes: a bias bucket's and a PowerSGD factor's all-reduce

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))


def timed(nbytes: int) -> list[float]:
    x = torch.ones(nbytes // 4)
    out = []
    for _ in range(REPS):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        out.append((time.perf_counter() - t0) * 1e3)
        time.sleep(0.002)
    return out


stop = threading.Event()


def compute() -> None:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    while not stop.is_set():
        a @ b


result = {f"idle {n}": timed(n) for n in SIZES}
worker = threading.Thread(target=compute)
worker.start()
time.sleep(0.2)
result |= {f"beside compute {n}": timed(n) for n in SIZES}
stop.set()
worker.join()
if dist.get_rank() == 0:
    summary = {k: {"median_ms": statistics.median(v), "max_ms": max(v)} for k, v in result.items()}
    switch = Path("/proc/sys/kernel/sched_autogroup_enabled").read_text().strip()
    print(json.dumps({"autogroup": switch, "summary": summary, "ms": result}))
dist.destroy_process_group()
