"""What one more synchronization point costs a step on an oversubscribed host: VGG (batch 16)
training steps on every rank, each started by a barrier, with and without a second barrier
between the backward pass and the optimizer (interleaved in blocks of 4 steps). Prints the
slowest rank's (the step as ``bench`` counts it) and the ranks' mean times of the step, of
forward + backward and of the optimizer.

    torchrun --standalone --nproc-per-node 4 sync_lag.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from gradsync.apps.commands.bench import step as bench_step
from gradsync.apps.commands.bench import train as bench_train
from gradsync.observe.profiler import default_loss


def main() -> None:
    parser = argparse.ArgumentParser()
    bench_train.add_arguments(parser)
    args = parser.parse_args(["--model", "vgg", "--batch-size", "16"])
    topo, model, x, y = bench_step.join_with_batch(args)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def step(barrier_before_optimizer: bool) -> list[float]:
        dist.barrier()
        t0 = time.perf_counter()
        default_loss(model(x), y).backward()
        t1 = time.perf_counter()
        if barrier_before_optimizer:
            dist.barrier()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        times = [t3 - t0, t1 - t0, t3 - t2]
        slowest = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        mean = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(mean)
        return [1e3 * float(v) for v in slowest] + [1e3 * float(v) / topo.world for v in mean]

    for _ in range(3):
        step(False)
    samples: dict[bool, list[list[float]]] = {False: [], True: []}
    for _ in range(8):
        for mid in (False, True):
            samples[mid] += [step(mid) for _ in range(4)]
    if topo.rank == 0:
        for mid in (False, True):
            m = [statistics.median(c) for c in zip(*samples[mid], strict=True)]
            print(f"barrier before the optimizer: {mid!s:5s} slowest rank: step {m[0]:.1f}, forward + "
                  f"backward {m[1]:.1f}, optimizer {m[2]:.1f} ms | ranks' mean: step {m[3]:.1f}, "
                  f"forward + backward {m[4]:.1f}, optimizer {m[5]:.1f} ms")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
