"""No gradient owed is ever lost: what error feedback keeps back is applied later, whatever happens
to the streams that keep it (gradsync.sync.carry).

The invariant, checked in float64 on real gloo worlds of 4 ranks (2 nodes x 2): over a run,

    sum over steps of the mean of the ranks' raw gradients
        == sum over steps of the synchronized gradients applied + what the ranks still owe

where "what the ranks still owe" is every rank's error-feedback residual traced back to its
elements (added over the ranks, divided by the world). The raw gradients come from a twin of
the model that gradsync does not touch, and their mean from a plain all-reduce. The run goes
through the events that used to lose residuals: plan switches that re-cut, merge, partition and
densify buckets and a revert, a resume from a checkpoint taken right after a switch, parameters
that no rank used (``find_unused_parameters``), and the switch to dense training
(``dense_from_step``), after which nothing may be owed. With momentum correction the residual is
part of the update: the first dense step must apply it once, and continue the momentum from the
mean of the ranks' error-feedback momentum instead of restarting it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync.codecs import build_codec
from gradsync.collectives import Topology
from gradsync.collectives.compressed import compressed_allreduce
from gradsync.planner.plan import BucketPlan, Plan
from worlds import named_check, run_checks, run_world

pytestmark = pytest.mark.timeout(300)

WORLD = 4
TOL = 2e-5  # float32 sums over a dozen steps, against float64 references


def _failures() -> tuple[list[str], object]:
    failed: list[str] = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            failed.append(what)

    return failed, expect


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = max(float(b.abs().max()), 1e-12)
    return float((a - b).abs().max()) / scale


# ------------------------------------------------------------------------------ the collectives
def check_every_strategy_records_where_its_residuals_belong():
    """Each residual a strategy leaves on a rank carries the offset of its elements in the tensor
    reduced: placed there and summed over the ranks, it is exactly what the results lack."""
    topo = Topology(nodes=2, per_node=2)
    rank, world = dist.get_rank(), dist.get_world_size()
    failed, expect = _failures()
    cases = [
        ("allgather", False, "topk:density=0.05+ef", (4099,), 4),
        ("ring", False, "topk:density=0.05+ef", (4099,), 4),
        ("ps", False, "onebit+ef", (4099,), 4),
        ("allgather", True, "topk:density=0.01+ef", ((1 << 21) + 6,), 2),  # 2 pipelined chunks, padded
        ("ring", True, "topk:density=0.05+ef", (4099,), 4),
        ("ps", True, "topk:density=0.05+ef", (4099,), 4),
        ("allgather", False, "powersgd:rank=2+ef", (64, 48), 4),
        ("allgather", True, "powersgd:rank=2+ef", (64, 48), 4),
    ]
    for strategy, local, spec, shape, pipeline in cases:
        codec = build_codec(spec)
        numel = int(torch.Size(shape).numel())
        wanted = torch.zeros(numel, dtype=torch.float64)
        applied = torch.zeros(numel, dtype=torch.float64)
        for step in range(3):
            g = torch.randn(shape, generator=torch.Generator().manual_seed(100 * rank + step))
            total = g.double().reshape(-1)
            dist.all_reduce(total)
            wanted += total / world
            x = g.clone()
            compressed_allreduce(x, topo, codec, strategy, local, "mean", key="t", pipeline=pipeline)
            applied += x.double().reshape(-1)
        owed = torch.zeros(numel, dtype=torch.float64)
        for o in codec.owed():
            n = max(0, min(o.residual.numel(), numel - o.offset))  # beyond the end: padding
            owed[o.offset : o.offset + n] += o.residual[:n].double()
        dist.all_reduce(owed)
        err = _relative(applied + owed / world, wanted)
        label = f"{strategy}{'+local' if local else ''}/{spec}"
        expect(err < TOL, f"{label}: applied + owed is off the mean by {err:.2e}")
        expect(float(owed.abs().sum()) > 0, f"{label}: nothing owed (the check would prove nothing)")
    assert not failed, "\n".join(failed)


# ------------------------------------------------------------------------------------ the engine
class Branchy(nn.Module):
    """A trunk and two heads; ``side`` only contributes when asked, so some steps leave it
    unused on some or all ranks. With small buckets the side head shares a bucket with the
    main one, so an unused parameter's slice sits next to used ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.trunk = nn.Linear(32, 64)
        self.head = nn.Linear(64, 16)
        self.side = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor, side: bool = True) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(h) + self.side(h) if side else self.head(h)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    return torch.randn(8, 32, generator=g), torch.randn(8, 16, generator=g)


def _wrap(module: nn.Module, scheme: str, **options) -> gradsync.GradSync:
    return gradsync.wrap(
        module, scheme, Topology(nodes=2, per_node=2), plan="compress", min_compress_bytes=0,
        bucket_bytes=6000, calibrate=False, log_plan=False, find_unused_parameters=True, **options,
    )  # fmt: skip


def _replanned(engine, first: Plan, how: str) -> Plan:
    """A plan made by hand from the first plan's buckets (the compressible ones: codec 0)."""
    ours = [b for b in first.buckets if b.codec_id == 0]
    rest = [copy.deepcopy(b) for b in first.buckets if b.codec_id != 0]
    if how == "merge":  # every compressible slot in one bucket, cut in 2 parts (PowerSGD: 1)
        slots = [i for b in ours for i in b.slots]
        return Plan([BucketPlan(slots, 0, True, 1 if engine.codecs[0].lowrank else 2), *rest])
    if how == "first dense":  # back to the first grouping; its first bucket dense
        return Plan([BucketPlan(list(b.slots), 0, i > 0, 1) for i, b in enumerate(ours)] + rest)
    if how == "all compressed":
        return Plan([BucketPlan(list(b.slots), 0, True, 1) for b in ours] + rest)
    raise AssertionError(how)


def _sides(step: int, rank: int) -> bool:
    """Whether the side head is used: not at all on steps 3 and 9 (no rank uses it), not on
    rank 1 at step 8 (some ranks use it)."""
    return step not in (3, 9) and not (step == 8 and rank == 1)


def check_nothing_owed_is_lost(scheme: str):
    """The run of the module docstring for one scheme: switches after steps 2 (merge into one
    bucket of 2 parts), 4 (back to the first grouping, one bucket dense) and 6 (all of it
    compressed again, as a revert returns), a resume right after the step-4 switch (the carry is
    in the checkpoint), unused parameters at steps 3, 8 and 9, dense from step 10. The invariant
    holds after every step; after the first dense step nothing is owed. (With local aggregation
    PowerSGD's streams live on the node leaders only, so some checks ask "on some rank".)"""
    rank, world = dist.get_rank(), dist.get_world_size()
    failed, expect = _failures()
    module = Branchy()
    twin = copy.deepcopy(module)
    model = _wrap(module, scheme, dense_from_step=10)
    names = [n for n, _ in module.named_parameters()]
    wanted = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in module.named_parameters()}
    applied = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in module.named_parameters()}
    lowrank_kept: dict[str, torch.Tensor] = {}
    for step in range(12):
        x, y = _batch(step)
        side = _sides(step, rank)
        nn.functional.mse_loss(twin(x, side), y).backward()
        nn.functional.mse_loss(model(x, side=side), y).backward()
        for n, p in twin.named_parameters():
            g = p.grad.double().reshape(-1) if p.grad is not None else torch.zeros_like(wanted[n])
            dist.all_reduce(g)
            wanted[n] += g / world
        for n, p in model.module.named_parameters():
            if p.grad is not None:
                applied[n] += p.grad.double().reshape(-1)
        twin.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        engine = model.engine
        if step == 2:
            first = copy.deepcopy(engine.plan)
        if step in (2, 4, 6):
            how = {2: "merge", 4: "first dense", 6: "all compressed"}[step]
            before = {k: t.clone() for k, t in _lowrank_residuals(engine).items()}
            warm = _warm_starts(engine)
            engine._switch_plan(_replanned(engine, first, how))
            if step == 6:  # PowerSGD's per-tensor streams (residual, warm start) outlive a re-cut
                lowrank_kept = {k: t for k, t in _lowrank_residuals(engine).items() if k in before}
                for k, t in lowrank_kept.items():
                    expect(torch.equal(t, before[k]), f"{scheme}: {k}'s PowerSGD residual changed")
                    q = _warm_starts(engine).get(k)
                    expect(q is not None and torch.equal(q, warm[k]), f"{scheme}: {k}'s warm start changed")
        if step == 4:  # resume right after a switch: what is carried is in the checkpoint
            expect(_anywhere(bool(engine.carry)), f"{scheme}: nothing carried after the switch at step 4")
            state = engine.state_dict()
            fresh = copy.deepcopy(model.module)
            model.close()
            model = _wrap(fresh, scheme, dense_from_step=10)
            model.engine.load_state_dict(state)
        owed = model.engine.owed_gradients()
        for n in names:
            t = owed.get(n)
            total = t.double() if t is not None else torch.zeros_like(wanted[n])
            dist.all_reduce(total)
            err = _relative(applied[n] + total, wanted[n])
            expect(err < TOL, f"{scheme}, after step {step}, {n}: applied + owed off the mean by {err:.2e}")
            if step >= 10:
                expect(float(total.abs().max()) == 0.0, f"{scheme}, after step {step}, {n}: still owed")
    if "powersgd" in scheme:
        expect(_anywhere(bool(lowrank_kept)), f"{scheme}: no PowerSGD stream survived the step-6 switch")
    model.close()
    assert not failed, "\n".join(failed)


def _anywhere(flag: bool) -> bool:
    """Whether ``flag`` holds on some rank (every rank gets the same answer)."""
    t = torch.tensor([float(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0] > 0)


def _warm_starts(engine) -> dict[str, torch.Tensor]:
    """PowerSGD's warm-started Q factor of each tensor (from the codec's saved state)."""
    codec = engine.codecs[0]
    if not codec.lowrank:
        return {}
    streams = codec.state_dict()["codec"]["streams"]
    return {k: v["q"].clone() for k, v in streams.items() if v.get("q") is not None}


def _lowrank_residuals(engine) -> dict[str, torch.Tensor]:
    """PowerSGD's residuals by parameter name (its streams are per tensor)."""
    codec = engine.codecs[0]
    if not codec.lowrank:
        return {}
    return {o.key: o.residual for o in codec.owed()}


def check_momentum_correction_carries_residual_and_momentum():
    """``ef:momentum``: at the switch to dense training the residual (an update) is applied once,
    on top of a momentum continued from the mean of the ranks' error-feedback momentum, then the
    momentum goes on as momentum SGD's. Reference in float64: the update of step 5 (first dense
    step) is M * (M**4 * g0 + mean u) + g5 + mean r, where g0 is the dense warm-up's mean
    gradient (its momentum released over steps 1-4), and step 6's is M * (that momentum) + g6."""
    world = dist.get_world_size()
    failed, expect = _failures()
    m = 0.9
    module = Branchy()
    twin = copy.deepcopy(module)
    model = gradsync.wrap(
        module, "allgather/topk:density=0.05+ef:momentum=0.9", Topology(nodes=2, per_node=2),
        plan="compress", min_compress_bytes=0, bucket_bytes=1, calibrate=False, log_plan=False,
        dense_from_step=5,
    )  # fmt: skip
    codec = model.engine.codecs[0]
    means: dict[int, dict[str, torch.Tensor]] = {}
    held: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    last: list = []  # what the streams held at the end of step 4, before they ended
    model.engine.observers.append(lambda st, *_: st.step == 4 and last.extend(codec.owed()))
    for step in range(7):
        x, y = _batch(step)
        nn.functional.mse_loss(twin(x), y).backward()
        nn.functional.mse_loss(model(x), y).backward()
        means[step] = {}
        for n, p in twin.named_parameters():
            g = p.grad.double().reshape(-1)
            dist.all_reduce(g)
            means[step][n] = g / world
        if step == 4:  # one parameter per bucket: stream "NAME/allgather" covers it whole
            for o in last:
                expect(o.momentum is not None and o.offset == 0, f"stream {o.key}: {o}")
                r, u = o.residual.double(), (o.momentum if o.momentum is not None else o.residual).double()
                dist.all_reduce(r)
                dist.all_reduce(u)
                held[o.key.split("/")[0]] = (r / world, u / world)
        if step in (5, 6):
            for n, p in model.module.named_parameters():
                r, u = held[n]
                velocity = m * (m**4 * means[0][n] + u) + means[5][n]
                want = velocity + r if step == 5 else m * velocity + means[6][n]
                err = _relative(p.grad.double().reshape(-1), want)
                expect(err < TOL, f"step {step}, {n}: update off the reference by {err:.2e}")
        twin.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    expect(len(held) == 6, f"streams before the switch: {sorted(held)}")
    expect(not codec.owed() and not model.engine.carry, "something is still owed after the dense steps")
    model.close()
    assert not failed, "\n".join(failed)


# -------------------------------------------------------------------------------- the DDP hook
def check_the_hook_owes_nothing(scheme: str):
    """The invariant through gradsync's DDP hook under a GradScaler: DDP with
    ``find_unused_parameters`` (the side head unused at steps 3 and 9, on rank 1 at step 8) and
    small buckets; rank 3's loss overflows at step 2, so every rank skips that step (its
    gradients are NaN on every rank, its residuals as after step 1 on every rank, and the step
    counts neither as computed nor as applied); at step 4 the state goes into a new DDP model with
    other buckets (one for everything) and the next iteration is dense, with everything that was
    owed; dense from step 8 on, after which nothing is owed."""
    rank, world = dist.get_rank(), dist.get_world_size()
    failed, expect = _failures()
    module = Branchy()
    twin = copy.deepcopy(module)
    topo = Topology(nodes=2, per_node=2)
    options = dict(plan="compress", min_compress_bytes=0, dense_from_step=8, log_plan=False)

    def hooked(m: nn.Module, cap: float):
        ddp = DistributedDataParallel(m, find_unused_parameters=True, bucket_cap_mb=cap)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
        return ddp, scaler, gradsync.register_comm_hook(ddp, scheme, topo, grad_scaler=scaler, **options)

    ddp, scaler, state = hooked(module, 0.004)
    expect(state.config.find_unused_parameters, "the hook did not take DDP's find_unused_parameters")
    names = [n for n, _ in module.named_parameters()]
    wanted = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in module.named_parameters()}
    applied = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in module.named_parameters()}
    after: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(10):
        x, y = _batch(step)
        side = _sides(step, rank)
        blow_up = float("inf") if step == 2 and rank == 3 else 1.0
        nn.functional.mse_loss(twin(x, side), y).backward()
        scale = scaler.get_scale()
        scaler.scale(nn.functional.mse_loss(ddp(x, side), y) * blow_up).backward()
        if step != 2:
            for n, p in twin.named_parameters():
                g = p.grad.double().reshape(-1) if p.grad is not None else torch.zeros_like(wanted[n])
                dist.all_reduce(g)
                wanted[n] += g / world
        for n, p in ddp.module.named_parameters():
            if p.grad is None:
                continue
            if step == 2:
                expect(
                    bool(torch.isnan(p.grad).all()), f"{scheme}, step 2, {n}: the overflow did not reach it"
                )
            else:
                applied[n] += p.grad.double().reshape(-1) / scale
        scaler.step(torch.optim.SGD(ddp.parameters(), lr=0.0))
        scaler.update()
        if step == 2:
            expect(scaler.get_scale() < scale, f"{scheme}: rank {rank}'s GradScaler did not skip step 2")
        twin.zero_grad(set_to_none=True)
        ddp.zero_grad(set_to_none=True)
        if step == 4:  # a new DDP model with other buckets, from the saved state
            saved = state.state_dict()
            state.close()
            ddp, scaler, state = hooked(copy.deepcopy(ddp.module), 25.0)
            state.load_state_dict(saved)
        owed = state.owed_gradients()
        after[step] = {n: t.clone() for n, t in owed.items()}
        if step == 2:
            same = after[1].keys() == owed.keys() and all(torch.equal(after[1][n], owed[n]) for n in owed)
            expect(same, f"{scheme}: rank {rank}'s residuals changed in the skipped step")
        for n in names:
            t = owed.get(n)
            total = t.double() if t is not None else torch.zeros_like(wanted[n])
            dist.all_reduce(total)
            err = _relative(applied[n] + total, wanted[n])
            expect(
                err < TOL, f"{scheme} hook, after step {step}, {n}: applied + owed off the mean by {err:.2e}"
            )
            if step in (5, 8, 9):  # a dense iteration (after the load; from dense_from_step on)
                expect(float(total.abs().max()) == 0.0, f"{scheme} hook, after step {step}, {n}: still owed")
    state.close()
    assert not failed, "\n".join(failed)


def check_the_hook_says_when_it_cannot_restore_residuals():
    """A hook made by hand for a DDP model with ``find_unused_parameters=True`` but not told so
    cannot give back what error feedback sent of a parameter no rank used: it says so (once)."""
    import warnings

    module = Branchy()
    ddp = DistributedDataParallel(module, find_unused_parameters=True)
    state, hook = gradsync.ddp_comm_hook(
        "allgather/topk:density=0.1", Topology(nodes=2, per_node=2), model=module, plan="compress",
        min_compress_bytes=0, log_plan=False,
    )  # fmt: skip
    ddp.register_comm_hook(state, hook)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(3):
            x, y = _batch(step)
            nn.functional.mse_loss(ddp(x, step != 2), y).backward()
            ddp.zero_grad(set_to_none=True)
    state.close()
    said = [str(w.message) for w in seen if "find_unused_parameters=True" in str(w.message)]
    assert len(said) == 1 and "side.bias" in said[0], said


def owed_world():
    run_checks(
        named_check(check_every_strategy_records_where_its_residuals_belong),
        named_check(check_nothing_owed_is_lost, "hitopk:density=0.05", label="hitopk"),
        named_check(check_nothing_owed_is_lost, "ring/topk:density=0.05", label="ring"),
        named_check(check_nothing_owed_is_lost, "ps+local/onebit", label="ps+local onebit"),
        named_check(check_nothing_owed_is_lost, "powersgd:rank=2", label="powersgd"),
        named_check(check_momentum_correction_carries_residual_and_momentum),
        named_check(check_the_hook_owes_nothing, "allgather/topk:density=0.1", label="hook topk"),
        named_check(check_the_hook_owes_nothing, "hitopk:density=0.05", label="hook hitopk"),
        named_check(check_the_hook_owes_nothing, "powersgd:rank=2", label="hook powersgd"),
        named_check(check_the_hook_says_when_it_cannot_restore_residuals),
    )


def test_nothing_owed_is_lost_on_four_ranks():
    run_world(WORLD, owed_world)


def test_a_hook_told_find_unused_parameters_needs_the_model():
    with pytest.raises(ValueError, match=r"find_unused_parameters: the DDP hook needs model="):
        gradsync.ddp_comm_hook("topk:density=0.1", find_unused_parameters=True)
