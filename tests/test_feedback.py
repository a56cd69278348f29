"""Error feedback: the invariant, loss scaling, skipped steps, Algorithm 4, clipping, state."""

import io
import math

import pytest
import torch

import gradsync
from gradsync.codecs import EncodeContext, ErrorFeedback, FeedbackConfig

LOSSY = [
    "topk:density=0.05",
    "mstopk:density=0.05",
    "dgc:density=0.05",
    "randomk:density=0.05,unbiased=true",
    "qrgc:density=0.05",
    "onebit",
    "tbq:threshold=0.5",
    "terngrad",
    "fp16",
    "bf16",
    "powersgd:rank=2",
    "bsearch:density=0.05",
    "graddrop:density=0.05",
]


@pytest.mark.parametrize("spec", LOSSY)
def test_error_feedback_invariant(backend, spec):
    ef = gradsync.build_codec(spec + "+ef")
    shape = (40, 50)
    old = torch.zeros(2000)
    for _ in range(4):
        g = torch.randn(shape)
        p = ef.encode(g, EncodeContext(key="w"))
        new = ef.residual("w")
        sent = ef.decode(p).view(-1)
        torch.testing.assert_close(g.view(-1) + old, sent + new, rtol=1e-5, atol=1e-5)
        old = new


def test_all_zero_gradient_keeps_a_zero_residual(backend):
    for spec in ("topk", "mstopk", "onebit", "terngrad", "powersgd", "fp16", "qrgc"):
        ef = gradsync.build_codec(spec + "+ef")
        p = ef.encode(torch.zeros(30, 40))
        y = ef.decode(p)
        assert not y.isnan().any() and y.abs().sum() == 0, spec
        assert ef.residual().abs().sum() == 0, spec


def test_residual_is_stored_unscaled(backend):
    g = torch.randn(1000)
    plain = gradsync.build_codec("topk:density=0.1+ef")
    scaled = gradsync.build_codec("topk:density=0.1+ef")
    for scale in (1024.0, 1024.0, 512.0):
        pp = plain.encode(g)
        ps = scaled.encode(g * scale, loss_scale=scale)
        assert torch.equal(plain.transmitted(pp)[0], scaled.transmitted(ps)[0])
        torch.testing.assert_close(scaled.residual(), plain.residual(), rtol=1e-6, atol=1e-7)
    st = scaled.state_dict()["streams"][""]["residual"]
    torch.testing.assert_close(st, plain.residual(), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_nonfinite_gradient_is_flagged_and_changes_no_state(backend, bad):
    ef = gradsync.build_codec("dgc:density=0.1+ef:momentum=0.9")
    ef.encode(torch.randn(500))
    before = ef.state_dict()
    g = torch.randn(500)
    g[42] = bad
    p = ef.encode(g)
    assert p.nonfinite
    assert ef.decode(p).isnan().all()
    after = ef.state_dict()
    assert torch.equal(after["streams"][""]["residual"], before["streams"][""]["residual"])
    assert torch.equal(after["streams"][""]["momentum"], before["streams"][""]["momentum"])
    ef.encode(torch.randn(500))  # and the next step proceeds


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_and_masking_follow_algorithm_4(backend, nesterov):
    m, k, n = 0.9, 10, 200
    spec = f"topk:k={k}+ef:momentum={m},nesterov={str(nesterov).lower()}"
    ef = gradsync.build_codec(spec)
    u = torch.zeros(n)
    v = torch.zeros(n)
    for _ in range(5):
        g = torch.randn(n)
        if nesterov:  # DGC's Nesterov form
            u = m * (u + g)
            v = v + u + g
        else:
            u = m * u + g
            v = v + u
        sel = torch.topk(v.abs(), k).indices
        sent = torch.zeros(n)
        sent[sel] = v[sel]
        v[sel] = 0
        u[sel] = 0  # momentum-factor masking
        y = ef.decode(ef.encode(g))
        torch.testing.assert_close(y, sent, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ef.residual(), v, rtol=1e-5, atol=1e-5)


def test_local_clipping_bounds_the_accumulated_norm(backend):
    ef = gradsync.build_codec("topk:density=0.5+ef:clip=1.0")
    g = torch.randn(1000) * 10
    y = ef.decode(ef.encode(g))
    total = y + ef.residual()
    assert float(total.norm()) == pytest.approx(1.0, rel=1e-5)
    torch.testing.assert_close(total, g / g.norm(), rtol=1e-5, atol=1e-6)


def test_feedback_config_errors():
    with pytest.raises(ValueError, match=r"ef: momentum must be in \[0, 1\)"):
        FeedbackConfig(momentum=1.0)
    with pytest.raises(ValueError, match="nesterov needs momentum"):
        FeedbackConfig(nesterov=True)
    with pytest.raises(ValueError, match="momentum correction needs a sparsifying codec"):
        gradsync.build_codec("onebit+ef:momentum=0.9")
    with pytest.raises(ValueError, match="applies error feedback twice"):
        gradsync.build_codec("topk+ef+ef")
    with pytest.raises(ValueError, match="unknown wrapper 'zip'"):
        gradsync.build_codec("topk+zip")
    with pytest.raises(ValueError, match="loss_scale must be"):
        gradsync.build_codec("topk+ef").encode(torch.ones(4), loss_scale=0.0)
    with pytest.raises(ValueError, match="already applied"):
        ErrorFeedback(ErrorFeedback(gradsync.build_codec("topk")))


@pytest.mark.parametrize(
    "spec",
    [
        "mstopk:density=0.1+ef:momentum=0.5",
        "terngrad+ef",
        "powersgd:rank=2+ef",
        "bsearch:density=0.1+ef",
        "dgc:density=0.1+ef:momentum=0.9,nesterov=true",
    ],
)
def test_state_dict_resume_gives_the_same_trajectory(backend, spec):
    grads = [torch.randn(30, 20) for _ in range(6)]
    a = gradsync.build_codec(spec)
    for g in grads[:3]:
        a.encode(g, EncodeContext(key="p"))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    b = gradsync.build_codec(spec)
    b.load_state_dict(state)
    for g in grads[3:]:
        pa, pb = a.encode(g, EncodeContext(key="p")), b.encode(g, EncodeContext(key="p"))
        assert torch.equal(pa.data, pb.data)


def test_load_state_rejects_another_config():
    a = gradsync.build_codec("topk:density=0.1+ef")
    a.encode(torch.randn(10))
    with pytest.raises(ValueError, match="different config"):
        gradsync.build_codec("topk:density=0.2+ef").load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="ef: state was saved with config"):
        gradsync.build_codec("topk:density=0.1+ef:momentum=0.5").load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="saved by codec 'topk'"):
        gradsync.build_codec("mstopk:density=0.1").load_state_dict(a.codec.state_dict())


@pytest.mark.parametrize("spec", ["topk:density=0.01", "mstopk:density=0.01", "trimmed_topk:density=0.01"])
@pytest.mark.parametrize("numel", [1000, 50_000, 300_001])
def test_fused_accumulation_sends_what_an_add_then_encode_sends(backend, spec, numel):
    """Plain error feedback hands the codec residual and gradient apart, and the selection adds
    them in its first scan. The reference keeps its own float32 residual, adds with torch.add and
    encodes with a separate codec of the same spec (its own scan of the finished sum): payloads
    and residuals must agree bit for bit, step after step, including a step with ties (a gradient
    that is mostly one value: more candidates than the sample predicts, so the scan repeats), one
    with a non-finite element (nothing changes) and a shape that is not flat."""
    ef = gradsync.build_codec(spec + "+ef")
    plain = gradsync.build_codec(spec)
    residual = torch.zeros(numel)
    gen = torch.Generator().manual_seed(numel)
    for step in range(5):
        g = torch.randn(numel, generator=gen)
        if step == 2:
            g[: numel // 2] = 0.25  # ties
        if step == 3:
            g[numel // 3] = math.nan
        shaped = g.view(numel // 1, 1) if step == 4 else g
        ctx = EncodeContext(key="w")
        got = ef.encode(shaped, ctx)
        v = torch.add(residual, g)
        want = plain.encode(v, ctx)
        assert got.nonfinite == want.nonfinite, (spec, numel, step)
        if want.nonfinite:
            assert torch.equal(ef.residual("w"), residual)  # unchanged by the skipped step
            continue
        assert torch.equal(got.data, want.data), (spec, numel, step)
        idx, val = plain.transmitted(want)
        v[idx.long()] -= val
        residual = v
        assert torch.equal(ef.residual("w"), residual), (spec, numel, step)


def test_fused_exact_topk_matches_a_float64_reference(backend):
    """Independently of any codec: the k largest |r + g| (ties to the lower index; the sum in
    float32, the residual's precision) are sent, and the residual is r + g with those zeroed."""
    n, k = 100_000, 1000
    ef = gradsync.build_codec("topk:density=0.01+ef")
    r = [0.0] * n
    f32 = torch.finfo(torch.float32)
    for _ in range(3):
        g = torch.randn(n).tolist()
        # the sum rounded to float32 once, as IEEE addition does (r and g are float32 values)
        v = torch.tensor(r, dtype=torch.float32) + torch.tensor(g, dtype=torch.float32)
        assert v.abs().max() < f32.max
        vs = v.double().tolist()
        want = sorted(sorted(range(n), key=lambda i: (-abs(vs[i]), i))[:k])
        idx, val = ef.transmitted(ef.encode(torch.tensor(g, dtype=torch.float32)))
        assert idx.tolist() == want
        assert val.double().tolist() == [vs[i] for i in want]
        for i in want:
            vs[i] = 0.0
        r = vs
        assert ef.residual().double().tolist() == r


def test_a_low_rank_commit_subtracts_p_q_transpose(backend):
    """``commit(factors=(P, Q))`` leaves ``r + g - P Q^T`` (row-major over the stream's
    elements), checked against the float64 formula; factors that do not cover the pending
    elements are refused, naming the shapes, and leave the step pending."""
    ef = gradsync.build_codec("powersgd:rank=2+ef")
    rows, cols, rank = 30, 20, 2
    gen = torch.Generator().manual_seed(7)
    r = torch.zeros(rows * cols, dtype=torch.float64)
    for _ in range(3):
        g = torch.randn(rows, cols, generator=gen)
        p, q = torch.randn(rows, rank, generator=gen), torch.randn(cols, rank, generator=gen)
        ef.accumulate(g, "w")
        with pytest.raises(ValueError, match=r"commit factors \(30, 2\) x \(19, 2\)\^T do not cover the 600"):
            ef.commit("w", factors=(p, q[:19]))
        ef.commit("w", factors=(p, q))
        r = r + g.double().reshape(-1) - (p.double() @ q.double().T).reshape(-1)
        torch.testing.assert_close(ef.residual("w").double(), r, rtol=1e-5, atol=1e-5)


def test_a_powersgd_payload_names_its_factors(backend):
    """``factors(payload)``: the (P, Q) whose product the payload decodes to (error feedback
    commits them in place); None for a tensor PowerSGD sends dense and for other codecs."""
    codec = gradsync.build_codec("powersgd:rank=2")
    payload = codec.encode(torch.randn(30, 20), EncodeContext(key="m"))
    p, q = codec.factors(payload)
    assert p.shape == (30, 2) and q.shape == (20, 2)
    torch.testing.assert_close(
        p.double() @ q.double().T, codec.decode(payload).double(), rtol=1e-6, atol=1e-6
    )
    assert codec.factors(codec.encode(torch.randn(30), EncodeContext(key="b"))) is None
    topk = gradsync.build_codec("topk:density=0.1")
    assert topk.factors(topk.encode(torch.randn(100))) is None
    ef = gradsync.build_codec("powersgd:rank=2+ef")
    assert ef.factors(ef.encode(torch.randn(30, 20))) is not None
