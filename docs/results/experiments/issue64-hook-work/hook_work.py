"""Issue 64: two ways of timing PyTorch's PowerSGD hook's own work on one rank, side by side.

``difference``: the way ``gradsync.observe.hook_costs.powersgd_hook_rate`` worked until issue 64
(DDP with and without the hook in alternating passes of 4 steps, the median over 5 passes of each
pass's difference of median steps, clamped at 0), written out here. ``direct``: the way it works
now (each call of the hook from its start to its future's completion, the median over 12 steps).
Both on a process group of this one rank, the whole model in one bucket (as ``bench whatif``
runs the hook on gloo), rank 1.

    python docs/results/experiments/issue64-hook-work/hook_work.py resnet 8 5
    python docs/results/experiments/issue64-hook-work/hook_work.py vgg-small 16 5
    python docs/results/experiments/issue64-hook-work/hook_work.py vgg 16 3
"""

import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.apps.models import build_model_for
from gradsync.observe.hook_costs import cross_entropy_of, gradient_bytes, one_rank_world, powersgd_hook_rate


def steps(model: torch.nn.Module, loss_of: Callable[[torch.nn.Module], torch.Tensor], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        loss_of(model).backward()
        out.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return out


def difference(
    base: torch.nn.Module,
    loss_of: Callable[[torch.nn.Module], torch.Tensor],
    bucket_mb: float,
    passes: int = 5,
) -> float:
    alone = dist.new_group([0], use_local_synchronization=True)
    kw = {"find_unused_parameters": True, "bucket_cap_mb": bucket_mb}
    plain = DDP(copy.deepcopy(base), process_group=alone, **kw)
    hooked = DDP(copy.deepcopy(base), process_group=alone, **kw)
    state = psgd.PowerSGDState(process_group=alone, matrix_approximation_rank=1, start_powerSGD_iter=2)
    hooked.register_comm_hook(state, psgd.powerSGD_hook)
    steps(plain, loss_of, 3)
    steps(hooked, loss_of, 3)
    diffs = []
    for _ in range(passes):
        without = steps(plain, loss_of, 4)
        with_hook = steps(hooked, loss_of, 4)
        diffs.append(statistics.median(with_hook) - statistics.median(without))
    return max(statistics.median(diffs), 0.0)


def main() -> None:
    name, batch, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = build_model_for(name, "classify", (3, 32, 32), 10)
    x, y = torch.randn(batch, 3, 32, 32), torch.randint(0, 10, (batch,))
    loss_of = cross_entropy_of(x, y)
    nbytes = gradient_bytes(base)
    bucket_mb = nbytes / 2**20 + 1
    with one_rank_world():
        for _ in range(reps):
            t0 = time.perf_counter()
            diff = difference(base, loss_of, bucket_mb)
            t1 = time.perf_counter()
            direct = powersgd_hook_rate(base, loss_of, 1, bucket_mb) * nbytes
            t2 = time.perf_counter()
            print(
                f"{name} batch {batch}: difference {diff * 1e3:7.2f} ms ({t1 - t0:4.1f} s)   "
                f"direct {direct * 1e3:7.2f} ms ({t2 - t1:4.1f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
