"""Local gradient clipping (paper 04): each rank clips its own gradient to threshold / sqrt(N)
before error feedback and synchronization; checked against float64 references written here."""

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
from gradsync.sync.clipping import clip_, total_norm
from worlds import named_check, run_checks, run_world


# ------------------------------------------------------------------------------------------ units
def test_the_norm_of_mixed_dtypes_is_taken_in_float32_or_float64():
    g = torch.Generator().manual_seed(0)
    ts = [
        torch.randn(1000, generator=g).bfloat16(),
        torch.randn(7, 3, generator=g),
        torch.randn(5, generator=g, dtype=torch.float64),
    ]
    reference = math.sqrt(sum(float(t.double().square().sum()) for t in ts))
    assert float(total_norm(ts)) == pytest.approx(reference, rel=1e-6)
    assert float(total_norm([])) == 0.0


def test_clip_scales_to_the_bound_and_leaves_small_gradients_alone():
    ts = [torch.full((4,), 3.0), torch.full((9,), 4.0 / 3)]  # norm sqrt(36 + 16) = sqrt(52)
    factor = clip_(ts, 1.0)
    assert float(factor) == pytest.approx(1.0 / (math.sqrt(52) + 1e-6))
    assert float(total_norm(ts)) == pytest.approx(1.0, rel=1e-5)
    small = [torch.full((4,), 0.1)]
    assert float(clip_(small, 1.0)) == 1.0 and torch.equal(small[0], torch.full((4,), 0.1))
    # a gradient of a loss scaled by 1024 is compared with the bound after unscaling
    scaled = [torch.full((4,), 0.1 * 1024)]
    assert float(clip_(scaled, 1.0, loss_scale=1024.0)) == 1.0
    # non-finite stays non-finite (the overflow check must still see it)
    bad = [torch.tensor([1.0, float("inf")])]
    clip_(bad, 1.0)
    assert not bool(torch.isfinite(bad[0]).all())


@pytest.mark.parametrize(
    "options, message",
    [
        ({"clip_local": "0"}, "clip_local must be a positive number or None, got 0.0"),
        ({"clip_local": "-1"}, "clip_local must be a positive number"),
        ({"clip_local": "inf"}, "clip_local must be a positive number"),
        ({"clip_local_mode": "layer"}, "clip_local_mode must be one of global, bucket; got 'layer'"),
    ],
)
def test_bad_clipping_options_name_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        SyncConfig.from_options(options)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"clip_local": 1.0}, "clip_local: local gradient clipping needs gradsync.wrap"),
        ({"scheme": "auto:candidates=topk|powersgd"}, "candidates need gradsync.wrap"),
        (
            {"scheme": "topk:density=0.01", "large_codec": "powersgd:rank=1"},
            "large_codec='powersgd:rank=1': a codec",
        ),
        ({"scheme": "topk:density=0.01", "partitions": 2}, "partitions=2: splitting a compressed bucket"),
    ],
)
def test_the_ddp_hook_refuses_what_it_cannot_do(options, message):
    with pytest.raises(ValueError, match=message):
        gradsync.ddp_comm_hook(**options)


# ------------------------------------------------------------------------------------ on 2 ranks
def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 128), nn.Tanh(), nn.Linear(128, 8))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    # rank 1's inputs are 10x larger: its gradient is clipped hard, rank 0's barely or not at all
    g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
    scale = 10.0 if dist.get_rank() == 1 else 1.0
    return scale * torch.randn(16, 256, generator=g), torch.randn(16, 8, generator=g)


def _top(v: torch.Tensor, density: float) -> torch.Tensor:
    k = max(1, math.ceil(density * v.numel()))
    out = torch.zeros_like(v, dtype=torch.float64)
    idx = v.abs().topk(k).indices
    out[idx] = v[idx].double()
    return out


def _clipping_steps(mode: str) -> list[str]:
    """Two steps (dense, then the first compressed one) under clip_local=THR in ``mode``,
    against a float64 reference: clip each rank's local gradient (all of it, or bucket by
    bucket, to the bucket's share of THR / sqrt(N)), then top 5 % of each compressible bucket
    (the residual is still zero), then the mean over the ranks."""
    world = dist.get_world_size()
    thr = 0.5
    model = gradsync.wrap(
        _model(), topology=Topology(nodes=2, per_node=1), scheme="allgather/topk:density=0.05",
        plan="compress", calibrate=False, bucket_bytes=100_000, clip_local=thr, clip_local_mode=mode,
        log_plan=False,
    )  # fmt: skip
    engine = model.engine
    names = [s.name for s in engine.slots]
    failed: list[str] = []
    total = sum(s.numel for s in engine.slots)
    for step in range(2):
        buckets = [[s.index for s in b.slots] for b in engine._buckets]  # as this step runs them
        compressed = list(engine._compress) if step > 0 else [False] * len(buckets)
        x, y = _batch(step)
        twin = copy.deepcopy(model.module)
        nn.functional.mse_loss(twin(x), y).backward()
        local = {n: p.grad.double().reshape(-1) for n, p in twin.named_parameters()}
        if mode == "global":
            norm = math.sqrt(sum(float(v.square().sum()) for v in local.values()))
            factor = min(1.0, thr / math.sqrt(world) / (norm + 1e-6))
            local = {n: v * factor for n, v in local.items()}
            factors = [factor]
        else:
            factors = []
            for members in buckets:
                ns = [names[i] for i in members]
                norm = math.sqrt(sum(float(local[n].square().sum()) for n in ns))
                share = math.sqrt(sum(local[n].numel() for n in ns) / total)
                factor = min(1.0, thr / math.sqrt(world) * share / (norm + 1e-6))
                factors.append(factor)
                for n in ns:
                    local[n] = local[n] * factor
        sent = dict(local)
        for members, comp in zip(buckets, compressed, strict=True):
            if comp:
                ns = [names[i] for i in members]
                flat = _top(torch.cat([local[n] for n in ns]).float(), 0.05)
                for n, part in zip(ns, flat.split([local[n].numel() for n in ns]), strict=True):
                    sent[n] = part
        nn.functional.mse_loss(model(x), y).backward()
        for n, p in model.module.named_parameters():
            ref = sent[n].clone()
            dist.all_reduce(ref)
            ref /= world
            err = float((p.grad.double().reshape(-1) - ref).abs().max() / ref.abs().max())
            if not err < 1e-5:
                failed.append(f"{mode}, step {step}, {n}: off the reference by {err:.2e}")
        stats = engine.last_stats
        assert stats is not None
        if mode == "global" and stats.launched_in_backward != 0:
            failed.append(f"global, step {step}: {stats.launched_in_backward} buckets launched in backward")
        if mode == "bucket" and stats.launched_in_backward == 0:
            failed.append(f"bucket, step {step}: no bucket launched in backward (the overlap is lost)")
        # the test clips for real on rank 1 (a factor well below 1), not at all or little on rank 0
        smallest = torch.tensor([min(factors)])
        everyone = [torch.zeros(1) for _ in range(world)]
        dist.all_gather(everyone, smallest)
        if not float(everyone[1]) < 0.5:
            failed.append(f"{mode}, step {step}: rank 1 was hardly clipped (factor {float(everyone[1]):.2f})")
        model.zero_grad(set_to_none=True)
    model.close()
    return failed


def check_global_local_clipping():
    failed = _clipping_steps("global")
    assert not failed, "\n".join(failed)


def check_bucket_local_clipping():
    failed = _clipping_steps("bucket")
    assert not failed, "\n".join(failed)


def clipping_world():
    run_checks(named_check(check_global_local_clipping), named_check(check_bucket_local_clipping))


def test_local_clipping_on_two_ranks_against_float64():
    run_world(2, clipping_world)


def one_rank_world():
    """A world of one rank synchronizes nothing, and clip_local is then plain clipping, once per
    backward pass, as torch.nn.utils.clip_grad_norm_ does it; inside no_sync nothing is clipped."""
    model = gradsync.wrap(_model(), clip_local=0.5, log_plan=False)
    reference = copy.deepcopy(model.module)
    g = torch.Generator().manual_seed(0)
    x, y = 10 * torch.randn(16, 256, generator=g), torch.randn(16, 8, generator=g)
    with model.no_sync():
        nn.functional.mse_loss(model(x), y).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    for p, q in zip(model.module.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), "no_sync clipped"
    nn.functional.mse_loss(model(x), y).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    for p, q in zip(model.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)
    model.close()


def test_one_rank_clips_like_clip_grad_norm():
    run_world(1, one_rank_world)
