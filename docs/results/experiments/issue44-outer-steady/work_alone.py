"""The outer loop's own work on one rank alone (a world of one: nothing crosses), VGG batch 16:
its ``step()`` timed by itself after every inner step, summed per period of 10 steps. The first
period holds the first meeting, which makes and first touches the outer optimizer's buffers."""

import copy
import statistics
import time

import torch

from gradsync.apps.models import build_model_for
from gradsync.collectives import Topology
from gradsync.observe.hook_costs import one_rank_world
from gradsync.observe.profiler import default_loss
from gradsync.outer import OuterLoop

torch.set_num_threads(1)
torch.manual_seed(0)
base = build_model_for("vgg", "classify", (3, 32, 32), 10)
x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
nbytes = 4 * sum(p.numel() for p in base.parameters())
streamed = {"every": 10, "codec": "terngrad:bits=4", "fragments": 4, "delay": 2}
with one_rank_world():
    topo = Topology()
    for opts in ({"every": 10, "codec": "terngrad:bits=4"}, streamed):
        model = copy.deepcopy(base)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        loop = OuterLoop(model, topology=topo, **opts)
        per = []
        for _ in range(60):
            default_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            loop.step()
            per.append(time.perf_counter() - t0)
        loop.close()
        periods = [sum(per[i : i + 10]) for i in range(0, 60, 10)]
        rate = statistics.median(periods[1:]) / nbytes
        print(opts, "work per period ms", [round(p * 1e3, 1) for p in periods], "s/B after the first", rate)
