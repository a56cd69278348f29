"""The outer loop's own work on one rank alone (a world of one: nothing crosses), VGG batch 16:
its ``step()`` timed by itself after every inner step, summed per period of 10 steps, as ``bench
whatif`` measures it (``outer_work_periods``). The first period holds the first meetings, which
make and first touch the outer optimizer's buffers; ``bench whatif`` takes the median of the
others."""

import argparse
import statistics

import torch

from gradsync.apps.commands.bench import step as bench_step
from gradsync.apps.commands.bench.support.own_work import outer_work_periods
from gradsync.collectives import Topology
from gradsync.observe.hook_costs import one_rank_world

args = argparse.Namespace(model="vgg", batch_size=16, image_size=32, classes=10, optimizer="sgd", threads=1)
torch.set_num_threads(1)
torch.manual_seed(0)
base = bench_step.bench_model(args)
x, y = bench_step.bench_batch(args, torch.Generator().manual_seed(0))
nbytes = 4 * sum(p.numel() for p in base.parameters())
with one_rank_world():
    for name in (
        "outer@every=10@codec=terngrad:bits=4",
        "outer@every=10@codec=terngrad:bits=4@fragments=4@delay=2",
    ):
        periods = outer_work_periods(name, base, x, y, args, Topology())
        rate = statistics.median(periods[1:]) / nbytes
        print(name, "work per period ms", [round(p * 1e3, 1) for p in periods], "s/B after the first", rate)
