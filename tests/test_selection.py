"""Selection codecs against exact references (torch.topk, literal pseudo-code, closed forms)."""

import math

import pytest
import torch

import gradsync
from gradsync.codecs import EncodeContext
from gradsync.codecs.ops import f32, make_generator


def selected(codec, payload):
    return codec.transmitted(payload)


def exact_set(x, k):
    return set(torch.topk(x.abs(), k).indices.tolist())


@pytest.mark.parametrize("n", [1, 10, 999, 100_000, 300_007])
@pytest.mark.parametrize("density", [0.3, 0.01, 0.001])
def test_topk_returns_torch_topk_set(backend, n, density):
    x = torch.randn(n)
    codec = gradsync.build_codec(f"topk:density={density}")
    p = codec.encode(x)
    k = max(1, math.ceil(density * n))
    idx, val = selected(codec, p)
    assert p.count == k
    assert set(idx.tolist()) == exact_set(x, k)
    assert torch.equal(val, x[idx.long()])
    y = codec.decode(p)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[idx.long()] = True
    assert torch.equal(y[mask], x[mask]) and y[~mask].abs().sum() == 0


def mstopk_reference(x, k, iters, gen):
    """Paper 01 Algorithm 1, line by line (with +inf for an unset upper threshold)."""
    a = x.abs()
    mean, u = float(a.mean()), float(a.max())
    lo, hi = 0.0, 1.0
    k1, k2 = 0, x.numel()
    thres1, thres2 = math.inf, 0.0
    for _ in range(iters):
        ratio = lo + (hi - lo) / 2
        thres = f32(mean + ratio * (u - mean))
        nnz = int((a >= thres).sum())
        if nnz <= k:
            hi = ratio
            if nnz > k1:
                k1, thres1 = nnz, thres
        else:
            lo = ratio
            if nnz < k2:
                k2, thres2 = nnz, thres
    i1 = torch.nonzero(a >= thres1).flatten()
    i2 = torch.nonzero((a < thres1) & (a >= thres2)).flatten()
    rand = int(torch.randint(0, i2.numel() - (k - k1) + 1, (1,), generator=gen))
    return torch.cat([i1, i2[rand : rand + k - k1]])


@pytest.mark.parametrize("density", [0.01, 0.001])
@pytest.mark.parametrize("iters", [3, 20])
def test_mstopk_follows_algorithm_1(backend, density, iters):
    x = torch.randn(200_003)
    codec = gradsync.build_codec(f"mstopk:density={density},iters={iters},seed=7")
    p = codec.encode(x, EncodeContext(key="w"))
    k = math.ceil(density * x.numel())
    ref = mstopk_reference(x, k, iters, make_generator(7, "w")).sort().values  # sent in index order
    idx, val = selected(codec, p)
    assert p.count == k
    assert torch.equal(idx.long(), ref)
    assert torch.equal(val, x[ref])


@pytest.mark.parametrize("density", [0.01, 0.001])
def test_mstopk_is_nearly_exact_on_gaussian_data(backend, density):
    # paper 01's claim: MSTopK's selection is (almost) the true top-k
    x = torch.randn(2**20)
    codec = gradsync.build_codec(f"mstopk:density={density}")
    k = math.ceil(density * x.numel())
    idx, _ = selected(codec, codec.encode(x))
    assert idx.numel() == k
    overlap = len(set(idx.tolist()) & exact_set(x, k)) / k
    assert overlap >= 0.99


@pytest.mark.parametrize("n", [50, 100_000, 300_007])
def test_trimmed_topk_is_exact(backend, n):
    x = torch.randn(n) * torch.rand(n)  # heavier tails than a Gaussian
    codec = gradsync.build_codec("trimmed_topk:density=0.01")
    idx, _ = selected(codec, codec.encode(x))
    k = math.ceil(0.01 * n)
    assert set(idx.tolist()) == exact_set(x, k)


@pytest.mark.parametrize("n", [1000, 100_000, 400_000])
@pytest.mark.parametrize("density", [0.01, 0.001])
def test_bsearch_count_in_k_2k_and_threshold_reuse(backend, n, density):
    codec = gradsync.build_codec(f"bsearch:density={density},reuse=3")
    k = math.ceil(density * n)
    ages = []
    base = torch.randn(n)
    for _ in range(5):
        x = base + 0.001 * torch.randn(n)  # a slowly changing gradient
        p = codec.encode(x)
        idx, _val = selected(codec, p)
        assert k <= p.count <= 2 * k
        # exactly the elements above the threshold in use
        t = codec.stream("").threshold
        assert torch.equal(idx.long(), torch.nonzero(x.abs() >= t).flatten())
        ages.append(codec.stream("").age)
    assert ages[:3] == [1, 2, 3] and ages[3] == 1  # searched, reused twice, searched again


def test_bsearch_with_few_nonzeros_sends_them_all(backend):
    x = torch.zeros(10_000)
    x[[3, 77]] = torch.tensor([1.0, -2.0])
    codec = gradsync.build_codec("bsearch:k=10")
    idx, val = selected(codec, codec.encode(x))
    assert idx.tolist() == [3, 77] and val.tolist() == [1.0, -2.0]


@pytest.mark.parametrize("n", [5000, 300_000])
@pytest.mark.parametrize("density", [0.01, 0.001])
def test_dgc_count_within_tolerance_and_exact_when_full(backend, n, density):
    codec = gradsync.build_codec(f"dgc:density={density},tolerance=0.2,seed=3")
    k = math.ceil(density * n)
    full = 0
    for _ in range(6):
        x = torch.randn(n)
        idx, _ = selected(codec, codec.encode(x))
        assert math.ceil(0.8 * k) <= idx.numel() <= k
        top = exact_set(x, idx.numel())
        # whatever dgc sends is the exact top-|sent| set
        assert set(idx.tolist()) == top
        full += idx.numel() == k
    assert full >= 1


def test_graddrop_threshold_and_density(backend):
    x = torch.randn(200_000)
    codec = gradsync.build_codec("graddrop:threshold=2.0")
    idx, _val = selected(codec, codec.encode(x))
    assert torch.equal(idx.long(), torch.nonzero(x.abs() >= 2.0).flatten())
    codec = gradsync.build_codec("graddrop:density=0.01,sample=0.05")
    counts = [codec.encode(torch.randn(200_000)).count for _ in range(5)]
    assert all(1000 <= c <= 3000 for c in counts)  # about 2000, varies with the sample


def test_randomk_values_and_unbiasedness(backend):
    x = torch.randn(64)
    codec = gradsync.build_codec("randomk:k=8,unbiased=true,seed=1")
    total = torch.zeros(64)
    draws = 4000
    for _ in range(draws):
        p = codec.encode(x)
        idx, val = selected(codec, p)
        assert idx.numel() == 8 and idx.unique().numel() == 8
        torch.testing.assert_close(val, x[idx.long()] * 8)
        total += codec.decode(p)
    mean = total / draws
    # each coordinate: mean of `draws` values that are 8x with prob 1/8, else 0: sd = |x| sqrt(7 / draws)
    bound = 5 * x.abs() * math.sqrt(7 / draws) + 1e-6
    assert bool(((mean - x).abs() <= bound).all())


def test_randomk_biased_sends_raw_values(backend):
    x = torch.randn(1000)
    codec = gradsync.build_codec("randomk:density=0.05")
    idx, val = selected(codec, codec.encode(x))
    assert torch.equal(val, x[idx.long()])


def test_qrgc_alternates_signs_and_sends_one_mean(backend):
    x = torch.randn(100_000)
    codec = gradsync.build_codec("qrgc:k=100")
    p1, p2 = codec.encode(x), codec.encode(x)
    i1, _ = codec.transmitted(p1)
    i2, _ = codec.transmitted(p2)
    assert set(i1.tolist()) == set(torch.topk(x, 100).indices.tolist())
    assert set(i2.tolist()) == set(torch.topk(-x, 100).indices.tolist())
    assert p1.header.s0 == pytest.approx(float(x[i1.long()].mean()), rel=1e-5)
    assert p2.header.s0 == pytest.approx(float(x[i2.long()].mean()), rel=1e-5)
    y = codec.decode(p1)
    assert torch.allclose(y[i1.long()], torch.full((100,), p1.header.s0))
    assert int((y != 0).sum()) == 100


def test_qrgc_with_too_few_of_a_sign(backend):
    x = -torch.rand(1000) - 0.5
    x[10] = 3.0
    codec = gradsync.build_codec("qrgc:k=5")
    idx, _ = codec.transmitted(codec.encode(x))
    assert idx.tolist() == [10]


@pytest.mark.parametrize(
    "spec", ["topk", "mstopk", "trimmed_topk", "bsearch", "dgc", "graddrop", "randomk", "qrgc"]
)
def test_two_ranks_with_the_same_spec_choose_identically(backend, spec):
    xs = [torch.randn(50_000) for _ in range(3)]
    a, b = (
        gradsync.build_codec(
            spec + ":seed=9" if spec not in ("topk", "trimmed_topk", "bsearch", "qrgc") else spec
        ),
        None,
    )
    b = gradsync.build_codec(a.config.spec())
    for x in xs:
        pa, pb = a.encode(x, EncodeContext(key="layer")), b.encode(x.clone(), EncodeContext(key="layer"))
        assert torch.equal(pa.data, pb.data)


@pytest.mark.parametrize("spec", ["topk", "mstopk", "trimmed_topk", "bsearch", "dgc"])
def test_mostly_zero_tensors_are_fast_and_exact(backend, spec):
    # 99.5% exact zeros: the candidates are the non-zero elements, not the whole tensor
    x = torch.zeros(1_000_000)
    nz = torch.randperm(x.numel())[:5000]
    x[nz] = torch.randn(5000)
    codec = gradsync.build_codec(f"{spec}:k=1000")
    idx, val = selected(codec, codec.encode(x))
    assert torch.equal(val, x[idx.long()])
    if spec in ("topk", "trimmed_topk"):
        assert set(idx.tolist()) == exact_set(x, 1000)
    # fewer non-zeros than k: topk takes them all plus zeros
    y = torch.zeros(1_000_000)
    y[nz[:10]] = 1.0 + torch.rand(10)
    got = set(
        selected(gradsync.build_codec("topk:k=50"), gradsync.build_codec("topk:k=50").encode(y))[0].tolist()
    )
    assert set(nz[:10].tolist()) <= got and len(got) == 50


@pytest.mark.parametrize(
    "numel, chunk, density", [(10_000, 256, 0.01), (4096, 4096, 0.05), (1000, 64, 0.3), (5, 64, 0.5)]
)
def test_chunked_topk_keeps_each_chunks_largest(numel, chunk, density):
    """Against a loop over the chunks with torch.topk on each (the last one may be shorter): the
    same elements, and a count that follows from the size alone."""
    x = torch.randn(numel)
    codec = gradsync.build_codec(f"chunktopk:density={density},chunk={chunk}")
    payload = codec.encode(x, EncodeContext(key="w"))
    want = torch.zeros_like(x)
    for start in range(0, numel, chunk):
        part = x[start : start + chunk]
        keep = min(part.numel(), max(1, math.ceil(density * part.numel())))
        top = part.abs().topk(keep).indices + start
        want[top] = x[top]
    assert torch.equal(codec.decode(payload), want)
    assert payload.count == codec.target_count(numel) == int((want != 0).sum())
    assert payload.nbytes == codec.estimate_nbytes(numel)
    idx, _ = selected(codec, payload)
    assert torch.equal(idx, idx.sort().values)  # ascending, as every selection returns them
    with pytest.raises(ValueError, match="chunktopk: give density"):
        gradsync.build_codec("chunktopk:k=10")
    with pytest.raises(ValueError, match="chunk"):
        gradsync.build_codec("chunktopk:chunk=0")
