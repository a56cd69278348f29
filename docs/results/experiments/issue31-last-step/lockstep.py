"""How far the slowest rank falls behind the mean when all start a plain training step together.

VGG (batch 16, 32 x 32 images, one thread per rank), 20 measured steps: a barrier, forward,
backward and SGD step, each rank's time gathered. Run on this machine without the emulated
network (only the cores are shared):

    torchrun --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint localhost:0 lockstep.py
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from gradsync.apps.models import build_model_for


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_model_for("vgg", "classify", (3, 32, 32), 10)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(16, 3, 32, 32, generator=g)
    y = torch.randint(0, 10, (16,), generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    rows = []
    for i in range(23):
        dist.barrier()
        t0 = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mine = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(every, mine)
        if i >= 3:
            rows.append([float(t) for t in every])
    if rank == 0:
        mean = statistics.median(statistics.mean(r) for r in rows)
        slowest = statistics.median(max(r) for r in rows)
        ratio = slowest / mean
        print(f"{world} ranks: mean {mean * 1e3:.1f} ms, slowest {slowest * 1e3:.1f} ms ({ratio:.3f}x)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
