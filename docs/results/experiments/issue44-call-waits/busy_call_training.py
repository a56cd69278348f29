"""One rank of the call-wait probe (``run_calls.sh`` starts it on every node of an emulated
cluster): small world collectives over the shaped cables with the rank idle, beside its own
training loop (VGG, batch 16, forward, backward and SGD step in a thread, as a training rank's
collectives run beside its backward pass; the ranks' loops are not aligned, as in a real run),
and beside the training loop and one more thread of matrix products (an encode). The calls are
issued from the main thread with a fixed pause between them, so the thread that runs them sleeps
and wakes as an engine's communication thread does. Rank 0 prints, per round and case, the
ranks' mean of the per-call mean and median (ms) and the mean minus the idle mean."""

import datetime
import statistics
import sys
import threading
import time

import torch
import torch.distributed as dist

from gradsync.apps.models import build_model_for
from gradsync.observe.profiler import default_loss

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
CALLS = int(sys.argv[1]) if len(sys.argv) > 1 else 61
PAUSE = float(sys.argv[2]) / 1e3 if len(sys.argv) > 2 else 0.005
torch.manual_seed(0)
model = build_model_for("vgg", "classify", (3, 32, 32), 10)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def calls(kind: str, nbytes: int = 16 << 10) -> list[float]:
    t = torch.ones(nbytes // 4)
    outs = [torch.empty_like(t) for _ in range(world)]
    dist.barrier()
    res = []
    for _ in range(CALLS):
        time.sleep(PAUSE)
        t0 = time.perf_counter()
        if kind == "ag":
            dist.all_gather(outs, t)
        else:
            dist.all_reduce(t)
        res.append(time.perf_counter() - t0)
    return res


stop = threading.Event()


def train() -> None:
    while not stop.is_set():
        default_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def burn() -> None:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    while not stop.is_set():
        torch.mm(a, b)


def case(name: str, threads: list, kind: str) -> tuple[float, float]:
    stop.clear()
    workers = [threading.Thread(target=f, daemon=True) for f in threads]
    for w in workers:
        w.start()
    time.sleep(0.3 if workers else 0.0)
    res = calls(kind)
    stop.set()
    for w in workers:
        w.join()
    both = torch.tensor([statistics.mean(res), statistics.median(res)], dtype=torch.float64)
    dist.all_reduce(both)
    both /= world
    return float(both[0]) * 1e3, float(both[1]) * 1e3


calls("ag")  # connections set up
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 3):
    for kind in ("ag", "ar"):
        idle = case("idle", [], kind)
        out = {
            "idle": idle,
            "train": case("train", [train], kind),
            "train+burn": case("tb", [train, burn], kind),
        }
        if rank == 0:
            for k, (mean, med) in out.items():
                print(
                    f"round {r} {kind} 16K {k:11s} mean {mean:7.2f} median {med:7.2f} "
                    f"mean-idle {mean - idle[0]:7.2f}",
                    flush=True,
                )
dist.destroy_process_group()
