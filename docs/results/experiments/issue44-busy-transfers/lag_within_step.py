"""How far the slowest of four ranks on a 2-core host falls behind the ranks' mean within one VGG
step (batch 16, 32 x 32 images), every step started by a barrier: each rank's clock at the end of
the forward pass, at the ready time of every 4th parameter's gradient, at the end of the backward
pass and of the optimizer, gathered (``time.perf_counter`` is one clock for every process of the
host). ``mid``: barriers after the forward and the backward pass as well, where a synchronized step
meets. Run with ``torchrun --standalone --nproc-per-node 4 lag_within_step.py STEPS none|mid``;
rank 0 prints, per point, the ranks' mean time from the mean start and the slowest rank's lag
behind the mean (median and quartiles over the steps, ms)."""

import statistics
import sys
import time

import torch
import torch.distributed as dist

from gradsync.apps.models import build_model_for
from gradsync.observe.profiler import default_loss

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = build_model_for("vgg", "classify", (3, 32, 32), 10)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
marks: list[tuple[str, float]] = []


def mark(name: str) -> None:
    marks.append((name, time.perf_counter()))


for i, p in enumerate(reversed(list(model.parameters()))):
    if i % 4 == 0:
        p.register_hook(lambda grad, i=i: mark(f"bwd{i}"))
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 12
meet = len(sys.argv) > 2 and sys.argv[2] == "mid"
rows = []
for s in range(steps + 2):
    dist.barrier()
    marks.clear()
    mark("start")
    out = model(x)
    mark("fwd")
    if meet:
        dist.barrier()
        mark("fwdB")
    default_loss(out, y).backward()
    mark("bwd")
    if meet:
        dist.barrier()
        mark("bwdB")
    opt.step()
    opt.zero_grad(set_to_none=True)
    mark("opt")
    v = torch.tensor([t for _, t in marks], dtype=torch.float64)
    every = [torch.zeros_like(v) for _ in range(world)]
    dist.all_gather(every, v)
    if s >= 2:  # two warm-up steps
        rows.append(torch.stack(every))
if rank == 0:
    a = torch.stack(rows)  # steps x ranks x points
    rel = (a - a[:, :, :1].mean(1, keepdim=True)) * 1e3
    for j, (name, _) in enumerate(marks):
        mean, lag = rel[:, :, j].mean(1), rel[:, :, j].max(1).values - rel[:, :, j].mean(1)
        q1, q3 = float(lag.quantile(0.25)), float(lag.quantile(0.75))
        print(
            f"{name:8s} mean {statistics.median(mean.tolist()):7.1f} ms  lag med "
            f"{statistics.median(lag.tolist()):5.1f}  p25 {q1:5.1f} p75 {q3:5.1f}"
        )
dist.destroy_process_group()
