"""Quantizers, 16-bit casts, PowerSGD and `none` against their closed forms."""

import math

import pytest
import torch

import gradsync
from gradsync.codecs import EncodeContext, Flag


@pytest.mark.parametrize("n", [1, 13, 4096, 100_003])
def test_onebit_two_means(backend, n):
    x = torch.randn(n)
    codec = gradsync.build_codec("onebit")
    p = codec.encode(x)
    pos, neg = x[x >= 0], x[x < 0]
    hi = float(pos.double().mean()) if pos.numel() else 0.0
    lo = float(neg.double().mean()) if neg.numel() else 0.0
    want = torch.where(x >= 0, torch.tensor(hi), torch.tensor(lo))
    torch.testing.assert_close(codec.decode(p), want, rtol=1e-5, atol=1e-7)
    assert p.nbytes == 24 + math.ceil(n / 8 / 8) * 8


def test_onebit_scaled_sign(backend):
    x = torch.randn(1000)
    codec = gradsync.build_codec("onebit:scales=1")
    m = float(x.abs().double().mean())
    want = torch.where(x >= 0, torch.tensor(m), torch.tensor(-m))
    torch.testing.assert_close(codec.decode(codec.encode(x)), want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("n", [3, 100_001])
def test_tbq(backend, n):
    x = torch.randn(n)
    codec = gradsync.build_codec("tbq:threshold=0.8")
    p = codec.encode(x)
    t = torch.tensor(0.8)
    want = torch.where(x > t, t, torch.where(x < -t, -t, torch.tensor(0.0)))
    assert torch.equal(codec.decode(p), want)
    assert p.count == int((want != 0).sum())


@pytest.mark.parametrize("bits", [2, 4])
def test_terngrad_values_and_unbiasedness(backend, bits):
    x = torch.randn(40)
    codec = gradsync.build_codec(f"terngrad:bits={bits},seed=2")
    scale = float(x.abs().max())
    levels = 2 ** (bits - 1) - 1
    draws = 3000
    total = torch.zeros(40)
    for _ in range(draws):
        y = codec.decode(codec.encode(x))
        steps = y / (scale / levels)
        torch.testing.assert_close(steps, steps.round(), atol=1e-4, rtol=0)  # on the level grid
        assert float(y.abs().max()) <= scale * (1 + 1e-6)
        total += y
    mean = total / draws
    # per coordinate the draw has variance <= (scale/levels)^2 / 4
    bound = 6 * (scale / levels) * 0.5 / math.sqrt(draws)
    assert float((mean - x).abs().max()) < bound


def test_terngrad_clip_and_rank_decorrelation(backend):
    x = torch.randn(10_000)
    x[0] = 100.0
    codec = gradsync.build_codec("terngrad:clip=2.5")
    p = codec.encode(x)
    rms = float(x.square().mean().sqrt())
    assert p.header.s0 == pytest.approx(2.5 * rms, rel=1e-5)
    a = gradsync.build_codec("terngrad").encode(x, EncodeContext(rank=0))
    b = gradsync.build_codec("terngrad").encode(x, EncodeContext(rank=1))
    assert not torch.equal(a.data, b.data)


@pytest.mark.parametrize("name,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_formats_exact_on_representable_values(backend, name, dtype):
    x = (torch.randn(10_001) * 3).to(dtype).float()
    codec = gradsync.build_codec(name)
    for _ in range(2):  # first call picks the scale, the second reuses it
        p = codec.encode(x)
        assert torch.equal(codec.decode(p), x)
        assert p.nbytes == 24 + math.ceil(x.numel() * 2 / 8) * 8


def test_fp16_large_values_are_scaled_not_inf(backend):
    x = torch.tensor([1e6, -3e5, 1.0, 0.5] * 100)
    codec = gradsync.build_codec("fp16")
    p = codec.encode(x)
    assert not p.nonfinite and p.header.aux < 0
    torch.testing.assert_close(codec.decode(p), x, rtol=1e-3, atol=0)


def test_fp16_small_values_are_scaled_up(backend):
    x = torch.randn(1000) * 1e-7  # mostly below fp16's smallest normal (6e-5)
    codec = gradsync.build_codec("fp16")
    y = codec.decode(codec.encode(x))
    plain = x.half().float()  # what a plain cast keeps
    assert float((y - x).norm() / x.norm()) < 1e-3
    assert float((plain - x).norm() / x.norm()) > 1e-2


def test_fp16_without_scaling_flags_overflow(backend):
    x = torch.tensor([70000.0, 1.0] * 8)
    codec = gradsync.build_codec("fp16:scaling=none")
    p = codec.encode(x)
    assert p.header.flags & Flag.OVERFLOW and p.nonfinite
    assert codec.decode(p).isnan().all()


def test_half_shared_scale_is_summable(backend):
    xs = [torch.randn(1000) * 100 for _ in range(4)]
    amax = max(float(x.abs().max()) for x in xs)
    codec = gradsync.build_codec("fp16")
    ps = [codec.encode(x, EncodeContext(summands=4, amax=amax)) for x in xs]
    assert len({p.header.aux for p in ps}) == 1
    total = sum(codec.values(p).float() for p in ps).half()  # sum the value sections
    summed = codec.payload_from_bytes(ps[0].data.clone(), ps[0].shape, ps[0].dtype)
    codec.values(summed).copy_(total)
    # five roundings (four casts and the fp16 sum), each at most half an ulp of 4 * amax
    torch.testing.assert_close(codec.decode(summed), sum(xs), rtol=0, atol=5 * 4 * amax * 2**-11)


def test_powersgd_exact_on_low_rank(backend):
    u, v = torch.randn(64, 1), torch.randn(1, 200)
    m = u @ v
    codec = gradsync.build_codec("powersgd:rank=1")
    torch.testing.assert_close(codec.decode(codec.encode(m)), m, rtol=1e-4, atol=1e-4)
    m2 = torch.randn(30, 2) @ torch.randn(2, 50)
    codec2 = gradsync.build_codec("powersgd:rank=2")
    torch.testing.assert_close(codec2.decode(codec2.encode(m2)), m2, rtol=1e-4, atol=1e-4)


def test_powersgd_warm_start_improves_and_payload_size(backend):
    m = torch.randn(100, 8) @ torch.randn(8, 120) + 0.01 * torch.randn(100, 120)
    codec = gradsync.build_codec("powersgd:rank=8")
    errs = [float((codec.decode(codec.encode(m)) - m).norm() / m.norm()) for _ in range(4)]
    assert errs[-1] < errs[0] and errs[-1] < 0.02
    assert codec.encode(m).nbytes == 24 + (100 + 120) * 8 * 4 == codec.estimate_nbytes(12000, (100, 120))


def test_powersgd_sends_small_and_1d_tensors_dense(backend):
    codec = gradsync.build_codec("powersgd:rank=4")
    for x in (torch.randn(10), torch.randn(4, 5), torch.randn(3, 2, 2)):
        p = codec.encode(x)
        assert p.header.flags & Flag.DENSE
        assert torch.equal(codec.decode(p), x)


def test_powersgd_summable_steps_equal_compressing_the_sum():
    ms = [torch.randn(40, 30) for _ in range(3)]
    workers = [gradsync.build_codec("powersgd:rank=3") for _ in ms]
    streams = [w.stream("") for w in workers]
    p_sum = sum(w.project(m, s) for w, m, s in zip(workers, ms, streams, strict=False))
    q_sum = sum(w.reproject(m, p_sum, s) for w, m, s in zip(workers, ms, streams, strict=False))
    outs = [w.reconstruct(q_sum, s) for w, s in zip(workers, streams, strict=False)]
    ref = gradsync.build_codec("powersgd:rank=3")
    want = ref.decode(ref.encode(sum(ms)))  # one worker compressing the sum, same initial Q
    for o in outs:
        torch.testing.assert_close(o, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.int64, torch.bool, torch.uint8]
)
def test_none_is_the_identity(dtype):
    x = (torch.randn(7, 5) * 10).to(dtype)
    codec = gradsync.build_codec("none")
    p = codec.encode(x)
    y = codec.decode(p)
    assert y.dtype == dtype and torch.equal(y, x)


def test_powersgd_exact_on_a_matrix_of_lower_rank_than_requested(backend):
    m = torch.randn(30, 2) @ torch.randn(2, 40)
    codec = gradsync.build_codec("powersgd:rank=4")
    torch.testing.assert_close(codec.decode(codec.encode(m)), m, rtol=1e-4, atol=1e-4)
