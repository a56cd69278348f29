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
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync.collectives import compressed_allreduce
from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology, TopologyError, backend_device
from gradsync.sync.tasks import TaskError, TaskManager
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


# ------------------------------------------------------------------------- the threads' device
def test_a_topology_takes_the_rank_device_and_refuses_others():
    assert Topology(device=3).device == torch.device("cuda", 3)
    assert Topology(device="cuda:1").device == torch.device("cuda", 1)
    assert Topology(device="cpu").device == torch.device("cpu")
    if not torch.cuda.is_available():
        assert Topology().device == torch.device("cpu")
    for bad in ("cuda", "gpu:0", -1, True, 1.5, "meta"):
        with pytest.raises(TopologyError, match=r"device must be 'cpu', a CUDA device with its index"):
            Topology(device=bad)
    topo = Topology(device="cuda:1")
    topo.check_devices([torch.device("cuda", 1), torch.device("cuda", 0), torch.device("cpu")])
    topo.check_devices([torch.device("cpu")])
    with pytest.raises(
        ValueError, match=r"parameters are on cuda:0, cuda:2 but this rank's device is cuda:1"
    ):
        topo.check_devices([torch.device("cuda", 2), torch.device("cuda", 0)])


@contextlib.contextmanager
def recorded_set_device():
    """``torch.cuda.set_device`` records (thread name, device) instead of acting (no GPU here)."""
    calls: list[tuple[str, torch.device]] = []
    real = torch.cuda.set_device
    torch.cuda.set_device = lambda d: calls.append((threading.current_thread().name, torch.device(d)))
    try:
        yield calls
    finally:
        torch.cuda.set_device = real


def test_the_task_threads_make_the_device_current_before_any_task():
    with recorded_set_device() as calls:
        manager = TaskManager("t", torch.device("cuda", 3))
        ran: list[tuple[str, int]] = []

        def program():
            ran.append((threading.current_thread().name, len(calls)))
            yield lambda: ran.append((threading.current_thread().name, len(calls)))

        manager.wait([manager.submit(program(), "p")], timeout=10)
        manager.close()
    assert sorted(calls) == [("t-comm", torch.device("cuda", 3)), ("t-compute", torch.device("cuda", 3))]
    assert {name for name, _ in ran} == {"t-compute", "t-comm"}
    assert all(seen >= 1 for _, seen in ran)  # each thread had set its device before running


def test_a_device_the_threads_cannot_take_fails_the_tasks():
    def refuse(device):
        raise RuntimeError(f"no such device {device}")

    real = torch.cuda.set_device
    torch.cuda.set_device = refuse
    try:
        manager = TaskManager("t", torch.device("cuda", 7))

        def program():
            yield lambda: None

        started = time.monotonic()
        with pytest.raises(TaskError, match="no such device cuda:7"):
            manager.wait([manager.submit(program(), "p")], timeout=10)
        assert time.monotonic() - started < 5  # failed at once, not when the wait timed out
        manager.close()
    finally:
        torch.cuda.set_device = real


def _threads_take_the_rank_device():
    """Rank r given ``Topology(device=r)``: wrap's and the DDP hook's threads set cuda:r (a new
    thread's current device is cuda:0, so without it every rank of a node staged there)."""
    rank = dist.get_rank()
    want = torch.device("cuda", rank)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
    with recorded_set_device() as calls:
        torch.manual_seed(0)
        synced = gradsync.wrap(
            nn.Linear(16, 4), "topk:density=0.1", Topology(nodes=1, per_node=2, device=f"cuda:{rank}"),
            plan="compress", min_compress_bytes=0, log_plan=False,
        )  # fmt: skip
        for _ in range(2):
            synced(x).square().mean().backward()
        synced.close()
        ddp = DistributedDataParallel(nn.Linear(16, 4))
        state = gradsync.register_comm_hook(
            ddp, "topk:density=0.1", Topology(nodes=1, per_node=2, device=rank), min_compress_bytes=0
        )
        for _ in range(2):
            ddp(x).square().mean().backward()
        state.close()
    names = {name for name, d in calls if d == want}
    assert {"gradsync-compute", "gradsync-comm", "gradsync-ddp-compute", "gradsync-ddp-comm"} <= names, calls
    assert all(d == want for _, d in calls), calls


def test_gradsync_threads_work_on_the_rank_device():
    run_world(2, _threads_take_the_rank_device)


# ---------------------------------------------------------------------------- host reads per step
HOST_READS = ("__bool__", "__float__", "__int__", "item", "tolist")


@contextlib.contextmanager
def counted_host_reads():
    """Count the reads of tensor values into Python (each a host synchronization on a GPU) that
    gradsync's sync engine makes, in any thread: a ``Counter`` by (method, line)."""
    import collections
    import os
    import sys

    engine_file = os.path.join("gradsync", "sync", "engine.py")
    counts: collections.Counter = collections.Counter()
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counting(name, fn):
        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.endswith(engine_file):
                counts[(name, caller.co_name)] += 1
            return fn(self, *args, **kwargs)

        return read

    for name, fn in saved.items():
        setattr(torch.Tensor, name, counting(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def _host_reads_do_not_grow_with_buckets():
    """Under a GradScaler the engine checks every bucket for inf/NaN; the flags stay on the device
    until the step's flag all-reduce, so a step reads the device the same few times whether the
    model has 2 buckets or 12 (before: one read per bucket)."""
    rank = dist.get_rank()
    per_step = {}
    for layers in (2, 12):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(layers)])
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        synced = gradsync.wrap(
            model, "hierarchical", Topology(nodes=1, per_node=2), grad_scaler=scaler, bucket_bytes=4096,
            find_unused_parameters=True, log_plan=False, calibrate=False,
        )  # fmt: skip
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
        for step in range(4):
            if step == 2:  # after the first plan (which measures, with reads of its own)
                with counted_host_reads() as counts:
                    scaler.scale(synced(x).square().mean()).backward()
            else:
                scaler.scale(synced(x).square().mean()).backward()
            scaler.step(torch.optim.SGD(model.parameters(), lr=0.0))
            scaler.update()
            model.zero_grad()
        per_step[layers] = (len(synced.engine._buckets), dict(counts))
        synced.close()
    (few, reads_few), (many, reads_many) = per_step[2], per_step[12]
    assert many > few + 5, per_step
    assert reads_few == reads_many, f"host reads per step: {per_step}"
    assert sum(reads_many.values()) <= 2, f"host reads per step: {per_step}"


def test_a_step_reads_the_device_a_fixed_number_of_times():
    run_world(2, _host_reads_do_not_grow_with_buckets)


def _fsdp_paths():
    """gradsync.fsdp's collectives (the compressed reduce-scatter, the replicate all-reduce, the
    replicas check) on the communication device, nothing made without a device."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync.fsdp import compress_fsdp, replicate

    seen, wrong = install_checks()
    cpu = torch.device("cpu")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    x = torch.randn(8, 2, 8, 8, generator=torch.Generator().manual_seed(dist.get_rank()), device=cpu)
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(dist.get_rank()), device=cpu)
    failures = []
    for label, where, scheme in (("hsdp", "both", "topk:density=0.1"), ("replicate", None, "onebit")):
        torch.manual_seed(0)
        model = Net().to(cpu)
        try:
            if where is None:
                replicate(model, scheme, blocks=[model.conv, model.fc], min_compress_bytes=0)
            else:
                for block in (model.conv, model.fc):
                    fully_shard(block, mesh=mesh["shard"])
                fully_shard(model, mesh=mesh["shard"])
                compress_fsdp(
                    model,
                    scheme,
                    replicate_group=mesh["replicate"].get_group(),
                    where=where,
                    min_compress_bytes=0,
                )
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            for _ in range(2):
                with factories_default_to_meta():
                    nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        except Exception as e:  # keep going: report every path that fails
            failures.append(f"{label}: {type(e).__name__}: {e}")
    with expect_all() as expect:
        with expect("every FSDP path runs"):
            assert not failures, "; ".join(failures)
        with expect("the checking wrapper saw gradsync's all-to-all and all-gathers"):
            assert "all_to_all_single" in seen and "all_gather" in seen, seen
        with expect("every tensor on its group's communication device"):
            assert not wrong, "\n".join(sorted({*wrong}))


def test_fsdp_collectives_get_tensors_on_the_communication_device():
    run_world(4, _fsdp_paths)
