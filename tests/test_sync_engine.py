"""gradsync.wrap and the DDP comm hook in real gloo worlds, checked against PyTorch DDP and plain
all-reduce references. Each world runs many checks (spawning is the slow part) and reports every
one that fails."""

import copy
import io
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
from gradsync.collectives import MismatchError, Topology
from gradsync.collectives import primitives as P
from worlds import expect_all, named_check, run_checks, run_world

pytestmark = pytest.mark.timeout(600)

FAST = {"calibrate": False, "log_plan": False}  # on loopback the link sweep adds nothing


def mlp(seed=0, width=64, classes=4):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, classes)
    )


def batch(step, rank, n=32, classes=4):
    """A separable problem: the class is the argmax of the first ``classes`` features."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 16, generator=g)
    return x, x[:, :classes].argmax(1)


def mean_grads(model):
    """The reference: every gradient all-reduced and divided by the world size."""
    out = []
    for p in model.parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        out.append(g / dist.get_world_size())
    return out


def topologies():
    world = dist.get_world_size()
    # 2 x 2 and 2 x 1 compress across nodes; 1 x 4 aggregates locally only (exact)
    return (
        [Topology(nodes=2, per_node=world // 2), Topology()]
        if world == 4
        else [Topology(nodes=2, per_node=1)]
    )


# ------------------------------------------------------------------------------------- checks
def check_dense_schemes_equal_ddp(topo):
    rank = dist.get_rank()
    with expect_all() as expect:
        for scheme in ("none", "flat", "hierarchical", "torus2d", "hybrid"):
            for bucket_bytes in (64 << 20, 1):  # fusion on (one bucket), off (one tensor each)
                base = mlp()
                ddp = DDP(copy.deepcopy(base))
                ours = gradsync.wrap(copy.deepcopy(base), scheme, topo, bucket_bytes=bucket_bytes,
                                     bucket_timeout_ms=1e6, **FAST)  # fmt: skip
                opt_a = torch.optim.SGD(ddp.parameters(), lr=0.1)
                opt_b = torch.optim.SGD(ours.parameters(), lr=0.1)
                for step in range(3):
                    x, y = batch(step, rank)
                    for model, opt in ((ddp, opt_a), (ours, opt_b)):
                        opt.zero_grad()
                        nn.functional.cross_entropy(model(x), y).backward()
                    with expect(f"{scheme}, bucket_bytes={bucket_bytes}, step {step}"):
                        for a, b in zip(ddp.parameters(), ours.parameters(), strict=True):
                            torch.testing.assert_close(b.grad, a.grad)
                    opt_a.step()
                    opt_b.step()
                ours.close()
                with expect(f"{scheme}, bucket_bytes={bucket_bytes}: buckets"):
                    assert ours.last_stats.buckets == (1 if bucket_bytes > 1 else 6)


def train(model, opt, steps, scaler=None):
    rank = dist.get_rank()
    losses = []
    for step in range(steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    last = torch.tensor([sum(losses[-5:]) / 5])
    dist.all_reduce(last)  # the mean over ranks: every rank judges the same number
    return float(last) / dist.get_world_size()


TRAIN_SCHEMES = (
    "hierarchical", "torus2d/fp16", "hitopk:density=0.05", "allgather/topk:density=0.05",
    "ring/topk:density=0.1", "ps+local/onebit", "ring+local/onebit", "ps/terngrad",
    # TBQ's threshold is absolute: it must suit the summed gradients it quantizes (x world)
    "ring+local/tbq:threshold={tbq}",
    "powersgd:rank=2", "allgather/randomk:density=0.5", "hitopk/dgc:density=0.05", "qrgc:density=0.05",
    "allgather/bsearch:density=0.05", "hitopk/trimmed_topk:density=0.05", "ps/bf16",
)  # fmt: skip


def check_every_scheme_trains_like_ddp(topo):
    steps = 60
    base = mlp(seed=1)
    ddp = DDP(copy.deepcopy(base))
    ref = train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9), steps)
    losses, not_compressed = {}, {}
    for scheme in (t.format(tbq=0.01 * dist.get_world_size()) for t in TRAIN_SCHEMES):
        model = gradsync.wrap(
            copy.deepcopy(base), scheme, topo, plan="compress", min_compress_bytes=0, **FAST
        )
        losses[scheme] = train(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), steps)
        model.close()
        stats = model.last_stats
        compressed = gradsync.sync.Scheme.parse(scheme).kind == "compressed"
        if stats.dense or stats.compressed_buckets != (stats.buckets if compressed else 0):
            not_compressed[scheme] = stats  # asserted after every scheme ran
    if dist.get_rank() == 0:
        print(f"dense {ref:.3f}", {k: round(v, 3) for k, v in losses.items()})
    with expect_all() as expect:
        with expect("synchronized as planned (compressed or dense)"):
            assert not not_compressed, not_compressed
        with expect("the problem is learnable in these steps"):
            assert ref < 0.4, ref
        # loose: compressed training reaches the region dense training reaches in the same steps
        with expect("compressed training as good as dense"):
            worse = {k: v for k, v in losses.items() if not v < ref + 0.25}
            assert not worse, (ref, worse)


def check_hook_matches_wrap(topo):
    rank = dist.get_rank()
    with expect_all() as expect:
        for scheme in ("hitopk:density=0.1", "powersgd:rank=2", "ring+local/onebit"):
            base = mlp(seed=2)
            inner = copy.deepcopy(base)
            ddp = DDP(inner, bucket_cap_mb=1e-6)  # one bucket per tensor, like bucket_bytes=1
            opts = {"min_compress_bytes": 0, "plan": "compress", "partitions": 1}
            state, hook = gradsync.ddp_comm_hook(scheme, topo, model=inner, **opts)
            ddp.register_comm_hook(state, hook)
            ours = gradsync.wrap(copy.deepcopy(base), scheme, topo, bucket_bytes=1, **opts, **FAST)
            opt_a = torch.optim.SGD(ddp.parameters(), lr=0.1)
            opt_b = torch.optim.SGD(ours.parameters(), lr=0.1)
            for step in range(4):
                x, y = batch(step, rank)
                for model, opt in ((ddp, opt_a), (ours, opt_b)):
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                with expect(f"{scheme} step {step}"):
                    for a, b in zip(ddp.parameters(), ours.parameters(), strict=True):
                        torch.testing.assert_close(a.grad, b.grad)
                opt_a.step()
                opt_b.step()
            state.manager.close()
            ours.close()
            with expect(f"{scheme}: steps"):
                assert state.step == 4 and not ours.last_stats.dense


def run_steps(model, opt, start, stop):
    rank = dist.get_rank()
    for step in range(start, stop):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def check_resume_is_bitwise(topo):
    scheme = "hitopk/topk:density=0.1+ef:momentum=0.5"
    # resumed inside the density schedule's first stage (steps 0-3), with the dense step's momentum
    opts = {
        "plan": "compress",
        "min_compress_bytes": 0,
        "bucket_bytes": 4096,
        "density_schedule": "0.5@4",
        **FAST,
    }
    base = mlp(seed=3)
    straight = gradsync.wrap(copy.deepcopy(base), scheme, topo, **opts)
    opt = torch.optim.SGD(straight.parameters(), lr=0.1)
    run_steps(straight, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"model": straight.module.state_dict(), "opt": opt.state_dict(),
                "sync": straight.sync_state_dict()}, buf)  # fmt: skip
    run_steps(straight, opt, 3, 6)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)  # tensors and plain values only
    resumed = gradsync.wrap(mlp(seed=99), scheme, topo, broadcast_parameters=False, **opts)
    resumed.module.load_state_dict(ckpt["model"])
    opt2 = torch.optim.SGD(resumed.parameters(), lr=0.1)
    opt2.load_state_dict(ckpt["opt"])
    resumed.load_sync_state_dict(ckpt["sync"])
    run_steps(resumed, opt2, 3, 6)
    # another scheme's state is refused, or reset with a warning when asked (no collectives)
    other = gradsync.wrap(copy.deepcopy(base), "hitopk/topk:density=0.2", topo, **opts)
    with expect_all() as expect:
        with expect("resumed = uninterrupted"):
            for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
                assert torch.equal(a, b)
        with expect("another scheme's state"):
            with pytest.raises(ValueError, match=r"saved under a different setup .*scheme"):
                other.load_sync_state_dict(ckpt["sync"])
            with pytest.warns(UserWarning, match="resetting the compression state"):
                other.load_sync_state_dict(ckpt["sync"], reset_compression_state=True)
            assert other.engine.step == 3 and other.engine.plan is None
        for m in (straight, resumed, other):
            m.close()


def ef_residuals(model):
    codec = model.engine.codecs[0]
    return {k: v["residual"].clone() for k, v in codec.state_dict()["streams"].items()}


def check_overflow_skips_everywhere(topo):
    rank = dist.get_rank()
    base = mlp(seed=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model = gradsync.wrap(copy.deepcopy(base), "hitopk:density=0.1", topo, grad_scaler=scaler,
                          plan="compress", min_compress_bytes=0, **FAST)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inject = {"on": False}
    first = next(model.module.parameters())
    if rank == 1:  # only rank 1's gradient overflows
        first.register_hook(lambda g: torch.full_like(g, float("inf")) if inject["on"] else g)
    with expect_all() as expect:
        for step in range(5):
            inject["on"] = step == 3
            x, y = batch(step, rank)
            opt.zero_grad()
            residuals = ef_residuals(model) if step == 3 else None
            scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()
            before = [p.detach().clone() for p in model.parameters()]
            scaler.step(opt)
            scaler.update()
            changed = any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            with expect(f"step {step}"):
                if step == 3:
                    assert model.last_stats.overflow and not changed  # skipped on every rank
                    after = ef_residuals(model)
                    assert after.keys() == residuals.keys()
                    for k in after:
                        assert torch.equal(after[k], residuals[k]), k  # residuals untouched
                    assert scaler.get_scale() == 512.0
                else:
                    assert not model.last_stats.overflow and changed
        model.close()


class SlowBackward(torch.autograd.Function):
    """Identity whose backward takes a while: the early layers' backward is slow."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.15)
        return g


class SlowFirstLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = mlp(seed=5)

    def forward(self, x):
        return self.body[1:](SlowBackward.apply(self.body[0](x)))


def check_overlap_is_real(topo):
    rank = dist.get_rank()
    real = P.all_reduce

    def slow_all_reduce(*args, **kwargs):
        time.sleep(0.05)
        return real(*args, **kwargs)

    P.all_reduce = slow_all_reduce
    try:
        model = gradsync.wrap(SlowFirstLayer(), "flat", topo, bucket_bytes=1, **FAST)
        for step in range(2):
            x, y = batch(step, rank)
            nn.functional.cross_entropy(model(x), y).backward()
        s = model.last_stats
    finally:
        P.all_reduce = real
    ref = mean_grads(model.module)
    model.close()
    with expect_all() as expect:
        with expect("the last layers' buckets communicated while the backward pass still ran"):
            assert s.launched_in_backward >= 3
            assert s.first_comm_at < s.backward_end_at < s.done_at
            assert s.overlapped_s > 0.05 and s.comm_s >= 6 * 0.05
            assert s.compute_s > 0 and s.decode_s > 0 and s.sent_bytes
        with expect("the gradients are the mean"):
            for p, g in zip(model.parameters(), ref, strict=True):
                torch.testing.assert_close(p.grad, g)


def check_mismatched_config_fails_everywhere(topo):
    rank = dist.get_rank()
    with pytest.raises(
        MismatchError,
        match=r"config: rank 0=.*scheme=hitopk:density=0.01.*rank 1=.*scheme=hitopk:density=0.02",
    ):
        gradsync.wrap(mlp(), f"hitopk:density={0.01 if rank != 1 else 0.02}", topo)
    with pytest.raises(
        MismatchError, match=r"rank 1=.invalid: sync: plan must be one of auto, compress, dense"
    ):
        gradsync.wrap(mlp(), "none", topo, plan="auto" if rank != 1 else "always")
    with pytest.raises(MismatchError, match="parameters"):
        gradsync.wrap(mlp(width=64 if rank != 1 else 32), "none", topo)
    # every rank equally wrong: each raises the configuration error itself
    with pytest.raises(ValueError, match="sync: bucket_bytes must be in"):
        gradsync.wrap(mlp(), "none", topo, bucket_bytes=0)


def check_no_sync_accumulates_like_a_larger_batch(topo):
    rank = dist.get_rank()
    base = mlp(seed=6)
    model = gradsync.wrap(copy.deepcopy(base), "torus2d", topo, **FAST)
    ref = copy.deepcopy(base)
    with expect_all() as expect:
        for step in range(2):
            x1, y1 = batch(2 * step, rank)
            x2, y2 = batch(2 * step + 1, rank)
            model.zero_grad()
            ref.zero_grad()
            with model.no_sync():
                nn.functional.cross_entropy(model(x1), y1, reduction="sum").backward()
            with expect(f"step {step}: nothing synced inside no_sync"):
                assert model.last_stats is None or model.last_stats.step == step - 1
            nn.functional.cross_entropy(model(x2), y2, reduction="sum").backward()
            x, y = torch.cat([x1, x2]), torch.cat([y1, y2])
            nn.functional.cross_entropy(ref(x), y, reduction="sum").backward()
            want = mean_grads(ref)
            with expect(f"step {step}: the mean of both batches"):
                for p, g in zip(model.parameters(), want, strict=True):
                    torch.testing.assert_close(p.grad, g)
        model.close()


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.shared = nn.Linear(16, 8)
        self.sometimes = nn.Linear(16, 8)  # unused on rank 1
        self.never = nn.Linear(16, 8)  # unused everywhere
        self.odd = nn.Parameter(torch.randn(8, 4).t())  # non-contiguous parameter (and gradient)

    def forward(self, x):
        h = self.frozen(x)
        out = self.shared(h)
        if dist.get_rank() != 1:
            out = out + self.sometimes(h)
        return out[:, :4] @ self.odd


def check_unused_frozen_and_noncontiguous(topo):
    rank, world = dist.get_rank(), dist.get_world_size()
    with expect_all() as expect:
        for find_unused in (False, True):
            model = gradsync.wrap(Branches(), "torus2d", topo, find_unused_parameters=find_unused,
                                  bucket_bytes=256, **FAST)  # fmt: skip
            with expect(f"find_unused={find_unused}: frozen parameters have no slot"):
                assert "frozen.weight" not in [s.name for s in model.engine.slots]
            ref = Branches()
            for step in range(2):
                x, _ = batch(step, rank)
                model.zero_grad(set_to_none=True)
                ref.zero_grad(set_to_none=True)
                model(x).square().mean().backward()
                ref(x).square().mean().backward()
                m = dict(model.module.named_parameters())
                want = {}  # the reference: every rank's local gradient (zero if unused), all-reduced
                for name, p in ref.named_parameters():
                    if p.requires_grad:
                        want[name] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                        dist.all_reduce(want[name])
                with expect(f"find_unused={find_unused}, step {step}"):
                    assert m["frozen.weight"].grad is None
                    for name, local in want.items():
                        if name.startswith("never"):  # no rank used it: None, as DDP leaves it
                            assert m[name].grad is None, name
                            continue
                        torch.testing.assert_close(m[name].grad, local / world, msg=name)
                    assert not m["odd"].grad.is_contiguous()
            model.close()


def check_deferred_finish_and_dense_switch(topo):
    """Also: bf16 autocast on the CPU (the gradients stay float32)."""
    rank = dist.get_rank()
    model = gradsync.wrap(mlp(seed=8), "hitopk:density=0.2", topo, finish_in_backward=False, plan="compress",
                          min_compress_bytes=0, dense_from_step=3, **FAST)  # fmt: skip
    opt = gradsync.SyncedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    dense, left = [], []
    for step in range(5):
        x, y = batch(step, rank)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()  # finishes the synchronization first
        dense.append(model.last_stats.dense)
        left.append(model.finish_sync())  # nothing left: None
    model.close()
    assert dense == [True, False, False, True, True]
    assert left == [None] * 5
    assert opt.param_groups[0]["lr"] == 0.1


def check_auto_plan_is_logged_and_calibrated(topo):
    """The real path: calibration, codec timing, a plan broadcast from rank 0."""
    rank = dist.get_rank()
    model = gradsync.wrap(mlp(seed=9, width=256), "hitopk:density=0.01", topo, min_compress_bytes=4096)
    for step in range(2):
        x, y = batch(step, rank)
        nn.functional.cross_entropy(model(x), y).backward()
    mine = model.engine.plan.to_tensor()
    theirs = mine.clone()
    dist.broadcast(theirs, 0)
    table = model.plan_table()
    model.close()
    assert torch.equal(mine, theirs)  # every rank has rank 0's plan
    assert "synchronized as" in table and "dense" in table  # small tensors stay dense


def check_recut_merges_compressed_buckets_across_dense_ones(topo):
    """Where start-ups dominate (20 ms a collective, the links assumed with calibration off), the
    planner merges the weights' compressed buckets, cut one per tensor by a zero fusion timeout,
    into one bucket that launches after the biases' dense one. The gradients stay the plain
    all-reduce's (a lossless codec)."""
    from gradsync.collectives.cost import CostParams, Link
    from gradsync.planner import decide as planner

    rank = dist.get_rank()
    assumed = planner.DEFAULT_PARAMS
    planner.DEFAULT_PARAMS = CostParams(Link(20e-3, 1 / 10e9), Link(20e-3, 8 / 10e9), 1e-10)
    base = mlp(seed=11)
    model = gradsync.wrap(copy.deepcopy(base), "allgather/none", topo, plan="compress",
                          min_compress_bytes=1024, bucket_timeout_ms=0, **FAST)  # fmt: skip
    ref = copy.deepcopy(base)
    try:
        with expect_all() as expect:
            for step in range(3):
                x, y = batch(step, rank)
                for m in (model, ref):
                    m.zero_grad()
                    nn.functional.cross_entropy(m(x), y).backward()
                want = mean_grads(ref)
                with expect(f"step {step}: every rank's gradients averaged"):
                    for p, g in zip(model.parameters(), want, strict=True):
                        torch.testing.assert_close(p.grad, g)
            buckets = model.engine.plan.buckets
            names = [s.name for s in model.engine.slots]
            with expect("one compressed bucket of the three weights, after the dense biases"):
                compressed = [b for b in buckets if b.compress]
                assert len(compressed) == 1, model.plan_table()
                assert sorted(names[i] for i in compressed[0].slots) == ["0.weight", "2.weight", "4.weight"]
                assert buckets[-1].compress and not buckets[0].compress, model.plan_table()
                assert model.last_stats.compressed_buckets == 1
    finally:
        planner.DEFAULT_PARAMS = assumed
        model.close()


PER_TOPOLOGY = (
    check_dense_schemes_equal_ddp,
    check_hook_matches_wrap,
    check_resume_is_bitwise,
    check_overflow_skips_everywhere,
    check_mismatched_config_fails_everywhere,
    check_no_sync_accumulates_like_a_larger_batch,
    check_unused_frozen_and_noncontiguous,
    check_deferred_finish_and_dense_switch,
)


def world_checks():
    topos = topologies()
    run_checks(
        *(
            named_check(check, topo, label=f"{topo.nodes}x{topo.per_node}")
            for topo in topos
            for check in PER_TOPOLOGY
        ),
        named_check(check_every_scheme_trains_like_ddp, topos[0]),
        named_check(check_overlap_is_real, topos[0]),
        named_check(check_auto_plan_is_logged_and_calibrated, topos[0]),
        named_check(check_recut_merges_compressed_buckets_across_dense_ones, topos[0]),
    )


@pytest.mark.parametrize("world", [2, 4])
def test_engine_in_a_world(world):
    run_world(world, world_checks)


def one_rank_checks():
    base = mlp()
    model = gradsync.wrap(copy.deepcopy(base), "hitopk:density=0.01")
    ref = copy.deepcopy(base)
    for step in range(2):
        x, y = batch(step, 0)
        for m in (model, ref):
            m.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
        for a, b in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)  # identity: local training
    assert model.last_stats is None and model.finish_sync() is None


def test_one_rank_is_local_training():
    one_rank_checks()  # no process group at all
    run_world(1, one_rank_checks)
