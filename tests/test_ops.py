"""Common operators against independent torch formulas, on every backend."""

import math

import pytest
import torch

from gradsync.codecs import ops
from gradsync.codecs.ops import Key

SIZES = [1, 7, 8, 17, 1000, 40_003, 300_001]


def ref_keys(x, key):
    return {Key.ABS: x.abs(), Key.POS: x, Key.NEG: -x}[key]


@pytest.mark.parametrize("n", SIZES)
def test_tensor_stats(backend, n):
    x = torch.randn(n)
    st = ops.tensor_stats(x)
    assert st.numel == n
    assert st.nonfinite == 0
    assert st.max_abs == pytest.approx(float(x.abs().max()))
    assert st.sum_abs == pytest.approx(float(x.double().abs().sum()), rel=1e-5)
    assert st.sum_sq == pytest.approx(float(x.double().square().sum()), rel=1e-5)


def test_tensor_stats_flags_nonfinite(backend):
    for bad in (math.nan, math.inf, -math.inf):
        x = torch.randn(1000)
        x[517] = bad
        assert ops.tensor_stats(x).nonfinite > 0
    assert ops.tensor_stats(torch.zeros(0)).numel == 0


@pytest.mark.parametrize("key", list(Key))
@pytest.mark.parametrize("n", [5, 1003, 100_000])
def test_count_ge(backend, key, n):
    x = torch.randn(n)
    ts = [-2.0, -0.1, 0.0, 0.3, 1.0, 1.7, 2.5, 3.0] * 3  # 24 thresholds: two native chunks
    got = ops.count_ge(x, ts, key)
    want = [int((ref_keys(x, key) >= t).sum()) for t in ts]
    assert got == want


@pytest.mark.parametrize("n", [1, 9, 5000, 50_000])
def test_kth_largest(backend, n):
    x = torch.randn(n).abs()
    x[: n // 10] = x[0]  # duplicates
    for k in {1, max(1, n // 3), n}:
        assert ops.kth_largest(x.contiguous(), k) == float(torch.sort(x, descending=True).values[k - 1])


def test_kth_largest_rejects_bad_k():
    with pytest.raises(ValueError, match="k must be in"):
        ops.kth_largest(torch.ones(3), 4)


@pytest.mark.parametrize("key", list(Key))
@pytest.mark.parametrize("n", [100, 65_537, 300_001])
def test_candidate_set_is_exact_above_and_below_its_floor(backend, key, n):
    x = torch.randn(n)
    k = max(1, n // 100)
    cand = ops.CandidateSet.scan(x, key, target=k, minimum=k)
    keys = ref_keys(x, key)
    expected = torch.nonzero(keys >= cand.floor).flatten()
    assert torch.equal(cand.idx.long(), expected)
    assert torch.equal(cand.val, x[expected])
    assert cand.count >= k
    assert cand.stats.max_abs == pytest.approx(float(x.abs().max()))
    for t in (cand.floor - 0.5, cand.floor, cand.floor + 0.01, 1.5, 2.5):
        assert cand.count_ge(t) == int((keys >= ops.f32(t)).sum())
        idx, val = cand.select(t, t + 0.4)
        mask = (keys >= ops.f32(t)) & (keys < ops.f32(t + 0.4))
        assert torch.equal(idx.long(), torch.nonzero(mask).flatten())
        assert torch.equal(val, x[mask])


@pytest.mark.parametrize("key", list(Key))
@pytest.mark.parametrize(
    ("n", "k"), [(1, 1), (10, 3), (1000, 1000), (200_000, 200), (200_000, 2000), (65_536, 1)]
)
def test_topk_equals_torch_topk(backend, key, n, k):
    x = torch.randn(n)
    idx, val, st = ops.topk(x, k, key)
    want = torch.topk(ref_keys(x, key), k).indices.sort().values
    assert torch.equal(idx.long(), want)
    assert torch.equal(val, x[want])
    assert st.nonfinite == 0


def test_topk_ties_take_lowest_indices(backend):
    x = torch.zeros(100_000)
    x[::1000] = 1.0  # 100 equal maxima
    idx, _, _ = ops.topk(x, 10)
    assert idx.long().tolist() == list(range(0, 10_000, 1000))


def test_topk_at_least_limits_eligible(backend):
    x = -torch.rand(50_000) - 0.1
    x[[5, 70, 40_000]] = torch.tensor([1.0, 2.0, 3.0])
    idx, _val, _ = ops.topk(x, 100, Key.POS, at_least=1e-30)
    assert idx.long().tolist() == [5, 70, 40_000]


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 1001])
def test_pack_unpack_roundtrip(bits, n):
    codes = torch.randint(0, 2**bits, (n,))
    packed = ops.pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == ops.packed_nbytes(n, bits) == math.ceil(n * bits / 8)
    assert torch.equal(ops.unpack_codes(packed, bits, n), codes)
    # bit order: element 0 in the least significant bits of byte 0
    if n >= 2:
        assert int(packed[0]) & (2**bits - 1) == int(codes[0])


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [3, 8, 1001, 70_003])
def test_lut_decode(backend, bits, n):
    codes = torch.randint(0, 2**bits, (n,))
    lut = torch.randn(2**bits).tolist()
    packed = ops.pack_codes(codes, bits)
    out = torch.empty(n)
    ops.lut_decode(packed, bits, lut, out)
    want = torch.tensor(lut)[codes]
    assert torch.equal(out, want)
    base = torch.randn(n)
    acc = base.clone()
    ops.lut_decode(packed, bits, lut, acc, accumulate=True)
    torch.testing.assert_close(acc, base + want)


@pytest.mark.parametrize("n", [1, 9, 1024, 100_003])
def test_sign_pack(backend, n):
    x = torch.randn(n)
    if n > 3:
        x[2] = 0.0
        x[3] = -0.0
    out = torch.empty(ops.packed_nbytes(n, 1), dtype=torch.uint8)
    st = ops.sign_pack(x, out)
    assert torch.equal(ops.unpack_codes(out, 1, n), (x >= 0).long())
    assert st.pos_count == int((x >= 0).sum())
    assert st.neg_count == n - st.pos_count
    assert st.pos_sum == pytest.approx(float(x[x >= 0].double().sum()), rel=1e-5, abs=1e-6)
    assert st.neg_sum == pytest.approx(float(x[x < 0].double().sum()), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("n", [5, 4096, 100_001])
def test_threshold_pack(backend, n):
    x = torch.randn(n)
    out = torch.empty(ops.packed_nbytes(n, 2), dtype=torch.uint8)
    nz, nf = ops.threshold_pack(x, 0.7, out)
    want = (x > 0.7).long() + 2 * (x < -0.7).long()
    assert torch.equal(ops.unpack_codes(out, 2, n), want)
    assert nz == int((want != 0).sum())
    assert nf == 0


def _lowbias32(h):
    h ^= h >> 16
    h = (h * 0x7FEB352D) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x846CA68B) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_hashed_uniform_matches_the_formula():
    k1, k2 = 0xDEADBEEF, 12345
    u = ops.hashed_uniform(1000, k1, k2)
    for i in (0, 1, 2, 500, 999):
        want = ((_lowbias32((i + k1) & 0xFFFFFFFF) ^ k2) >> 9) / 2**23
        assert float(u[i]) == want
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.05
    u16 = ops.hashed_uniform16(1000, k1, k2)
    for i in (0, 7, 8, 15, 16, 999):
        h = _lowbias32(((i // 16) * 8 + i % 8 + k1) & 0xFFFFFFFF) ^ k2
        assert float(u16[i]) == ((h >> 16) if i % 16 >= 8 else (h & 0xFFFF)) / 2**16
    assert abs(float(u16.mean()) - 0.5) < 0.05


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [7, 8, 1000, 100_003])
def test_stochastic_pack_is_the_formula(backend, bits, n):
    x = torch.randn(n)
    levels = 2 ** (bits - 1) - 1
    mult = levels / float(x.abs().max())
    words = (123456789, 987654321)
    out = torch.empty(ops.packed_nbytes(n, bits), dtype=torch.uint8)
    ops.stochastic_pack(x, mult, levels, bits, words, out)
    u = ops.hashed_uniform16(n, *words)
    # the documented formula: floor(|x| * mult + u), with the sum formed as (|x| * mult) + (1 + u)
    lvl = (torch.floor(x.abs() * torch.tensor(mult) + (1 + u)) - 1).clamp(0, levels).long()
    want = lvl | ((x < 0).long() << (bits - 1))
    assert torch.equal(ops.unpack_codes(out, bits, n), want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 9, 100_003])
def test_cast_checked_matches_torch_cast(backend, dtype, n):
    x = torch.randn(n) * 100
    out = torch.empty(n, dtype=torch.int16)
    st = ops.cast_checked(x, dtype, 0.25, out)
    assert torch.equal(out.view(dtype), (x * 0.25).to(dtype))
    assert st.max_abs == pytest.approx(float(x.abs().max()))
    assert st.nonfinite == 0 and st.overflow == 0
    back = torch.empty(n)
    ops.uncast(out, dtype, 4.0, back)
    assert torch.equal(back, (x * 0.25).to(dtype).float() * 4.0)


@pytest.mark.parametrize(("values", "overflow"), [([-65519.0], False), ([-65520.0], True), ([70000.0], True)])
def test_cast_checked_flags_overflow(backend, values, overflow):
    # -65519 rounds to -65504; from 65520 (65504 + half an ulp) on, values round to inf
    x = torch.tensor(values + [0.5] * 20)
    out = torch.empty(x.numel(), dtype=torch.int16)
    st = ops.cast_checked(x, torch.float16, 1.0, out)
    assert bool(st.overflow) == overflow and not st.nonfinite
    assert torch.equal(out.view(torch.float16), x.half())
    big = torch.tensor([3.4e38, 1.0] * 9)
    assert ops.cast_checked(big, torch.bfloat16, 1.0, torch.empty(18, dtype=torch.int16)).overflow


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_cast_checked_flags_nonfinite(backend, bad):
    x = torch.tensor([1.0, bad] + [0.5] * 20)
    st = ops.cast_checked(x, torch.float16, 1.0, torch.empty(x.numel(), dtype=torch.int16))
    assert st.nonfinite


def test_sparse_add(backend):
    out = torch.zeros(10)
    idx = torch.tensor([1, 3, 3, 9], dtype=torch.int32)
    val = torch.tensor([1.0, 2.0, 3.0, 4.0])
    ops.sparse_add_(out, idx, val)
    assert out.tolist() == [0, 1, 0, 5, 0, 0, 0, 0, 0, 4]
    ops.sparse_add_(out, idx.long(), val, alpha=-1.0)
    assert out.abs().sum() == 0


@pytest.mark.parametrize("bad", [-1, 10, 2**31 - 1])
def test_sparse_add_rejects_out_of_range(backend, bad):
    out = torch.zeros(10)
    with pytest.raises(IndexError, match=f"sparse index {bad} is outside a tensor of 10 elements"):
        ops.sparse_add_(out, torch.tensor([0, bad], dtype=torch.int32), torch.ones(2))
    assert out.abs().sum() == 0  # unchanged


def test_random_subset(backend):
    gen = ops.make_generator(0, "a")
    counts = torch.zeros(50)
    for _ in range(2000):
        idx = ops.random_subset(50, 5, gen).long()
        assert idx.numel() == 5
        assert torch.equal(idx, idx.unique())  # distinct and sorted
        counts[idx] += 1
    # each index is picked with probability 1/10: 200 expected, sd ~13.4
    assert float((counts - 200).abs().max()) < 6 * 13.4
    assert ops.random_subset(7, 7, gen).long().tolist() == list(range(7))
    assert ops.random_subset(7, 0, gen).numel() == 0


def test_generators_are_reproducible_and_keyed():
    a, b, c = ops.make_generator(5, "w"), ops.make_generator(5, "w"), ops.make_generator(5, "v")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    assert not torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=c))
    assert ops.stream_seed(5, "w") == ops.stream_seed(5, "w") != ops.stream_seed(6, "w")


def test_orthogonalize():
    m = torch.randn(50, 4)
    ops.orthogonalize_(m)
    torch.testing.assert_close(m.T @ m, torch.eye(4), atol=1e-5, rtol=0)
    z = torch.zeros(6, 2)
    ops.orthogonalize_(z)
    assert not z.isnan().any()


def test_gather(backend):
    x = torch.randn(1000)
    idx = torch.tensor([0, 999, 5], dtype=torch.int32)
    assert torch.equal(ops.gather(x, idx), x[idx.long()])


def test_backend_switch_rejects_unknown_name():
    with pytest.raises(ValueError, match="backend must be"), ops.backend("cuda"):
        pass


@pytest.mark.parametrize("order", ["sorted", "unsorted", "duplicates"])
def test_sparse_to_dense(backend, order):
    n = 100_003
    idx = torch.randperm(n)[:5000].sort().values
    if order == "unsorted":
        idx = idx[torch.randperm(5000)]
    if order == "duplicates":
        idx[10] = idx[11]
    idx = idx.to(torch.int32)
    val = torch.randn(5000)
    out = torch.full((n,), 9.0)
    ops.sparse_to_dense_(out, idx, val)
    want = torch.zeros(n).index_add_(0, idx.long(), val)
    assert torch.equal(out, want)
    with pytest.raises(IndexError, match=f"sparse index {n} is outside"):
        ops.sparse_to_dense_(out, torch.tensor([0, n], dtype=torch.int32), torch.ones(2))


def test_candidate_set_counts_many_thresholds(backend):
    x = torch.randn(200_000)
    cand = ops.CandidateSet.scan(x, Key.ABS, target=2000, minimum=2000)
    ts = [0.1, cand.floor, 2.9, 3.5, cand.floor - 0.2, 4.0]
    assert cand.count_ge_many(ts) == [int((x.abs() >= ops.f32(t)).sum()) for t in ts]


def test_a_scan_refuses_addends_of_another_size():
    """``CandidateSet.scan(addends=...)``: addends that do not match the tensor are refused before
    anything is written, naming the sizes."""
    from gradsync.codecs.ops import CandidateSet, Key

    x = torch.full((100,), 7.0)
    with pytest.raises(ValueError, match=r"scan: addends of \[100, 99\] elements for a tensor of 100"):
        CandidateSet.scan(x, Key.ABS, target=10, addends=(torch.zeros(100), torch.zeros(99)))
    assert bool((x == 7.0).all())


def test_the_floor_sample_does_not_line_up_with_a_gradients_columns(backend):
    """A weight's gradient is an outer product of errors and activations, so its columns differ
    by their activation. Here the columns a power-of-two stride through a 1024 x 4096 matrix would
    sample (every 256th, from the 128th) are 8x larger than the rest: a sample that lines up with
    them puts the floor above the k-th largest key, and the selection then reads the whole tensor
    again. The floor must stay at or below it (k from torch.topk)."""
    errors = torch.randn(1024, 1)
    activations = torch.ones(1, 4096)
    activations[0, 128::256] = 8.0
    x = (errors * activations).reshape(-1)
    k = x.numel() // 100
    kth = float(torch.topk(x.abs(), k).values[-1])
    cand = ops.CandidateSet.scan(x, Key.ABS, target=k, minimum=0)
    assert cand.floor <= kth
    assert cand.count >= k


def _is_prime(q: int) -> bool:
    return q >= 2 and all(q % d for d in range(2, int(q**0.5) + 1))


@pytest.mark.parametrize(
    ("n", "s"), [(4_194_304, 16_384), (65_536, 4096), (1 << 30, 65_536), (300_001, 4096)]
)
def test_the_sample_stride_is_the_smallest_prime_of_at_least_n_over_s(n, s):
    from gradsync.codecs.ops.select import sample_stride

    p = sample_stride(n, s)
    low = -(-n // s)  # n / s rounded up: at most s samples
    assert p >= low and _is_prime(p)
    assert not any(_is_prime(q) for q in range(low, p))
