"""Digests of every gradient and parameter of a set of short runs, to show a refactor of the sync
engine changes no result: run it before and after the change and compare the folders.

    python scripts/gradient_digests.py /tmp/before      # on the commit before the change
    python scripts/gradient_digests.py /tmp/after       # on the change
    diff <(grep -v ^plan /tmp/before/rank0.txt) <(grep -v ^plan /tmp/after/rank0.txt)

A world of 4 gloo ranks on loopback (2 nodes x 2, a FileStore, as the tests start them) runs 16
configurations of ``gradsync.wrap`` (every strategy, error feedback with momentum correction,
clipping, unused parameters, dense_from_step, a density schedule, a large-tensor codec,
zero-copy buckets), 3 of the DDP comm hook, 3 of FSDP2 (``compress_fsdp`` on the shard,
the replicate and both dimensions, a parameter frozen for two steps) and 4 of the outer loop
(DDP or gradsync.wrap inside the nodes; dense, compressed, streamed, SparseLoCo's codec), 7 to 9
steps each with an SGD update, and writes
one line per gradient per step (a SHA-1 of its bytes) and per final parameter. The plans are
fixed (``plan="compress"``, one partition unless a configuration says, no fusion timeout), so
the only lines that may differ are the
``plan`` lines' predicted times. Used for issue 31's engine split: identical on every rank.
"""

from __future__ import annotations

import hashlib
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync.collectives import Topology
from worlds import run_world


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(40, 96)
        self.b = nn.Linear(96, 80)
        self.side = nn.Linear(96, 80)
        self.c = nn.Linear(80, 10)

    def forward(self, x: torch.Tensor, side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        h2 = torch.relu(self.b(h))
        if side:
            h2 = h2 + self.side(h)
        return self.c(h2)


WRAP = [
    ("hitopk", "hitopk:density=0.05", {"partitions": 2}),
    ("topk", "allgather/topk:density=0.05+ef", {}),
    ("mstopk", "allgather/mstopk:density=0.05", {}),
    ("ring-onebit", "ring+local/onebit", {}),
    ("ps-terngrad", "ps/terngrad", {}),
    ("powersgd", "powersgd:rank=2", {}),
    ("dgc-mom", "dgc:density=0.05+ef:momentum=0.9", {}),
    ("hier", "hierarchical", {}),
    ("fp16", "flat/fp16", {}),
    ("unused", "hitopk:density=0.05", {"find_unused_parameters": True}),
    ("clip", "topk:density=0.05", {"clip_local": 0.5}),
    ("clipb", "topk:density=0.05", {"clip_local": 0.5, "clip_local_mode": "bucket"}),
    ("densefrom", "dgc:density=0.05+ef:momentum=0.9", {"dense_from_step": 5}),
    ("sched", "topk:density=0.02", {"density_schedule": "exp@2"}),
    ("large", "topk:density=0.05", {"large_codec": "powersgd:rank=1", "large_bytes": 20000}),
    ("zerocopy", "hitopk:density=0.05", {"grad_as_bucket_view": True}),
]
HOOK = [("h-hitopk", "hitopk:density=0.05"), ("h-psgd", "powersgd:rank=2"), ("h-topk", "topk:density=0.05")]


def digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return torch.randn(16, 40, generator=g), torch.randn(16, 10, generator=g)


def run_wrap(name: str, scheme: str, opts: dict[str, object]) -> list[str]:
    module = Net()
    kw: dict[str, object] = dict(plan="compress", min_compress_bytes=0, bucket_bytes=20000, calibrate=False,
                                 log_plan=False, bucket_timeout_ms=1e9, partitions=1)  # fmt: skip
    kw.update(opts)
    model = gradsync.wrap(module, scheme, Topology(nodes=2, per_node=2), **kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    lines = []
    for step in range(9):
        x, y = _batch(step)
        side = not (name == "unused" and step in (3, 6))
        nn.functional.mse_loss(model(x, side=side), y).backward()
        for n, p in model.module.named_parameters():
            lines.append(f"{step} {n} {digest(p.grad) if p.grad is not None else None}")
        opt.step()
        opt.zero_grad(set_to_none=not opts.get("grad_as_bucket_view"))
    state = model.engine.state_dict()
    lines += [f"final {n} {digest(p.data)}" for n, p in model.module.named_parameters()]
    lines.append(f"plan {state['plan']}")
    model.close()
    return lines


def run_hook(scheme: str) -> list[str]:
    module = Net()
    ddp = DistributedDataParallel(module, bucket_cap_mb=0.02)
    gradsync.register_comm_hook(
        ddp, scheme, Topology(nodes=2, per_node=2), min_compress_bytes=0, log_plan=False
    )
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    lines = []
    for step in range(7):
        x, y = _batch(step)
        nn.functional.mse_loss(ddp(x), y).backward()
        lines += [f"{step} {n} {digest(p.grad)}" for n, p in module.named_parameters()]
        opt.step()
        opt.zero_grad()
    return lines


FSDP = [("f-shard", "topk:density=0.05", "shard"), ("f-both", "topk:density=0.05", "both"),
        ("f-replicate", "onebit", "replicate")]  # fmt: skip


def run_fsdp(scheme: str, where: str) -> list[str]:
    """FSDP2 on 4 ranks: sharded over all of them (``shard``), or 2 shards x 2 replicas, with
    ``b.bias`` frozen for two steps (its module's layout changes, what it is owed is carried)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync.fsdp import compress_fsdp

    module = Net()
    if where == "shard":
        mesh, group = init_device_mesh("cpu", (4,)), None
    else:
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        mesh, group = mesh2["shard"], mesh2["replicate"].get_group()
    for block in (module.a, module.b, module):
        fully_shard(block, mesh=mesh)
    compress_fsdp(module, scheme, replicate_group=group, where=where, min_compress_bytes=0)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    lines = []
    for step in range(7):
        module.b.bias.requires_grad_(step not in (3, 4))
        x, y = _batch(step)
        nn.functional.mse_loss(module(x), y).backward()
        for n, p in module.named_parameters():
            grad = p.grad.to_local() if p.grad is not None else None
            lines.append(f"{step} {n} {digest(grad) if grad is not None else None}")
        opt.step()
        opt.zero_grad()
    lines += [f"final {n} {digest(p.detach().to_local())}" for n, p in module.named_parameters()]
    return lines


OUTER = [
    ("o-dense", "ddp", {"every": 3}),
    ("o-wrap-chunktopk", "wrap", {"every": 3, "codec": "chunktopk:density=0.1,chunk=64"}),
    ("o-streamed", "ddp", {"every": 4, "fragments": 2, "delay": 1, "codec": "onebit"}),
    (
        "o-sparseloco",
        "ddp",
        {
            "every": 3,
            "codec": "sparseloco:density=0.1,chunk=64+ef:decay=0.9",
            "outer_lr": 1.0,
            "outer_momentum": 0.0,
        },
    ),
]


def run_outer(inner: str, opts: dict[str, object]) -> list[str]:
    """The outer loop over 2 nodes x 2 ranks, DDP or gradsync.wrap inside each node."""
    module = Net()
    outer = gradsync.OuterLoop(module, topology=Topology(nodes=2, per_node=2), **opts)  # type: ignore[arg-type]
    if inner == "wrap":
        model: nn.Module = gradsync.wrap(module, "flat", process_group=outer.inner_group, calibrate=False,
                                         log_plan=False)  # fmt: skip
    else:
        model = DistributedDataParallel(module, process_group=outer.inner_group)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    lines = []
    for step in range(9):
        x, y = _batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        lines += [f"{step} {n} {digest(p.grad)}" for n, p in module.named_parameters()]
        opt.step()
        opt.zero_grad()
        outer.step()
        lines += [f"{step} anchor{i} {digest(a)}" for i, a in enumerate(outer.anchors)]
    outer.close()
    lines += [f"final {n} {digest(p.data)}" for n, p in module.named_parameters()]
    if inner == "wrap":
        model.close()  # type: ignore[operator]
    return lines


def main(out: str) -> None:
    torch.set_num_threads(1)
    lines = []
    for name, scheme, opts in WRAP:
        lines += [f"== wrap {name}", *run_wrap(name, scheme, opts)]
    for name, scheme in HOOK:
        lines += [f"== hook {name}", *run_hook(scheme)]
    for name, scheme, where in FSDP:
        lines += [f"== fsdp {name}", *run_fsdp(scheme, where)]
    for name, inner, opts in OUTER:
        lines += [f"== outer {name}", *run_outer(inner, opts)]
    with open(os.path.join(out, f"rank{dist.get_rank()}.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    folder = sys.argv[1]
    os.makedirs(folder, exist_ok=True)
    run_world(4, main, folder)
