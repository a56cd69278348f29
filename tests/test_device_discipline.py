"""Every tensor gradsync hands torch.distributed is on the communication device of its group.

A checking wrapper replaces torch.distributed's collectives in each rank of a real gloo world and
records every tensor whose device is not the one its group's backend needs (the CPU for gloo,
the current GPU for NCCL). On a CPU-only machine gradients and communication share the CPU, so
to make a forgotten device visible here torch's tensor factories (``torch.zeros``,
``torch.tensor``...) put every tensor made without a ``device`` on ``meta``, in every thread: a
tensor gradsync makes without naming its device is reported (or fails loudly), where on a GPU
job it would be a CPU tensor handed to NCCL (``torch.set_default_device`` alone would not do:
its mode does not reach gradsync's threads nor autograd's hooks). The GPU tier
(tests/test_gpu.py) runs the same paths with CUDA tensors where a GPU exists.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.collectives import compressed_allreduce
from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology, backend_device
from worlds import expect_all, run_world

pytestmark = pytest.mark.timeout(300)

COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "send",
    "recv",
    "gather",
    "scatter",
)  # isend and irecv stay unwrapped (P2POp checks their identity): batch_isend_irecv checks them


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def install_checks():
    """Wrap every collective; return (calls seen, wrong devices seen)."""
    seen, wrong = [], []

    def check(name, fn):
        @functools.wraps(fn)
        def checked(*args, **kwargs):
            group = kwargs.get("group")
            want = backend_device(dist.get_backend(group))
            for t in _tensors(list(args) + list(kwargs.values())):
                if t.device != want:
                    wrong.append(f"{name}: a {tuple(t.shape)} {t.dtype} tensor on {t.device}, not {want}")
            seen.append(name)
            return fn(*args, **kwargs)

        return checked

    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, check(name, getattr(dist, name)))
    P._all_gather_single = check("all_gather_single", P._all_gather_single)
    original_batch = dist.batch_isend_irecv

    def batch(ops):
        for op in ops:
            want = backend_device(dist.get_backend(op.group))
            if op.tensor.device != want:
                wrong.append(f"batch_isend_irecv: a tensor on {op.tensor.device}, not {want}")
        seen.append("batch_isend_irecv")
        return original_batch(ops)

    dist.batch_isend_irecv = batch
    return seen, wrong


FACTORIES = ("tensor", "zeros", "empty", "ones", "full", "arange", "randn", "rand", "randint", "as_tensor")


@contextlib.contextmanager
def factories_default_to_meta():
    """``torch.<factory>(...)`` without ``device=`` makes a meta tensor, in every thread."""
    saved = {name: getattr(torch, name) for name in FACTORIES}

    def meta_by_default(fn):
        @functools.wraps(fn)
        def make(*args, **kwargs):
            if "device" not in kwargs and "out" not in kwargs:
                kwargs["device"] = "meta"
            return fn(*args, **kwargs)

        return make

    for name, fn in saved.items():
        setattr(torch, name, meta_by_default(fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch, name, fn)


class Net(nn.Module):
    """A conv layer, a matrix PowerSGD factors, a bias, and a layer no rank uses."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 8, 3)
        self.fc = nn.Linear(8 * 6 * 6, 32)
        self.head = nn.Linear(32, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.head(torch.relu(self.fc(torch.relu(self.conv(x)).flatten(1))))


def run_scheme(model, scheme, topo, x, y):
    synced = gradsync.wrap(
        model, scheme, topo, find_unused_parameters=True, check_overflow=True, plan="compress",
        bucket_bytes=4096, min_compress_bytes=0, log_plan=False,
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(3):  # step 0 dense, then the plan (calibration, codec timing, broadcast)
        opt.zero_grad()
        nn.functional.cross_entropy(synced(x), y).backward()
        synced.finish_sync()
        opt.step()
    synced.close()
    t = torch.randn(1000, device=x.device)
    compressed_allreduce(t, topo, gradsync.build_codec("topk:density=0.05"), "ring")
    gradsync.collectives.allreduce(t, topo, "torus2d")


def _every_path():
    seen, wrong = install_checks()
    rank = dist.get_rank()
    topo = Topology(nodes=2, per_node=2)
    cpu = torch.device("cpu")
    x = torch.randn(8, 2, 8, 8, generator=torch.Generator().manual_seed(rank), device=cpu)
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(rank), device=cpu)
    failures = []
    for scheme in (
        "none",
        "topk:density=0.1",
        "hitopk:density=0.1",
        "ps+local/onebit",
        "powersgd:rank=2",
        "fp16",
    ):
        torch.manual_seed(0)
        model = Net().to(cpu)
        try:
            with factories_default_to_meta():
                run_scheme(model, scheme, topo, x, y)
        except Exception as e:  # keep going: report every scheme that fails
            failures.append(f"{scheme}: {type(e).__name__}: {e}")
    with expect_all() as expect:  # (every one of these three, each naming this rank)
        with expect(f"rank {rank}: every scheme runs"):
            assert not failures, "; ".join(failures)
        with expect(f"rank {rank}: the checking wrapper saw the collectives"):
            assert len(seen) > 50 and "all_to_all_single" in seen, seen
        with expect(f"rank {rank}: every tensor on its group's communication device"):
            assert not wrong, f"{len(wrong)} collectives got tensors off it:\n" + "\n".join(sorted({*wrong}))


def test_every_collective_gets_tensors_on_the_communication_device():
    run_world(4, _every_path)
