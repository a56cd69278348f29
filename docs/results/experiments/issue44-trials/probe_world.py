"""What the probes of this folder share: joining the gloo group torchrun set up, the model and
batch every rank trains on (VGG, batch 16, one batch per rank drawn from its rank), the slowest
rank's reading of a few numbers, and a plan's codecs in one line."""

import datetime

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.apps.models import build_model_for


def join() -> tuple[int, nn.Module, torch.Tensor, torch.Tensor]:
    """This rank, the model every contender starts from (copy it), and this rank's batch."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = build_model_for("vgg", "classify", (3, 32, 32), 10)
    g = torch.Generator().manual_seed(rank)
    return rank, base, torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)


def slowest(*v: float) -> list[float]:
    """Each value's maximum over the ranks."""
    t = torch.tensor(v, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def plan_codecs(synced: gradsync.GradSync) -> str:
    """The codec of each compressed bucket of the plan in place, in order ("-" before the first
    plan); ``+ef`` and the options left out."""
    e = synced.engine
    if e.plan is None:
        return "-"
    names = [e.codecs[b.codec_id].spec().split(":")[0] for b in e.plan.buckets if b.compress]
    return ",".join(n.split("+")[0] for n in names)
