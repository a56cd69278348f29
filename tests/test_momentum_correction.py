"""DGC's recipe (paper 04, Algorithm 4): momentum correction and factor masking in the error
feedback, the optimizer's momentum for what is sent densely, and the density schedule (sparsity
warm-up). The 2-rank world runs the algorithm written out plainly below, step by step, next to
gradsync and compares every gradient."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.collectives import Topology
from gradsync.sync import SyncConfig
from gradsync.sync.density_schedule import DensitySchedule
from gradsync.sync.momentum import NEGLIGIBLE, SyncMomentum
from worlds import named_check, run_checks, run_world


# ------------------------------------------------------------------------------------------ units
@pytest.mark.parametrize("nesterov", [False, True])
def test_dense_momentum_is_torch_sgd_momentum_and_decays_after(nesterov):
    """Dense steps give the update torch.optim.SGD(momentum) would take; later steps whose
    gradient went elsewhere (zero here) release the momentum as SGD would with zero gradients."""
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=g) for _ in range(3)] + [torch.zeros(5, 3)] * 4
    p = torch.zeros(5, 3, requires_grad=True)
    sgd = torch.optim.SGD([p], lr=1.0, momentum=0.9, nesterov=nesterov)
    mine = SyncMomentum(0.9, nesterov)
    for step, grad in enumerate(grads):
        before = p.detach().clone()
        p.grad = grad.clone()
        sgd.step()
        expected = before - p.detach()  # SGD's update
        got = grad.clone() * 1024.0  # carrying a loss scale
        mine.begin_round()
        (mine.dense if step < 3 else mine.release)(["p"], [got], 1024.0)
        torch.testing.assert_close(got / 1024.0, expected, rtol=1e-5, atol=1e-6)


def test_momentum_rolls_back_and_is_dropped_once_negligible():
    mine = SyncMomentum(0.5)
    mine.begin_round()
    mine.dense(["a", "b"], [torch.ones(3), torch.ones(2)])
    saved = mine.state_dict()
    mine.begin_round()
    mine.dense(["a", "b"], [torch.full((3,), 7.0), torch.full((2,), 7.0)])
    mine.rollback_round({"b"})  # an unused parameter: only its update goes back
    assert torch.equal(mine.velocity["b"], torch.ones(2))
    assert torch.equal(mine.velocity["a"], torch.full((3,), 7.5))
    mine.rollback_round()  # an overflow: everything goes back
    assert torch.equal(mine.velocity["a"], torch.ones(3))
    other = SyncMomentum(0.5)
    other.load_state_dict(saved)
    assert torch.equal(other.velocity["a"], torch.ones(3))
    with pytest.raises(ValueError, match=r"saved with momentum=0\.5, nesterov=False, but this engine has"):
        SyncMomentum(0.9).load_state_dict(saved)
    steps = math.ceil(math.log(NEGLIGIBLE) / math.log(0.5))
    for _ in range(steps):
        mine.begin_round()
        mine.release(["a", "b"], [torch.zeros(3), torch.zeros(2)])
    assert mine.velocity == {}


def test_density_schedule_stages():
    exp = DensitySchedule.parse("exp@50")
    assert exp.stages_for(0.01) == (0.25, 0.0625, 0.015625)
    assert exp.stages_for(0.001) == (0.25, 0.0625, 0.015625, 0.00390625)  # paper 04's list
    assert [exp.density_at(s, 0.01) for s in (0, 49, 50, 149, 150)] == [0.25, 0.25, 0.0625, 0.015625, None]
    given = DensitySchedule.parse("25%, 6.25% ,0.02@10")
    assert given.stages_for(0.02) == (0.25, 0.0625)  # a stage at the codec's own density is skipped
    assert given.end_step([0.02, 0.001]) == 30


@pytest.mark.parametrize(
    "text, message",
    [
        ("exp", "needs '@STEPS'"),
        ("exp@0", "at least 1 step per stage"),
        ("exp@1.5", "whole number of steps"),
        ("25%,50%@3", "falling densities"),
        ("0@3", "outside \\(0, 1\\]"),
        ("150%@3", "outside \\(0, 1\\]"),
        ("quarter@3", "'quarter', not a density"),
    ],
)
def test_bad_density_schedules_name_the_option_and_the_forms(text, message):
    with pytest.raises(ValueError, match=f"sync: density_schedule .*{message}.*write 'exp@STEPS' or"):
        SyncConfig(density_schedule=text)


@pytest.mark.parametrize(
    "options, message",
    [
        (
            {"scheme": "dgc:density=0.01+ef:momentum=0.9"},
            "ef momentum \\(momentum correction\\) needs gradsync.wrap",
        ),
        (
            {"scheme": "powersgd:rank=2", "density_schedule": "exp@5"},
            "density_schedule='exp@5' needs a sparsifier",
        ),
        ({"scheme": "topk:k=10", "density_schedule": "exp@5"}, "density_schedule='exp@5' needs a sparsifier"),
    ],
)
def test_the_ddp_hook_refuses_what_it_cannot_do(options, message):
    with pytest.raises(ValueError, match=message):
        gradsync.ddp_comm_hook(**options)


# ------------------------------------------------------------------------------------ on 2 ranks
M = 0.9
DENSITY = 0.05
WARM = 0.25  # density_schedule "25%@3": steps 0-2 (step 0 is dense), then DENSITY


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 64), nn.Tanh(), nn.Linear(64, 4))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    return torch.randn(16, 64, generator=g), torch.randn(16, 4, generator=g)


def _algorithm4(nesterov: bool) -> list[str]:
    """Algorithm 4 per tensor (each tensor its own bucket, as the paper selects per layer), both
    ranks simulated on every rank from their local gradients, in float32 with the paper's order of
    operations so that the selections match exactly; the update is the mean of what both ranks
    sent. Tensors below min_compress_bytes, and the dense first step, get momentum SGD on the
    mean gradient instead, whose momentum then decays into the later updates."""
    world = dist.get_world_size()
    spec = f"allgather/topk:density={DENSITY}+ef:momentum={M}" + (",nesterov=true" if nesterov else "")
    model = gradsync.wrap(
        _model(), spec, Topology(nodes=2, per_node=1), plan="compress", bucket_bytes=1,
        min_compress_bytes=4096, density_schedule=f"{100 * WARM:g}%@3", calibrate=False, log_plan=False,
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # the momentum is in the synchronization
    names = [n for n, _ in model.module.named_parameters()]
    compressible = {n for n, p in model.module.named_parameters() if p.numel() * 4 >= 4096}
    V = {(r, n): None for r in range(world) for n in names}  # residuals, per rank
    U = {(r, n): None for r in range(world) for n in names}  # momenta, per rank
    D: dict[str, torch.Tensor] = {}  # momentum of the dense steps (the same on every rank)
    failed = []
    for step in range(8):
        x, y = _batch(step)
        twin = copy.deepcopy(model.module)
        nn.functional.mse_loss(twin(x), y).backward()
        mine = torch.cat([p.grad.reshape(-1) for p in twin.parameters()])
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        sizes = [p.numel() for p in twin.parameters()]
        G = {(r, n): part for r in range(world) for n, part in zip(names, every[r].split(sizes), strict=True)}
        density = WARM if step < 3 else DENSITY
        expected = {}
        for n in names:
            mean = sum(G[(r, n)].double() for r in range(world)) / world
            if step == 0 or n not in compressible:  # momentum SGD on the mean gradient
                D[n] = mean if n not in D else M * D[n] + mean
                expected[n] = mean + M * D[n] if nesterov else D[n]
                continue
            sent = torch.zeros_like(mean)
            for r in range(world):
                g = G[(r, n)]
                u = U[(r, n)] if U[(r, n)] is not None else torch.zeros_like(g)
                v = V[(r, n)] if V[(r, n)] is not None else torch.zeros_like(g)
                if nesterov:  # DGC's form (see the note in docs/papers.md)
                    u = (u + g) * M
                    v = (v + u) + g
                else:
                    u = u * M + g
                    v = v + u
                k = max(1, math.ceil(density * v.numel()))
                mask = torch.zeros_like(v, dtype=torch.bool)
                mask[v.abs().topk(k).indices] = True
                sent += torch.where(mask, v, 0).double()
                V[(r, n)] = torch.where(mask, 0, v)
                U[(r, n)] = torch.where(mask, 0, u)
            expected[n] = sent / world
            D[n] = M * D[n]  # the dense step's momentum, released
            expected[n] += M * D[n] if nesterov else D[n]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        for n, p in model.module.named_parameters():
            ref = expected[n]
            err = float((p.grad.double().reshape(-1) - ref).abs().max() / ref.abs().max())
            if not err < 1e-5:
                failed.append(f"nesterov={nesterov}, step {step}, {n}: off Algorithm 4 by {err:.2e}")
        stats = model.last_stats
        want = None if step == 0 or step >= 3 else WARM
        if stats.density != want:
            failed.append(f"step {step}: the stats say density {stats.density}, expected {want}")
        opt.step()
    model.close()
    return failed


def check_algorithm4_momentum():
    failed = _algorithm4(nesterov=False)
    assert not failed, "\n".join(failed)


def check_algorithm4_nesterov():
    failed = _algorithm4(nesterov=True)
    assert not failed, "\n".join(failed)


def algorithm4_world():
    run_checks(named_check(check_algorithm4_momentum), named_check(check_algorithm4_nesterov))


def test_momentum_correction_is_algorithm4_on_two_ranks():
    run_world(2, algorithm4_world)


def one_rank_world():
    """Alone, momentum correction is momentum SGD (nothing is compressed), and the options a
    scheme cannot follow are refused."""
    model = gradsync.wrap(_model(), "dgc:density=0.01+ef:momentum=0.9,nesterov=true", log_plan=False)
    reference = copy.deepcopy(model.module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    for step in range(4):
        x, y = _batch(step)
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)
    model.close()
    with pytest.raises(
        ValueError, match="density_schedule='exp@5' needs a sparsifier configured by a density"
    ):
        gradsync.wrap(_model(), "powersgd:rank=2", density_schedule="exp@5")
    with pytest.raises(ValueError, match="ef: momentum must be the same for every codec"):
        gradsync.wrap(_model(), "dgc+ef:momentum=0.9", large_codec="topk", large_bytes=1024)


def test_one_rank_momentum_correction_is_momentum_sgd():
    run_world(1, one_rank_world)


def test_momentum_of_bf16_gradients_is_kept_in_float32():
    """A bf16 model's gradients: the momentum is float32 (not rounded to bf16 every step) and
    the update is the float32 formula rounded once."""
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(64, generator=g) for _ in range(5)]
    mine = SyncMomentum(0.9)
    u = torch.zeros(64, dtype=torch.float64)
    for grad in grads:
        u = 0.9 * u + grad.bfloat16().double()
        got = grad.bfloat16()
        mine.begin_round()
        mine.dense(["w"], [got])
        assert mine.velocity["w"].dtype == torch.float32 and got.dtype == torch.bfloat16
        torch.testing.assert_close(mine.velocity["w"].double(), u, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got.double(), u.bfloat16().double(), rtol=0, atol=0)
