"""LARS and LAMB against float64 references written out here, tensor by tensor, from the papers'
formulas; the param-group helper; state round trips; PTO on 4 ranks against the local optimizer."""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync.collectives.primitives import MismatchError
from gradsync.optim import LAMB, LARS, ParallelTensorOperator, balanced_shares, layerwise_param_groups
from worlds import named_check, run_checks, run_world

SHAPES = [(6, 5), (7,), (3, 4, 2), (5, 5), (9,)]
STEPS = 5
# relative tolerance per parameter dtype: the optimizer computes in float32 (16-bit parameters
# are rounded once per step), the reference in float64 (rounded to the parameter dtype per step)
RTOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _tensors(dtype: torch.dtype, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randn(s, generator=g, dtype=torch.float64) for s in SHAPES]
    ts[1].zero_()  # an all-zero weight: trust ratio 1, no NaN
    return [t.to(dtype) for t in ts]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    gs = [torch.randn(s, generator=g, dtype=torch.float64) * (0.1 + i) for i, s in enumerate(SHAPES)]
    gs[3].zero_()  # an all-zero gradient: trust ratio 1
    return [t.to(dtype) for t in gs]


# groups: layers 0, 1, 2 adapted with weight decay; 3, 4 excluded (no decay, no trust ratio)
ADAPTED = (0, 1, 2)


def _groups(params: list[torch.Tensor], wd: float) -> list[dict]:
    return [
        {"params": [params[i] for i in ADAPTED], "weight_decay": wd},
        {"params": params[3:], "weight_decay": 0.0, "adapt": False},
    ]


def _close(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    exp = expected64.to(dtype).double()  # the reference rounded to the parameter's dtype
    scale = exp.abs().max().item() or 1.0
    err = (actual.double() - exp).abs().max().item()
    assert err <= RTOL[dtype] * scale * 2, f"{what}: max error {err:.3g} at scale {scale:.3g} ({dtype})"


# ---------------------------------------------------------------------------------------- LARS
def lars_reference(w, grads_per_step, lr, m, nesterov, wd, coef, eps, clip, dtype):
    """LARS as the LARS paper's Algorithm 1 writes it, one tensor at a time, in float64."""
    w = [t.double() for t in w]
    v = [torch.zeros_like(t) for t in w]
    for grads in grads_per_step:
        new = []
        for i, (wi, gi) in enumerate(zip(w, grads, strict=True)):
            gi = gi.double()
            adapt = i in ADAPTED
            decay = wd if adapt else 0.0
            ratio = 1.0
            wn, gn = wi.norm().item(), gi.norm().item()
            if adapt and wn > 0 and gn > 0:
                ratio = coef * wn / (gn + decay * wn + eps)
                if clip:
                    ratio = min(ratio / lr, 1.0)
            d = lr * ratio * (gi + decay * wi)
            v[i] = m * v[i] + d
            step = (d + m * v[i]) if nesterov else v[i]
            new.append((wi - step).to(dtype).double())  # stored in the parameter's dtype
        w = new
    return w, v


LARS_CASES = {
    "plain": dict(m=0.9, nesterov=False, wd=1e-3, coef=0.02, eps=1e-8, clip=False),
    "nesterov": dict(m=0.9, nesterov=True, wd=5e-4, coef=0.001, eps=0.0, clip=False),
    "no momentum": dict(m=0.0, nesterov=False, wd=0.0, coef=0.05, eps=1e-8, clip=False),
    "clipped": dict(m=0.8, nesterov=False, wd=1e-4, coef=1.0, eps=1e-8, clip=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", list(LARS_CASES))
def test_lars_matches_float64_reference(case: str, dtype: torch.dtype) -> None:
    c = LARS_CASES[case]
    lr = 0.5
    params = [nn.Parameter(t) for t in _tensors(dtype)]
    opt = LARS(_groups(params, c["wd"]), lr=lr, momentum=c["m"], nesterov=c["nesterov"],
               trust_coefficient=c["coef"], eps=c["eps"], trust_clip=c["clip"])  # fmt: skip
    grads = [_grads(s, dtype) for s in range(STEPS)]
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    ref_w, ref_v = lars_reference(_tensors(dtype), grads, lr, c["m"], c["nesterov"], c["wd"], c["coef"],
                                  c["eps"], c["clip"], dtype)  # fmt: skip
    for i, p in enumerate(params):
        assert p.dtype == dtype
        assert torch.isfinite(p).all()
        _close(p.detach(), ref_w[i], dtype, f"LARS {case} parameter {i}")
        if c["m"]:
            buf = opt.state[p]["momentum_buffer"]
            assert buf.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
            _close(buf, ref_v[i], torch.float64 if dtype == torch.float64 else torch.float32, f"buffer {i}")


def test_lars_trust_clip_takes_the_smaller_of_ratio_and_lr() -> None:
    """LARC's clipping (apex ``LARC(clip=True)``): a layer's rate is min(ratio, lr), written out
    here in float64 for one layer whose ratio is above lr and one whose ratio is below it."""
    lr, coef = 0.1, 1.0
    big = nn.Parameter(torch.full((16,), 2.0, dtype=torch.float64))  # ratio |w| / |g| = 4 > lr
    small = nn.Parameter(torch.full((16,), 0.01, dtype=torch.float64))  # ratio 0.02 < lr
    big.grad = torch.full((16,), 0.5, dtype=torch.float64)
    small.grad = torch.full((16,), 0.5, dtype=torch.float64)
    opt = LARS([big, small], lr=lr, momentum=0.0, trust_coefficient=coef, eps=0.0, trust_clip=True)
    opt.step()
    for p, w0, ratio in ((big, 2.0, 4.0), (small, 0.01, 0.02)):
        rate = min(ratio, lr)  # not lr * min(ratio, 1): that would be 0.1 and 0.002
        torch.testing.assert_close(p.detach(), torch.full((16,), w0 - rate * 0.5, dtype=torch.float64))


def test_lars_fp16_keeps_a_trust_ratio_below_fp16_range() -> None:
    """Paper 03's failure: lr x ratio under fp16's smallest subnormal (6e-8) becomes 0 in fp16.
    Computed in float32, the momentum keeps it."""
    w = nn.Parameter(torch.full((64,), 1e-3, dtype=torch.float16))
    w.grad = torch.full((64,), 10.0, dtype=torch.float16)
    opt = LARS([w], lr=0.01, momentum=0.9, trust_coefficient=1e-3)
    opt.step()
    expected = 0.01 * (1e-3 * (1e-3 * 8) / (10.0 * 8)) * 10.0  # lr * ratio * g, per element
    assert expected < 6e-8
    buf = opt.state[w]["momentum_buffer"]
    assert buf.dtype == torch.float32
    torch.testing.assert_close(buf, torch.full((64,), expected), rtol=1e-3, atol=0)


# ---------------------------------------------------------------------------------------- LAMB
def lamb_reference(w, grads_per_step, lr, b1, b2, eps, wd, coef, cap, bias_correction, dtype):
    """LAMB as its paper's Algorithm 2 writes it (phi = identity capped at ``cap``), in float64."""
    w = [t.double() for t in w]
    m = [torch.zeros_like(t) for t in w]
    v = [torch.zeros_like(t) for t in w]
    for t, grads in enumerate(grads_per_step, start=1):
        new = []
        for i, (wi, gi) in enumerate(zip(w, grads, strict=True)):
            gi = gi.double()
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            mh, vh = (m[i] / (1 - b1**t), v[i] / (1 - b2**t)) if bias_correction else (m[i], v[i])
            adapt = i in ADAPTED
            u = mh / (vh.sqrt() + eps) + (wd if adapt else 0.0) * wi
            ratio = 1.0
            wn, un = wi.norm().item(), u.norm().item()
            if adapt and wn > 0 and un > 0:
                ratio = min(coef * wn / un, cap)
            new.append((wi - lr * ratio * u).to(dtype).double())
        w = new
    return w, m, v


LAMB_CASES = {
    "plain": dict(b1=0.9, b2=0.999, eps=1e-6, wd=0.01, coef=1.0, cap=math.inf, bc=True),
    "capped, no bias correction": dict(b1=0.8, b2=0.99, eps=1e-8, wd=0.0, coef=0.5, cap=0.3, bc=False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_matches_float64_reference(case: str, dtype: torch.dtype) -> None:
    c = LAMB_CASES[case]
    lr = 0.01
    params = [nn.Parameter(t) for t in _tensors(dtype)]
    opt = LAMB(_groups(params, c["wd"]), lr=lr, betas=(c["b1"], c["b2"]), eps=c["eps"],
               trust_coefficient=c["coef"], max_trust_ratio=None if math.isinf(c["cap"]) else c["cap"],
               bias_correction=c["bc"])  # fmt: skip
    grads = [_grads(s, dtype) for s in range(STEPS)]
    for gs in grads:
        for p, g in zip(params, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    ref_w, ref_m, ref_v = lamb_reference(_tensors(dtype), grads, lr, c["b1"], c["b2"], c["eps"], c["wd"],
                                         c["coef"], c["cap"], c["bc"], dtype)  # fmt: skip
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for i, p in enumerate(params):
        assert torch.isfinite(p).all()
        _close(p.detach(), ref_w[i], dtype, f"LAMB {case} parameter {i}")
        assert opt.state[p]["exp_avg"].dtype == state_dtype
        _close(opt.state[p]["exp_avg"], ref_m[i], state_dtype, f"exp_avg {i}")
        _close(opt.state[p]["exp_avg_sq"], ref_v[i], state_dtype, f"exp_avg_sq {i}")


@pytest.mark.parametrize("cls", [LARS, LAMB])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_zero_weights_and_gradients_stay_finite(cls: type, dtype: torch.dtype) -> None:
    params = [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES]
    opt = cls(params, lr=0.1, weight_decay=0.01)
    for _ in range(3):
        for p in params:
            p.grad = torch.zeros_like(p)
        opt.step()
    for p in params:
        assert torch.equal(p.detach(), torch.zeros_like(p))


# ---------------------------------------------------------------------------------------- state
def _train(opt_factory, dtype: torch.dtype, steps: range, model: nn.Module, opt=None):
    opt = opt or opt_factory(model)
    g = torch.Generator().manual_seed(7)
    xs = [torch.randn(8, 6, generator=g).to(dtype) for _ in range(10)]
    for s in steps:
        opt.zero_grad()
        model(xs[s]).float().pow(2).mean().backward()
        opt.step()
    return opt


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3)).to(dtype)


FACTORIES = {
    "lars": lambda m: LARS(layerwise_param_groups(m, 1e-3), lr=0.3, momentum=0.9, trust_coefficient=0.01),
    "lamb": lambda m: LAMB(layerwise_param_groups(m, 1e-2), lr=0.01),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(FACTORIES))
def test_state_dict_round_trip_resumes_bit_identically(name: str, dtype: torch.dtype) -> None:
    factory = FACTORIES[name]
    straight = _model(dtype)
    _train(factory, dtype, range(10), straight)

    first = _model(dtype)
    opt = _train(factory, dtype, range(5), first)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "optimizer": opt.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    resumed = _model(dtype)
    resumed.load_state_dict(saved["model"])
    opt2 = factory(resumed)
    opt2.load_state_dict(saved["optimizer"])
    for state in opt2.state.values():  # 16-bit parameters keep float32 state through the load
        for v in state.values():
            if v.dim():
                assert v.dtype == torch.float32
    _train(factory, dtype, range(5, 10), resumed, opt2)
    for a, b in zip(straight.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_lr_scheduler_drives_the_rate() -> None:
    w = nn.Parameter(torch.ones(4))
    opt = LARS([w], lr=1.0, momentum=0.0, trust_coefficient=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5**s)
    moves = []
    for _ in range(3):
        before = w.detach().clone()
        w.grad = torch.ones(4)
        opt.step()
        sched.step()
        moves.append((before - w.detach()).norm().item())
    # ratio = |w| / |g|, so each move is lr * |w|: with |w| shrinking and lr halving
    assert moves[1] < moves[0] / 2 + 1e-6 and moves[2] < moves[1] / 2 + 1e-6


BAD = [
    (lambda p: LARS(p, lr=-1.0), "lr"),
    (lambda p: LARS(p, momentum=1.0), "momentum"),
    (lambda p: LARS(p, momentum=0.0, nesterov=True), "nesterov"),
    (lambda p: LARS(p, trust_coefficient=0.0), "trust_coefficient"),
    (lambda p: LARS(p, eps=-1e-8), "eps"),
    (lambda p: LARS(p, weight_decay=-0.1), "weight_decay"),
    (lambda p: LARS(p, parallel="world"), "parallel"),
    (lambda p: LAMB(p, betas=(0.9, 1.0)), "betas"),
    (lambda p: LAMB(p, betas=(0.9,)), "betas"),
    (lambda p: LAMB(p, max_trust_ratio=0.0), "max_trust_ratio"),
    (lambda p: LAMB(p, eps="1e-6"), "eps"),
]


@pytest.mark.parametrize("make,name", BAD, ids=[f"{i}-{n}" for i, (_, n) in enumerate(BAD)])
def test_bad_arguments_name_the_parameter(make, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        make([nn.Parameter(torch.ones(3))])


def test_integer_parameters_and_sparse_gradients_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"params must be floating point tensors, got one of dtype torch\.int64"
    ):
        LARS([torch.ones(3, dtype=torch.int64)])
    emb = nn.Embedding(10, 4, sparse=True)
    opt = LAMB(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="LAMB does not support sparse gradients"):
        opt.step()
    with pytest.raises(ValueError, match="parts must be >= 1, got 0"):
        balanced_shares([1, 2], 0)


def test_parallel_without_a_process_group_says_so() -> None:
    with pytest.raises(RuntimeError, match="process group"):
        LARS([nn.Parameter(torch.ones(3))], parallel=True)


# ---------------------------------------------------------------------------------------- groups
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.conv = nn.Conv2d(1, 2, 3)
        self.bn = nn.BatchNorm2d(2)
        self.fc = nn.Linear(4, 10)
        self.ln = nn.LayerNorm(4, elementwise_affine=True)
        self.scale = nn.Parameter(torch.ones(4))  # a custom 1-D gain
        self.frozen = nn.Linear(2, 2)
        self.frozen.requires_grad_(False)
        self.fc.weight = self.emb.weight  # tied


def test_layerwise_param_groups_leave_biases_and_norms_out() -> None:
    net = _Net()
    groups = layerwise_param_groups(net, 5e-4, lr=0.2)
    names: dict[int, str] = {}
    for n, p in net.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)  # a tied parameter by its first name
    adapted = sorted(names[id(p)] for p in groups[0]["params"])
    excluded = sorted(names[id(p)] for p in groups[1]["params"])
    assert adapted == ["conv.weight", "emb.weight"]  # the tied fc.weight once
    assert excluded == ["bn.bias", "bn.weight", "conv.bias", "fc.bias", "ln.bias", "ln.weight", "scale"]
    assert groups[0]["weight_decay"] == 5e-4 and groups[0]["adapt"] and groups[0]["lr"] == 0.2
    assert groups[1]["weight_decay"] == 0.0 and not groups[1]["adapt"]


def test_balanced_shares_cover_every_layer_once_and_balance() -> None:
    sizes = [9408, 64, 64, 4096, 64, 64, 36864, 64, 64, 16384, 256, 256, 2048000, 1000]
    for parts in (1, 2, 3, 4, 8, 32):
        shares = balanced_shares(sizes, parts)
        assert len(shares) == parts
        assert [i for s in shares for i in s] == list(range(len(sizes)))
        loads = [sum(sizes[i] for i in s) for s in shares]
        assert max(loads) <= sum(sizes) / parts + max(sizes)
    assert [len(s) for s in balanced_shares([1, 1, 1, 1], 2)] == [2, 2]
    assert [len(s) for s in balanced_shares([5], 3)] == [1, 0, 0]
    from gradsync.optim.parallel import largest_share

    # [1, 1, 1, 1] in two shares of two layers: half the elements, two values each
    assert largest_share([1, 1, 1, 1], 2) == (0.5, 2)
    # one layer of 5 on three ranks: one rank does all of it, the others contribute padding
    assert largest_share([5], 3) == (1.0, 1)
    assert largest_share([6, 2, 2], 2) == (0.6, 2)  # 6 alone, then 2 + 2 in two layers


# ---------------------------------------------------------------------------------------- PTO
def _pto_model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(11)
    layers = [nn.Linear(12, 32), nn.LayerNorm(32), nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 7)]
    return nn.Sequential(*layers).to(dtype)


def check_pto_equals_local(cls: type, dtype: torch.dtype, group: dist.ProcessGroup | None) -> None:
    local_model, pto_model = _pto_model(dtype), _pto_model(dtype)
    kw = {"lr": 0.2, "trust_coefficient": 0.02} if cls is LARS else {"lr": 0.01}
    local = cls(layerwise_param_groups(local_model, 1e-3), **kw)
    pto = cls(layerwise_param_groups(pto_model, 1e-3), parallel=group if group is not None else True, **kw)
    g = torch.Generator().manual_seed(5)  # the same data on every rank: synchronized gradients
    for _ in range(4):
        x = torch.randn(16, 12, generator=g).to(dtype)
        for model, opt in ((local_model, local), (pto_model, pto)):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
    for a, b in zip(local_model.parameters(), pto_model.parameters(), strict=True):
        assert torch.equal(a, b), f"{cls.__name__} {dtype}: PTO differs from local by {(a - b).abs().max()}"


def check_pto_shares_the_work() -> None:
    """Each rank computes norms for its share only: a rank's own layers are the ones in its share."""
    op = ParallelTensorOperator()
    sizes = [100, 100, 100, 100, 400]
    seen: list[range] = []

    def compute(share: range) -> torch.Tensor:
        seen.append(share)
        return torch.tensor([float(i * 10 + dist.get_rank()) for i in share])

    out = op.map(sizes, compute, torch.float32, torch.device("cpu"))
    shares = balanced_shares(sizes, dist.get_world_size())
    mine = shares[dist.get_rank()]
    assert seen == ([mine] if len(mine) else [])  # on 4 ranks the last share is empty: no call
    owner = {i: r for r, s in enumerate(shares) for i in s}
    assert out.tolist() == [float(i * 10 + owner[i]) for i in range(len(sizes))]


def check_pto_layout_mismatch_fails_on_every_rank() -> None:
    op = ParallelTensorOperator()
    sizes = [10, 20] if dist.get_rank() else [10, 21]
    with pytest.raises(MismatchError, match="layout"):
        op.map(sizes, lambda s: torch.zeros(len(s)), torch.float32, torch.device("cpu"))


def check_ddp_script_with_lars_pto(dtype: torch.dtype) -> None:
    """A plain DDP script, as PyTorch's docs write one, with gradsync's LARS (PTO over the world)
    as its optimizer: each rank trains on its quarter of every batch; the result matches one
    process training on the whole batch with the local LARS."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DDP(_pto_model(dtype))
    reference = _pto_model(dtype)
    opt = LARS(layerwise_param_groups(ddp.module, 1e-3), lr=0.2, trust_coefficient=0.02, parallel=True)
    ref_opt = LARS(layerwise_param_groups(reference, 1e-3), lr=0.2, trust_coefficient=0.02)
    g = torch.Generator().manual_seed(8)
    for _ in range(3):
        x = torch.randn(32, 12, generator=g).to(dtype)
        shard = x.chunk(world)[rank]
        opt.zero_grad()
        ddp(shard).float().pow(2).mean().backward()
        opt.step()
        ref_opt.zero_grad()
        reference(x).float().pow(2).mean().backward()
        ref_opt.step()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(ddp.module.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def _pto_world() -> None:
    sub = dist.new_group([0, 1])  # every rank creates it; ranks 2, 3 are not in it
    checks = [
        named_check(check_pto_equals_local, cls, dtype, None, label=f"{cls.__name__}-{dtype}")
        for cls in (LARS, LAMB)
        for dtype in (torch.float32, torch.bfloat16)
    ]
    checks += [
        named_check(check_ddp_script_with_lars_pto, dtype, label=str(dtype))
        for dtype in (torch.float32, torch.bfloat16)
    ]
    checks.append(named_check(check_pto_shares_the_work))
    checks.append(named_check(check_pto_layout_mismatch_fails_on_every_rank))
    run_checks(*checks)
    if dist.get_rank() < 2:
        subgroup = named_check(check_pto_equals_local, LARS, torch.float32, sub, label="subgroup")
        run_checks(subgroup, together=False)
    dist.barrier()


def test_pto_on_four_ranks_equals_the_local_optimizer() -> None:
    run_world(4, _pto_world)


# ---------------------------------------------------------------------------------------- bench
@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--models", "vgg99"], "--models takes names from resnet50, bert-base"),
        (["--contenders", "lars"], "--contenders must include sgd"),
        (["--contenders", "sgd,lion"], "--contenders takes names from floor, sgd"),
        (["--dtype", "float8"], "--dtype must be one of float32, bfloat16"),
        (["--rounds", "0"], "--rounds must be at least 1"),
    ],
)
def test_bench_optim_option_errors(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from gradsync.apps.commands import main

    assert main(["bench", "optim", *extra]) == 2
    assert message in capsys.readouterr().err


def test_bench_optim_runs_every_contender_on_resnet50_shapes(tmp_path, capsys) -> None:
    import json

    from gradsync.apps.commands import main

    out = tmp_path / "optim.json"
    argv = ["bench", "optim", "--models", "resnet50", "--rounds", "1", "--steps", "1", "--dtype", "bfloat16"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["contender"] for r in rows] == ["floor", "sgd", "lars", "lars-loop", "adamw", "lamb"]
    assert all(r["tensors"] == 161 and r["dtype"] == "bfloat16" and r["ms"] > 0 for r in rows)
    assert next(r for r in rows if r["contender"] == "sgd")["x_sgd"] == 1.0
    assert "| resnet50 | 161 | bfloat16 | lars |" in capsys.readouterr().out


def _bench_pto_world(path: str) -> None:
    from gradsync.apps.commands import main

    argv = ["bench", "pto", "--models", "resnet50", "--scales", "0.001,0.01", "--rounds", "1", "--reps", "1"]
    assert main([*argv, "--json", path]) == 0


def test_bench_pto_times_both_paths_and_predicts(tmp_path) -> None:
    import json

    path = tmp_path / "pto.json"
    run_world(2, _bench_pto_world, str(path))
    result = json.loads(path.read_text())
    assert result["world"] == 2 and [r["scale"] for r in result["rows"]] == [0.001, 0.01]
    for r in result["rows"]:
        assert r["layers"] == 54 and r["local_ms"] > 0 and r["pto_ms"] > 0 and r["predicted_pto_ms"] > 0
        assert 0.5 <= r["largest_share"] < 1.0  # two ranks: the larger share of the elements


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--models", "alexnet"], "--models takes names from resnet50, bert-base"),
        (["--scales", "0,1"], "--scales takes positive numbers"),
        (["--scales", "x"], "--scales takes positive numbers"),
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--emulate", "2by2"], "--emulate takes NODESxPER_NODE"),
    ],
)
def test_bench_pto_option_errors(extra: list[str], message: str, capsys, monkeypatch) -> None:
    from gradsync.apps.commands import main

    monkeypatch.delenv("RANK", raising=False)
    assert main(["bench", "pto", *extra]) == 2
    assert message in capsys.readouterr().err


def test_tensor_norms_of_mixed_dtypes_in_float32_or_float64() -> None:
    from gradsync.optim import tensor_norms

    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(50, generator=g, dtype=torch.float64) * 300 for _ in range(4)]
    mixed = [ts[0].float(), ts[1].to(torch.bfloat16), ts[2], ts[3].half()]
    out = tensor_norms(mixed)
    assert out.dtype == torch.float64  # one float64 tensor: the vector holds float64
    expected = torch.stack([t.double().norm() for t in mixed])  # of the values as stored
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    half = tensor_norms([torch.full((70000,), 1.0, dtype=torch.float16)])
    assert half.dtype == torch.float32 and half.item() == pytest.approx(70000**0.5)  # 70000 > fp16 max
