"""1-bit Adam, 0/1 Adam and 1-bit LAMB (gradsync.optim): checked against independent references.

One spawned 2-rank gloo world runs the multi-process checks: the warm-up equals torch's AdamW
(and gradsync's LAMB) fed the all-reduced gradient; the compressed stage with the lossless
``none`` codec equals a float64 frozen-variance Adam written out here; with ``onebit``, error
feedback's invariant on both stages and bit-identical ranks; state_dict round trips; the bytes
counted equal the payload formula; bf16 parameters. The train CLI runs a short 2-rank job.
"""

from __future__ import annotations

import io
import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync.codecs import HEADER_BYTES
from gradsync.collectives.primitives import AGREEMENT_WORDS, record_traffic
from gradsync.optim import LAMB, OneBitAdam, OneBitLamb, ZeroOneAdam
from worlds import expect_all, run_checks, run_world, same_on_every_rank

pytestmark = pytest.mark.timeout(300)

B1, B2, EPS, WD, LR = 0.9, 0.99, 1e-8, 0.01, 0.01
SHAPES = [(6, 5), (5,), (7, 3)]


def _params(dtype: torch.dtype = torch.float32) -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]


def _grads(step: int, rank: int) -> list[torch.Tensor]:
    """Rank- and step-dependent gradients (the same on every call)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return [torch.randn(s, generator=g) * (1 + rank) for s in SHAPES]


def _set_grads(params: list[nn.Parameter], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads, strict=True):
        p.grad = g.to(p.dtype).clone()


def _mean(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    out = [g.clone() for g in grads]
    for t in out:
        dist.all_reduce(t)
        t.div_(dist.get_world_size())
    return out


def _groups(params: list[nn.Parameter]) -> list[dict]:
    return [
        {"params": params[:2], "weight_decay": WD},
        {"params": params[2:], "weight_decay": 0.0, "adapt": False},
    ]


# ---------------------------------------------------------------------------------- bad input
BAD = [
    (OneBitAdam, {"lr": -1.0}, "lr must be >= 0"),
    (OneBitAdam, {"precondition": "yes"}, "precondition must be True or False"),
    (OneBitAdam, {"betas": (1.0, 0.9)}, r"betas\[0\] must be >= 0.0 and < 1.0"),
    (ZeroOneAdam, {"betas": (0.9, -0.1)}, r"betas\[1\] must be >= 0.0 and < 1.0"),
    (OneBitLamb, {"betas": 0.9}, "betas must be a pair"),
    (OneBitAdam, {"eps": -1e-8}, "eps must be >= 0"),
    (OneBitAdam, {"weight_decay": -0.1}, "weight_decay must be >= 0"),
    (OneBitAdam, {"freeze_step": -1}, "freeze_step must be an integer >= 1"),
    (OneBitLamb, {"freeze_step": 2.5}, "freeze_step must be an integer >= 1"),
    (ZeroOneAdam, {"freeze_step": 0}, "freeze_step must be an integer >= 1"),
    (OneBitAdam, {"codec": "warp"}, "codec: unknown codec 'warp'.*allowed: bf16"),
    (OneBitAdam, {"codec": "powersgd:rank=2"}, "low-rank"),
    (OneBitLamb, {"strategy": "star"}, "strategy must be one of allgather, ring, ps"),
    (
        ZeroOneAdam,
        {"freeze_step": 10, "var_freeze_step": 5},
        r"var_freeze_step must be >= freeze_step \(10\)",
    ),
    (ZeroOneAdam, {"sync_growth": 0}, "sync_growth must be an integer >= 1"),
    (ZeroOneAdam, {"max_sync_interval": 0}, "max_sync_interval must be an integer >= 1"),
    (OneBitLamb, {"ratio_bounds": (0.0, 2.0)}, r"ratio_bounds\[0\] must be > 0"),
    (OneBitLamb, {"ratio_bounds": (0.5, 0.9)}, r"ratio_bounds\[1\] must be >= 1"),
    (OneBitLamb, {"ratio_change": -0.1}, "ratio_change must be >= 0"),
    # the optimizer owns the momentum: error feedback's own momentum or clipping is refused
    (
        OneBitAdam,
        {"codec": "topk:density=0.1+ef:momentum=0.9"},
        r"codec .*momentum exchange takes plain error feedback .*allowed: .*'onebit\+ef'",
    ),
    (ZeroOneAdam, {"codec": "onebit+ef:clip=1.0"}, "codec .*momentum exchange takes plain error feedback"),
    (OneBitLamb, {"codec": "onebit+ef:clip=0.5"}, "codec .*momentum exchange takes plain error feedback"),
]


@pytest.mark.parametrize(("cls", "kwargs", "message"), BAD)
def test_bad_input_raises_a_value_error_naming_the_parameter(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(_params(), **kwargs)


def test_groups_with_different_betas_are_refused():
    p = _params()
    with pytest.raises(ValueError, match="betas and eps must be the same in every group"):
        OneBitAdam([{"params": p[:1]}, {"params": p[1:], "betas": (0.5, 0.9)}])


def test_zeroone_schedules():
    opt = ZeroOneAdam(_params(), freeze_step=4, var_freeze_step=20, sync_growth=10, max_sync_interval=4)
    refresh = [t for t in range(1, 40) if opt.is_variance_step(t)]
    assert refresh == [1, 2, 3, 4, 5, 6, 8, 12, 20]  # the warm-up, then at doubling intervals
    assert [opt.sync_interval(t) for t in (20, 21, 30, 31, 41, 51, 200)] == [1, 1, 1, 2, 4, 4, 4]


# ------------------------------------------------------------------------------ world checks
def _check_bad_input_everywhere() -> None:
    """Every rank raises the same error, and nothing was communicated (the barrier after this
    check would fail if some rank were inside a collective)."""
    with record_traffic() as t:
        for cls, kwargs, message in BAD:
            with pytest.raises(ValueError, match=message):
                cls(_params(), **kwargs)
    assert t.calls == 0


def _check_warmup_matches_adamw() -> None:
    rank = dist.get_rank()
    for cls in (OneBitAdam, ZeroOneAdam):
        ours, ref = _params(), _params()
        opt = cls(_groups(ours), lr=LR, betas=(B1, B2), eps=EPS, freeze_step=5)
        torch_opt = torch.optim.AdamW(_groups(ref), lr=LR, betas=(B1, B2), eps=EPS)
        for step in range(1, 6):
            grads = _grads(step, rank)
            _set_grads(ours, grads)
            _set_grads(ref, _mean(grads))
            opt.step()
            torch_opt.step()
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, c=cls: f"{c.__name__}: {m}")


def _check_lamb_warmup_matches_lamb() -> None:
    rank = dist.get_rank()
    ours, ref = _params(), _params()
    opt = OneBitLamb(_groups(ours), lr=LR, betas=(B1, B2), eps=1e-6, freeze_step=5)
    lamb = LAMB(_groups(ref), lr=LR, betas=(B1, B2), eps=1e-6)
    for step in range(1, 6):
        grads = _grads(step, rank)
        _set_grads(ours, grads)
        _set_grads(ref, _mean(grads))
        opt.step()
        lamb.step()
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _frozen_adam_reference(
    steps: int, freeze: int, world: int, refresh: tuple[int, ...] = ()
) -> list[torch.Tensor]:
    """Float64: Adam on the mean gradient for ``freeze`` steps, then the same with ``v`` (and its
    bias correction) frozen at step ``freeze``, except on the ``refresh`` steps, where ``v``
    moves as over the steps since its last update. Weight decay on the first group (decoupled)."""
    x = [p.detach().double().clone() for p in _params()]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    wd = [WD, WD, 0.0]
    tv = 0  # the step of v's last update
    for t in range(1, steps + 1):
        per_rank = [_grads(t, r) for r in range(world)]
        g = [sum(pr[i].double() for pr in per_rank) / world for i in range(len(x))]
        update_v, span = t <= freeze or t in refresh, t - tv
        tv = t if update_v else tv
        for i in range(len(x)):
            m[i] = B1 * m[i] + (1 - B1) * g[i]
            if update_v:
                v[i] = B2**span * v[i] + (1 - B2**span) * g[i] ** 2
            m_hat = m[i] / (1 - B1**t)
            denom = (v[i] / (1 - B2**tv)).sqrt() + EPS
            x[i] = x[i] * (1 - LR * wd[i]) - LR * m_hat / denom
    return x


def _check_lossless_compressed_stage_matches_frozen_adam() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    frozen, refreshed = _frozen_adam_reference(9, 3, world), _frozen_adam_reference(9, 3, world, (4, 5))
    for cls, extra, want in (
        (OneBitAdam, {}, frozen),
        (OneBitAdam, {"precondition": True}, frozen),
        # one local step per exchange, no variance refresh: the same algorithm
        (ZeroOneAdam, {"var_freeze_step": 3, "max_sync_interval": 1}, frozen),
        # v refreshed on steps 4 and 5 (freeze_step + 1, + 2), then frozen
        (ZeroOneAdam, {"var_freeze_step": 6, "max_sync_interval": 1}, refreshed),
    ):
        for strategy in ("ps", "ring"):
            ours = _params()
            opt = cls(_groups(ours), lr=LR, betas=(B1, B2), eps=EPS, freeze_step=3, codec="none",
                      strategy=strategy, **extra)  # fmt: skip
            for step in range(1, 10):
                _set_grads(ours, _grads(step, rank))
                opt.step()
            for a, b in zip(ours, want, strict=True):
                torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def _lamb_reference(
    steps: int, freeze: int, world: int, bounds: tuple[float, float] = (0.5, 4.0), change: float = 0.1
) -> tuple[list[torch.Tensor], list[float], list[float]]:
    """Float64 1-bit LAMB (Li et al. 2021) with a lossless exchange, written out per layer: LAMB
    on the mean gradient for ``freeze`` steps with a bias-corrected running mean (decay B1) of
    each adapted layer's trust ratio |w|/|u|; then v frozen, a fresh variance v' fed by the
    gradient the momentum implies, and the ratio R * f with f = max(d / d') blended by the
    weight-decay share, clipped to ``bounds`` and to ``change`` of the previous f. Returns the
    parameters, the last factors f and the momentum scales (mean layer rms / layer rms)."""
    x = [p.detach().double().clone() for p in _params()]
    m = [torch.zeros_like(t) for t in x]
    v = [torch.zeros_like(t) for t in x]
    wd, adapt, eps = [WD, WD, 0.0], [True, True, False], 1e-6
    mean_ratio = [0.0 for _ in x]
    fresh: list[torch.Tensor] = []
    last = [1.0 for _ in x]
    scales: list[float] = []
    for t in range(1, steps + 1):
        per_rank = [_grads(t, r) for r in range(world)]
        g = [sum(pr[i].double() for pr in per_rank) / world for i in range(len(x))]
        for i in range(len(x)):
            prev = m[i].clone()
            m[i] = B1 * m[i] + (1 - B1) * g[i]
            if t <= freeze:
                v[i] = B2 * v[i] + (1 - B2) * g[i] ** 2
            d = (v[i] / (1 - B2 ** min(t, freeze))).sqrt() + eps
            u0 = (m[i] / (1 - B1**t)) / d
            u = u0 + wd[i] * x[i]
            un, wn = float(u.norm()), float(x[i].norm())
            if t <= freeze:
                ratio = wn / un
                mean_ratio[i] = B1 * mean_ratio[i] + (1 - B1) * ratio
            else:
                g_implied = (m[i] - B1 * prev) / (1 - B1)
                fresh[i] = B2 * fresh[i] + (1 - B2) * g_implied**2
                d_fresh = (fresh[i] / (1 - B2**t)).sqrt() + eps
                f = float((d / d_fresh).max())
                if wd[i] > 0:
                    q = min(1.0, float(u0.norm()) / un)
                    f = q * f + (1 - q)
                f = min(max(f, bounds[0]), bounds[1])
                f = min(max(f, last[i] * (1 - change)), last[i] * (1 + change))
                last[i] = f
                ratio = mean_ratio[i] / (1 - B1**freeze) * f
            x[i] = x[i] - LR * (ratio if adapt[i] else 1.0) * u
        if t == freeze:
            fresh = [t_.clone() for t_ in v]
            rms = [float(t_.norm()) / math.sqrt(t_.numel()) for t_ in m]
            scales = [sum(rms) / len(rms) / r for r in rms]
    return x, last, scales


def _check_lossless_lamb_matches_its_formula() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    want, factors, scales = _lamb_reference(10, 3, world)
    ours = _params()
    opt = OneBitLamb(_groups(ours), lr=LR, betas=(B1, B2), eps=1e-6, freeze_step=3, codec="none")
    for step in range(1, 11):
        _set_grads(ours, _grads(step, rank))
        opt.step()
    with expect_all() as expect:
        with expect("the reference's fresh-variance factors moved (the check is not vacuous)"):
            assert any(abs(f - 1.0) > 0.05 for f in factors[:2]), factors
        with expect("parameters as the float64 formula"):
            for a, b in zip(ours, want, strict=True):
                torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
        with expect("the fresh-variance factors and the momentum scales as the formula's"):
            torch.testing.assert_close(opt.last_factor.double(), torch.tensor(factors, dtype=torch.float64))
            torch.testing.assert_close(opt.momentum_scale.double(), torch.tensor(scales, dtype=torch.float64))


def _check_onebit_error_feedback_and_identical_ranks() -> None:
    rank = dist.get_rank()
    for cls in (OneBitAdam, OneBitLamb, ZeroOneAdam):
        ours = _params()
        extra = {"var_freeze_step": 4, "sync_growth": 2, "max_sync_interval": 2} if cls is ZeroOneAdam else {}
        opt = cls(_groups(ours), lr=LR, freeze_step=2, **extra)
        ef = opt.exchange.codec
        seen: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        encode = ef.encode

        def recording(grad, ctx=None, *, out=None, loss_scale=1.0, _encode=encode, _ef=ef, _seen=seen):
            before = _ef.residual(ctx.key)
            before = torch.zeros(grad.numel()) if before is None else before
            payload = _encode(grad, ctx, out=out, loss_scale=loss_scale)
            _seen.append(
                (
                    ctx.key,
                    grad.reshape(-1).clone(),
                    before,
                    _ef.decode(payload).reshape(-1),
                    _ef.residual(ctx.key),
                )
            )
            return payload

        ef.encode = recording
        for step in range(1, 9):
            _set_grads(ours, _grads(step, rank))
            opt.step()
            if step in (4, 8):
                opt.synchronize()
        with expect_all() as expect:
            keys = {k for k, *_ in seen}
            with expect(f"{cls.__name__}: both stages compress"):
                assert any(k.endswith("/ps-aggregate") for k in keys), keys
                assert any(k.endswith("/ps0") for k in keys) and any(k.endswith("/ps1") for k in keys), keys
            for key, to_send, before, sent, after in seen:
                with expect(f"{cls.__name__} {key}: sent + residual == what was to be sent"):
                    torch.testing.assert_close(sent + after, to_send + before, rtol=0, atol=1e-6)
                with expect(f"{cls.__name__} {key}: one bit and (at most) two values"):
                    assert sent.unique().numel() <= 2
            same_on_every_rank([*ours, opt.exp_avg], f"{cls.__name__}: parameters and momentum")


def _save_load(opt: torch.optim.Optimizer) -> dict:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _check_state_dict_round_trip_resumes_identically() -> None:
    rank = dist.get_rank()
    for cls, extra in (
        (OneBitAdam, {}),
        (OneBitLamb, {}),
        (ZeroOneAdam, {"var_freeze_step": 4, "sync_growth": 2, "max_sync_interval": 4}),
    ):
        a = _params()
        opt_a = cls(_groups(a), lr=LR, freeze_step=2, **extra)
        for step in range(1, 8):  # past the warm-up; 0/1 Adam in the middle of local steps
            _set_grads(a, _grads(step, rank))
            opt_a.step()
        state = _save_load(opt_a)
        b = [nn.Parameter(p.detach().clone()) for p in a]
        opt_b = cls(_groups(b), lr=LR, freeze_step=2, **extra)
        opt_b.load_state_dict(state)
        for step in range(8, 14):
            for params, opt in ((a, opt_a), (b, opt_b)):
                _set_grads(params, _grads(step, rank))
                opt.step()
        with expect_all() as expect, expect(f"{cls.__name__}: the resumed run equals the uninterrupted one"):
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y)
            assert torch.equal(opt_a.exp_avg, opt_b.exp_avg)
        other = cls(_groups(_params()), lr=LR, freeze_step=3, **extra)
        with pytest.raises(ValueError, match="the state was saved with config"):
            other.load_state_dict(state)


def _check_bytes_counted() -> None:
    """The bytes counted are the collectives' payloads: a float32 ring all-reduce in the warm-up,
    then CaSync-PS of onebit payloads (24-byte header + one bit per element, padded to 8 bytes);
    the start-up agreement (one all-gather of AGREEMENT_WORDS int64 words) is counted too; so
    are the has-a-gradient flags, a float32 per parameter tensor (in the warm-up's all-reduce,
    an all-reduce of their own in a compressed step, with 0/1 Adam's per-parameter decays in
    float64 before an exchange)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    n = sum(math.prod(s) for s in SHAPES)  # 70
    tensors = len(SHAPES)
    parts = [n // p + (1 if i < n % p else 0) for i in range(p)]
    payload = [HEADER_BYTES + -(-k // 64) * 8 for k in parts]  # sections aligned to 8 bytes
    dense = 2 * (p - 1) / p * 4 * (n + tensors)
    flags = 2 * (p - 1) / p * 4 * tensors
    before_exchange = 2 * (p - 1) / p * 8 * 2 * tensors
    agreement = (p - 1) * 8 * AGREEMENT_WORDS
    # onebit's payloads have a size known in advance, so they travel in fixed slots with no size
    # exchange first: the all-to-all sends the partitions for the others, the all-gather the
    # owners' aggregates padded to the largest
    compressed = sum(b for j, b in enumerate(payload) if j != rank) + (p - 1) * max(payload)
    for cls in (OneBitAdam, OneBitLamb, ZeroOneAdam):
        params = _params()
        extra = {"var_freeze_step": 3, "sync_growth": 1, "max_sync_interval": 2} if cls is ZeroOneAdam else {}
        opt = cls(_groups(params), lr=LR, freeze_step=2, **extra)
        sent = []
        for step in range(1, 7):
            _set_grads(params, _grads(step, rank))
            with record_traffic() as outer:
                opt.step()
            mine = sum(opt.traffic.take().values())
            assert outer.total() == mine, "the enclosing count sees the optimizer's bytes"
            sent.append(mine)
        step = compressed + flags
        want = [agreement + dense, dense, step, step, step, step]
        if cls is ZeroOneAdam:  # 3: variance refresh (dense); 4: local, interval 1; 5: local; 6: exchange
            exchange = compressed + before_exchange
            want = [agreement + dense, dense, dense, exchange, 0, exchange]
        assert sent == pytest.approx(want), f"{cls.__name__}: {sent} != {want}"
        assert opt.traffic.total_sent == pytest.approx(sum(want))


def _check_bf16_parameters() -> None:
    rank = dist.get_rank()
    for cls in (OneBitAdam, OneBitLamb, ZeroOneAdam):
        params = _params(torch.bfloat16)
        start = [q.detach().clone() for q in params]
        extra = {"var_freeze_step": 3, "sync_growth": 2} if cls is ZeroOneAdam else {}
        opt = cls(_groups(params), lr=0.05, freeze_step=2, **extra)
        for step in range(1, 7):
            _set_grads(params, _grads(step, rank))
            opt.step()
        opt.synchronize()
        with expect_all() as expect:
            with expect(f"{cls.__name__}: bf16 parameters, float32 state, finite, moved"):
                assert all(q.dtype == torch.bfloat16 and torch.isfinite(q).all() for q in params)
                assert opt.exp_avg.dtype == opt.exp_avg_sq.dtype == torch.float32
                assert all(not torch.equal(q, s) for q, s in zip(params, start, strict=True))
            same_on_every_rank(params, f"{cls.__name__}: bf16 parameters")


ROWS, SEEN = 10, 6  # an embedding of ROWS rows of which only the first SEEN ever get a gradient


def _sparse_params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(5)
    return [nn.Parameter(torch.randn(ROWS, 4, generator=g)), nn.Parameter(torch.randn(7, generator=g))]


def _sparse_grads(step: int, rank: int) -> list[torch.Tensor]:
    """Rows SEEN.. of the embedding get an exactly-zero gradient on every rank and step."""
    g = torch.Generator().manual_seed(7000 + 100 * step + rank)
    emb = torch.randn(ROWS, 4, generator=g) * (1 + rank)
    emb[SEEN:] = 0.0
    return [emb, torch.randn(7, generator=g)]


OWN_EXCHANGE = (
    (OneBitAdam, {}),
    # local steps from step 5, exchanges every 2 steps
    (ZeroOneAdam, {"var_freeze_step": 4, "sync_growth": 1, "max_sync_interval": 2}),
)


def _check_zero_gradient_rows_do_not_move() -> None:
    """Rows whose gradient is exactly zero everywhere (v = 0) take no step past the warm-up, with
    the default onebit exchange: as torch's AdamW, they are only decayed (the group's weight
    decay); under 1-bit LAMB without weight decay they stay put. The rows that are used still
    train, and the ranks agree."""
    rank = dist.get_rank()
    cases = [*OWN_EXCHANGE, (OneBitLamb, {})]
    for cls, extra in cases:
        wd = 0.0 if cls is OneBitLamb else 0.1
        ours, ref = _sparse_params(), _sparse_params()
        start = [q.detach().clone() for q in ours]
        opt = cls([{"params": ours, "weight_decay": wd}], lr=1e-3, freeze_step=2, **extra)
        adamw = torch.optim.AdamW([{"params": ref, "weight_decay": wd}], lr=1e-3)
        for step in range(1, 9):
            grads = _sparse_grads(step, rank)
            _set_grads(ours, grads)
            _set_grads(ref, _mean(grads))
            opt.step()
            adamw.step()
        opt.synchronize()
        name = cls.__name__
        with expect_all() as expect:
            with expect(f"{name}: the rows never used moved as torch's AdamW moved them (decay only)"):
                torch.testing.assert_close(ours[0][SEEN:], ref[0][SEEN:], rtol=1e-6, atol=0.0)
                if wd == 0.0:
                    assert torch.equal(ours[0][SEEN:], start[0][SEEN:])
            with expect(f"{name}: the rows used trained"):
                assert not torch.equal(ours[0][:SEEN], start[0][:SEEN])
            with expect(f"{name}: the momentum of the rows never used is zero"):
                assert not opt.exp_avg[SEEN * 4 : ROWS * 4].any()
            same_on_every_rank([*ours, opt.exp_avg], f"{name}: parameters and momentum")


def _check_parameters_without_gradient_are_skipped() -> None:
    """Torch's AdamW skips a parameter whose .grad is None: no decay, no step. A frozen
    parameter (requires_grad=False, so None on every rank) stays bit for bit as it was, through
    the warm-up, the compressed steps and 0/1 Adam's local steps; one that has a gradient on
    rank 0 only moves as AdamW moves it on the mean gradient (rank 1's counted as zeros: DDP's
    rule for unused parameters), here during the warm-up."""
    rank = dist.get_rank()
    for cls, extra in (*OWN_EXCHANGE, (OneBitLamb, {})):
        ours, ref = _params(), _params()
        ours[1].requires_grad_(False)
        start = [q.detach().clone() for q in ours]
        groups = [{"params": ours, "weight_decay": 0.1}]
        opt = cls(groups, lr=1e-3, betas=(B1, B2), eps=EPS, freeze_step=3, **extra)
        adamw = torch.optim.AdamW([{"params": ref, "weight_decay": 0.1}], lr=1e-3, betas=(B1, B2), eps=EPS)
        for step in range(1, 9):
            grads = _grads(step, rank)
            _set_grads(ours, grads)
            ours[1].grad = None
            if rank == 1:
                ours[2].grad = None
                grads[2] = torch.zeros_like(grads[2])
            if step <= 3:
                _set_grads(ref, _mean(grads))
                ref[1].grad = None
                adamw.step()
            opt.step()
            if step == 3 and cls is not OneBitLamb:
                with expect_all() as expect, expect(f"{cls.__name__}: the warm-up as AdamW's"):
                    for a, b in zip(ours, ref, strict=True):
                        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        opt.synchronize()
        with expect_all() as expect:
            with expect(f"{cls.__name__}: the frozen parameter neither decayed nor moved"):
                assert torch.equal(ours[1], start[1])
            with expect(f"{cls.__name__}: the others trained"):
                assert not torch.equal(ours[0], start[0]) and not torch.equal(ours[2], start[2])
            same_on_every_rank(ours, f"{cls.__name__}: parameters")


def _check_add_param_group() -> None:
    """A group added before the first step trains as if it had been passed to the constructor
    (the warm-up equals torch's AdamW with both groups); after the first step add_param_group
    raises a ValueError saying why and what to do, on every rank alike."""
    rank = dist.get_rank()
    for cls in (OneBitAdam, ZeroOneAdam):
        ours, ref = _params(), _params()
        groups = _groups(ours)
        opt = cls([groups[0]], lr=LR, betas=(B1, B2), eps=EPS, freeze_step=5)
        opt.add_param_group(groups[1])
        adamw = torch.optim.AdamW(_groups(ref), lr=LR, betas=(B1, B2), eps=EPS)
        for step in range(1, 5):
            grads = _grads(step, rank)
            _set_grads(ours, grads)
            _set_grads(ref, _mean(grads))
            opt.step()
            adamw.step()
        with expect_all() as expect, expect(f"{cls.__name__}: the added group trains as AdamW's"):
            for a, b in zip(ours, ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        with pytest.raises(
            ValueError, match=r"add_param_group after the first step is not supported.*before the"
        ):
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
        assert len(opt.param_groups) == 2
    opt = OneBitLamb([{"params": _params()[:1]}], freeze_step=2)
    with pytest.raises(ValueError, match=r"param_groups\[1\]: betas and eps must be the same"):
        opt.add_param_group({"params": _params()[1:], "betas": (0.5, 0.9)})
    assert len(opt.param_groups) == 1


def _check_zeroone_exchanges_follow_its_schedule() -> None:
    """The steps on which 0/1 Adam synchronizes the ranks, read from the optimizer as it runs,
    are the ones written out here from its schedule (var_freeze_step 3, the interval doubling
    every 2 steps up to 4), and the ones whatif counts (exchange_steps) for any window."""
    from gradsync.optim.zeroone_adam import exchange_steps

    rank = dist.get_rank()
    params = _params()
    opt = ZeroOneAdam(
        _groups(params), lr=LR, freeze_step=2, var_freeze_step=3, sync_growth=2, max_sync_interval=4
    )
    synced = []
    for step in range(1, 20):
        _set_grads(params, _grads(step, rank))
        opt.step()
        if opt.last_sync == step:
            synced.append(step)
    with expect_all() as expect, expect("0/1 Adam exchanges on the steps its schedule gives"):
        # 1-3 every step; 4, 5 (interval 1); 7 (interval 2); then every 4: 11, 15, 19
        assert synced == [1, 2, 3, 4, 5, 7, 11, 15, 19], synced
        for first, last in ((1, 19), (4, 10), (6, 6), (8, 19), (12, 14)):
            want = sum(first <= t <= last for t in synced)
            assert exchange_steps(first, last, 3, 2, 4) == want, (first, last)


def _world_checks() -> None:
    torch.manual_seed(0)
    run_checks(
        _check_bad_input_everywhere,
        _check_warmup_matches_adamw,
        _check_lamb_warmup_matches_lamb,
        _check_lossless_compressed_stage_matches_frozen_adam,
        _check_lossless_lamb_matches_its_formula,
        _check_onebit_error_feedback_and_identical_ranks,
        _check_state_dict_round_trip_resumes_identically,
        _check_bytes_counted,
        _check_bf16_parameters,
        _check_zero_gradient_rows_do_not_move,
        _check_parameters_without_gradient_are_skipped,
        _check_add_param_group,
        _check_zeroone_exchanges_follow_its_schedule,
    )


def test_adam_family_in_a_two_rank_world():
    run_world(2, _world_checks)


# ------------------------------------------------------------------------------ the train CLI
def test_train_cli_runs_zeroone_adam_without_gradient_sync(tmp_path, monkeypatch):
    """2 ranks, 2 short epochs: warm-up, variance refreshes, local steps, exchanges, the
    synchronization before each evaluation and checkpoint (per-rank optimizer state saved)."""
    from gradsync.apps.commands import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run.json"
    argv = ["train", "--nproc", "2", "--data", "synthetic-text:n=6000,vocab=32", "--model", "transformer",
            "--seq-len", "16", "--batch-size", "16", "--epochs", "2", "--quiet", "--weight-decay", "0.01",
            "--optimizer", "zeroone-adam", "--freeze-step", "2", "--var-freeze-step", "4",
            "--sync-growth", "3", "--max-sync-interval", "4", "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    s = json.loads(out.read_text())
    first, last = s["history"]
    assert math.isfinite(last["val_perplexity"]) and last["val_perplexity"] < 32
    # the engine sent nothing: every byte is the optimizer's, compressed after the warm-up
    assert last["compression_ratio"] > 8 and first["compressed_steps"] > 0
    assert last["compressed_steps"] == last["steps"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--optimizer", "onebit-adam", "--scheme", "topk:density=0.01"], "synchronizes the model itself"),
        (["--optimizer", "adamw", "--freeze-step", "5"], "--freeze-step needs --optimizer onebit-adam"),
        (
            ["--optimizer", "onebit-adam", "--var-freeze-step", "5"],
            "--var-freeze-step needs --optimizer zeroone",
        ),
        (["--optimizer", "onebit-lamb", "--freeze-step", "0"], "--freeze-step must be a positive number"),
        (
            ["--optimizer", "onebit-adam", "--momentum-codec", "warp"],
            "--momentum-codec: codec: unknown codec",
        ),
    ],
)
def test_train_option_errors(extra, message, capsys, monkeypatch):
    from gradsync.apps.commands import main

    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err


def test_train_defaults_and_the_whole_run_traffic_of_the_benchmark():
    import argparse

    from gradsync.apps.commands.bench.convergence import whole_run_traffic
    from gradsync.apps.train.optim import compressed_options

    args = argparse.Namespace(optimizer="zeroone-adam", freeze_step=None, var_freeze_step=None,
                              sync_growth=None, max_sync_interval=2, momentum_codec="onebit")  # fmt: skip
    want = {"freeze_step": 12, "codec": "onebit", "var_freeze_step": 367, "sync_growth": 40}
    assert compressed_options(args, 612) == {**want, "max_sync_interval": 2}
    args.optimizer = "onebit-adam"
    assert compressed_options(args, 612) == {"freeze_step": 18, "codec": "onebit"}
    args.optimizer = "onebit-lamb"  # its frozen trust ratios need a longer warm-up
    assert compressed_options(args, 612) == {"freeze_step": 61, "codec": "onebit"}
    args.freeze_step = 5
    assert compressed_options(args, 3)["freeze_step"] == 5
    # a dense epoch (ratio 1) and a 32x epoch of the same length: 2 / (1 + 1/32), not the mean 16.5
    zero = {"bytes_per_step_intra": 0.0, "bytes_per_step_inter": 0.0}
    history = [
        {**zero, "bytes_per_step_world": 3200.0, "steps": 10, "compression_ratio": 1.0},
        {**zero, "bytes_per_step_world": 100.0, "steps": 10, "compression_ratio": 32.0},
    ]
    got = whole_run_traffic(history)
    assert got["run_bytes"] == 33000.0
    assert got["run_compression"] == pytest.approx(64000 / 33000)
