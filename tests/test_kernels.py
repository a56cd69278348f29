"""The fused triton kernels of gradsync.codecs.kernels against the eager references.

On a machine with CUDA and a working triton the kernels run on the GPU; elsewhere they run on
the CPU under triton's interpreter: this module sets TRITON_INTERPRET=1 for its own tests only
(a module-scoped fixture, restored afterwards, so no other test file sees it) before any kernel
is defined. Every kernel is compared with the eager reference it replaces: bit for bit where the
result is deterministic (selections, codes, counts, residuals), to a stated tolerance only for
float sums accumulated in another order. Each ``*_torch`` twin is compared too (it is what runs
without triton). Sizes stay small: the interpreter runs a program at a time in numpy.
"""

from __future__ import annotations

import importlib.util
import math
import os

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (the test extra brings it)", allow_module_level=True)

from gradsync.codecs import EncodeContext
from gradsync.codecs import kernels as K
from gradsync.codecs import selection_on_device as sod
from gradsync.codecs.kernels import launch, topk
from gradsync.codecs.ops import (
    cast_on_device,
    device_stats,
    hashed_uniform,
    lut_decode,
    packed_nbytes,
    sign_pack_on_device,
    stochastic_pack,
    threshold_pack_on_device,
    uncast,
    unpack_codes,
)

# numpy's warnings from inside the interpreter (casting inf, inf - inf): the values are checked
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SUM_RTOL = 1e-4  # float sums: per-block float32, then float64 (torch: its own reduction order)


@pytest.fixture(scope="module", autouse=True)
def dev():
    """CUDA when triton compiles for it; else the CPU under the interpreter, for this module only."""
    if torch.cuda.is_available() and K.available("cuda"):
        yield torch.device("cuda")
        return
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        if not K.available("cpu"):  # triton imports (checked above): tests/conftest.py loads it
            pytest.fail(  # interpreted, so a skip here would hide every kernel from the suite
                "triton imports but its interpreter does not run the kernels: was triton.language "
                "imported without TRITON_INTERPRET=1 before tests/conftest.py ran?"
            )
        yield torch.device("cpu")
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


def data(n, dtype, dev, seed=0, kind="normal"):
    g = torch.Generator().manual_seed(seed)
    if kind == "ties":  # few distinct magnitudes: ties everywhere, zeros included
        x = torch.randint(-4, 5, (n,), generator=g).float() * 0.25
    elif kind == "heavy":
        x = torch.randn(n, generator=g) ** 3
    else:
        x = torch.randn(n, generator=g)
    if kind == "nonfinite" and n:
        at = torch.randint(0, n, (max(1, n // 500),), generator=g)
        x[at] = torch.tensor([math.nan, math.inf, -math.inf]).repeat(at.numel())[: at.numel()]
    return x.to(dtype).to(dev)


def same(x, y):
    """Equal element for element, NaN equal to NaN (its sign and payload bits are not compared)."""
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if not x.is_floating_point():
        return torch.equal(x, y)
    nx, ny = torch.isnan(x), torch.isnan(y)
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.equal(nx, ny) and torch.equal(torch.where(nx, zero, x), torch.where(ny, zero, y))


def words_of(seed, dev):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**32, (2,), generator=g, dtype=torch.int64).to(dev)


# --- per-chunk top-k ---------------------------------------------------------------------------


def chunk_counts(n, chunk, density):
    full, tail = divmod(n, chunk)
    per = min(chunk, max(1, math.ceil(density * chunk)))
    of_tail = min(tail, max(1, math.ceil(density * tail))) if tail else 0
    return full, per, of_tail


def lowest_first(v, chunk, per, of_tail):
    """Per chunk the k largest |v| (NaN as +inf), the lowest positions first among equal ones."""
    keys = v.float().abs().nan_to_num(nan=math.inf)
    n = v.numel()
    full = n // chunk
    parts = []
    if full:
        order = torch.sort(keys[: full * chunk].view(full, chunk), dim=1, descending=True, stable=True)
        top = order.indices[:, :per].sort(dim=1).values
        parts.append((top + torch.arange(0, full * chunk, chunk, device=v.device).unsqueeze(1)).view(-1))
    if of_tail:
        order = torch.sort(keys[full * chunk :], descending=True, stable=True).indices[:of_tail]
        parts.append(order.sort().values + full * chunk)
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=v.device)


def run_chunked(fn, a, b, chunk, per, of_tail):
    count = (a.numel() // chunk) * per + of_tail
    out = {
        "idx": torch.empty(count, dtype=torch.int32, device=a.device),
        "val": torch.empty(count, dtype=a.dtype, device=a.device),
        "nonfinite": torch.empty(1, dtype=torch.int32, device=a.device),
        "v": torch.empty_like(a),
        "residual": torch.empty_like(a),
    }
    fn(
        a, chunk, per, of_tail, out["idx"], out["val"], out["nonfinite"], b=b, v_out=out["v"],
        residual_out=out["residual"],
    )  # fmt: skip
    return out


@pytest.mark.parametrize(
    ("n", "chunk", "density", "kind"),
    [
        (0, 4096, 0.01, "normal"),
        (1, 4096, 0.01, "normal"),
        (3 * 4096 + 5, 4096, 0.01, "normal"),
        (2 * 4096, 4096, 0.3, "heavy"),
        (4100, 64, 0.05, "ties"),
        (1000, 1, 0.5, "normal"),
        (777, 7, 0.3, "nonfinite"),
        (9000, 1000, 0.02, "ties"),
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chunked_topk_matches_the_reference(dev, n, chunk, density, kind, dtype):
    a, b = data(n, dtype, dev, 1, kind), data(n, dtype, dev, 2, kind)
    _, per, of_tail = chunk_counts(n, chunk, density)
    got = run_chunked(K.chunked_topk, a, b, chunk, per, of_tail)
    v = torch.add(a, b)
    assert same(got["v"], v)
    expected = lowest_first(v, chunk, per, of_tail)
    assert torch.equal(got["idx"].long(), expected)
    assert same(got["val"], v[expected])
    assert int(got["nonfinite"]) == int((~torch.isfinite(v.float())).sum())
    assert same(got["residual"], v.clone().index_fill_(0, expected, 0))
    if n:  # the reference (torch.topk: any of the tied) selects the same magnitudes
        ref = sod.chunked_topk(v, chunk, per, of_tail)
        keys = v.float().abs().nan_to_num(nan=math.inf)
        assert torch.equal(keys[got["idx"].long()].sort().values, keys[ref.idx.long()].sort().values)
        if kind != "ties" and dtype == torch.float32 and not (~torch.isfinite(v)).any():
            assert torch.equal(got["idx"], ref.idx)
    twin = run_chunked(K.chunked_topk_torch, a, b, chunk, per, of_tail)
    assert all(same(got[key], twin[key]) for key in got)


@pytest.mark.parametrize("chunk", [65, 300])
def test_chunked_topk_looped_kernel_for_large_chunks(dev, monkeypatch, chunk):
    """Chunks above REGISTER_CHUNK take the tiled kernel (lowered here to keep the interpreter
    fast); v_out may be the input itself."""
    monkeypatch.setattr(topk, "REGISTER_CHUNK", 64)
    n = 2 * chunk + 31
    a, b = data(n, torch.float32, dev, 3, "ties"), data(n, torch.float32, dev, 4)
    v = torch.add(a, b)
    _, per, of_tail = chunk_counts(n, chunk, 0.1)
    idx = torch.empty(2 * per + of_tail, dtype=torch.int64, device=dev)
    val = torch.empty(2 * per + of_tail, device=dev)
    nonfinite = torch.empty(1, dtype=torch.int64, device=dev)
    residual = torch.empty_like(a)
    K.chunked_topk(a, chunk, per, of_tail, idx, val, nonfinite, b=b, v_out=a, residual_out=residual)
    expected = lowest_first(v, chunk, per, of_tail)
    assert torch.equal(a, v)  # v_out aliased the first addend
    assert torch.equal(idx, expected)
    assert torch.equal(val, v[expected])
    assert torch.equal(residual, v.clone().index_fill_(0, expected, 0))
    assert int(nonfinite) == 0


# --- statistics and threshold selection --------------------------------------------------------


@pytest.mark.parametrize("n", [1, 4095, 4097, 3 * 4096 + 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_stats_match_device_stats(dev, n, dtype):
    a, b = data(n, dtype, dev, 5, "nonfinite" if n > 4096 else "normal"), data(n, dtype, dev, 6)
    stats, v_out = torch.empty(4, dtype=torch.float64, device=dev), torch.empty_like(a)
    K.fused_stats(a, stats, b=b, v_out=v_out)
    v = torch.add(a, b)
    ref = device_stats(v)
    assert same(v_out, v)
    assert float(stats[1]) == float(ref.max_abs)  # exact
    assert int(stats[2]) == int((~torch.isfinite(v.float())).sum())  # exact
    for got, want in ((stats[0], ref.sum_abs), (stats[3], ref.sum_sq)):
        if math.isfinite(float(want)):
            assert float(got) == pytest.approx(float(want), rel=SUM_RTOL)
        else:
            assert math.isnan(float(got)) == math.isnan(float(want))


def run_above(fn, a, b, t, capacity, strict, with_v):
    n, dev = a.numel(), a.device
    slots = min(capacity, n)
    out = {
        "idx": torch.empty(slots, dtype=torch.int32, device=dev),
        "val": torch.empty(slots, dtype=a.dtype, device=dev),
        "count": torch.empty((), dtype=torch.int64, device=dev),
        "stats": torch.empty(4, dtype=torch.float64, device=dev),
    }
    v_out = torch.empty_like(a) if with_v else None
    fn(a, t, capacity, out["idx"], out["val"], out["count"], out["stats"], strict=strict, b=b, v_out=v_out)
    if with_v:
        out["v"] = v_out
    return out


@pytest.mark.parametrize(
    ("n", "capacity", "kind"),
    [(5, 2, "normal"), (9000, 40, "normal"), (9000, 9000, "ties"), (4096 * 3 + 7, 300, "nonfinite")],
)
@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_select_above_matches_the_reference(dev, n, capacity, kind, strict, dtype):
    a, b = data(n, dtype, dev, 7, kind), data(n, dtype, dev, 8, kind)
    v = torch.add(a, b)
    keys = v.float().abs()
    finite = keys[torch.isfinite(keys)]
    thresholds = [2.0, 1e9, math.nan, -1.0, float(finite.max()), float(finite.median())]
    for i, tv in enumerate(thresholds):
        t = torch.tensor(tv, dtype=torch.float64 if i % 2 else torch.float32, device=dev)
        ref = sod.above(v, keys, t, capacity, strict)
        with_v = i % 3 != 2  # without v_out: the compaction recomputes a + b
        got = run_above(K.select_above, a, b, t, capacity, strict, with_v)
        assert torch.equal(got["idx"], ref.idx), tv
        assert same(got["val"], ref.val), tv
        assert int(got["count"]) == int(ref.count), tv
        assert float(got["stats"][1]) == float(device_stats(v).max_abs)
        if with_v:
            assert same(got["v"], v)
        twin = run_above(K.select_above_torch, a, b, t, capacity, strict, with_v)
        assert all(same(got[key], twin[key]) for key in ("idx", "val", "count"))


@pytest.mark.parametrize(("n", "k", "sample"), [(3000, 30, 0.01), (20000, 200, 0.1), (2**24 + 3, 50, 1e-4)])
def test_sampled_threshold_and_dgc_match_the_reference(dev, n, k, sample):
    """n = 2^24 + 3 is not a float32: the positions u * n round as torch rounds them."""
    big = n > 2**20
    a = data(n, torch.float32, dev, 9)
    b = None if big else data(n, torch.float32, dev, 10)
    v = a if b is None else torch.add(a, b)
    words = words_of(11, dev)
    t = torch.empty(1, device=dev)
    K.sampled_threshold(a, k, sample, words, t, b=b)
    ref = sod.sampled_threshold(v, k, sample, words)
    assert torch.equal(t.view(()), ref)
    if big:
        return
    got = run_above(K.select_above, a, b, t, k, False, True)  # DGC: what passes, at most k
    ref_sel = sod.dgc(v, k, sample, words)
    assert torch.equal(got["idx"], ref_sel.idx)
    assert torch.equal(got["val"], ref_sel.val)
    assert int(got["count"]) == int(ref_sel.count)


# --- MSTopK ------------------------------------------------------------------------------------


def run_mstopk(fn, a, k, iters, word, b=None, **extra):
    n, dev = a.numel(), a.device
    cap = min(k, n)
    out = {
        "idx": torch.empty(cap, dtype=torch.int32, device=dev),
        "val": torch.empty(cap, dtype=a.dtype, device=dev),
        "count": torch.empty(1, dtype=torch.int64, device=dev),
        "stats": torch.empty(4, dtype=torch.float64, device=dev),
    }
    v_out = torch.empty_like(a) if b is not None else None
    fn(a, k, iters, word, out["idx"], out["val"], out["count"], out["stats"], b=b, v_out=v_out, **extra)
    return out


def near_constant(dev):
    """Data whose computed mean exceeds its maximum (the thresholds then fall with the ratio)."""
    g = torch.Generator().manual_seed(12)
    for _ in range(500):
        n = int(torch.randint(3, 60, (), generator=g))
        c = float(torch.rand((), generator=g)) + 0.05
        x = torch.full((n,), c)
        x[torch.randint(0, n, (n // 3,), generator=g)] = torch.nextafter(torch.tensor(c), torch.tensor(0.0))
        x = x.to(dev)
        stats = torch.empty(4, dtype=torch.float64, device=dev)
        K.fused_stats(x, stats)
        if (stats[0] / n).float() > stats[1].float():
            return x
    raise AssertionError("no near-constant data with mean > max found")


@pytest.mark.parametrize(
    ("n", "k", "iters", "kind"),
    [
        (9000, 90, 20, "normal"),
        (9000, 90, 8, "heavy"),
        (9000, 90, 12, "normal"),
        (9000, 90, 13, "ties"),
        (9000, 90, 24, "normal"),
        (9000, 900, 16, "nonfinite"),
        (100, 1000, 20, "normal"),
        (7, 3, 1, "normal"),
        (3000, 30, 30, "normal"),  # more than MAX_ITERS: the torch version runs
    ],
)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mstopk_replays_the_reference_exactly(dev, n, k, iters, kind, dtype):
    """The kernels' selection equals the reference algorithm run with the kernels' own mean and
    maximum (bit for bit), and that replay, with its own statistics, equals the reference."""
    a = data(n, dtype, dev, 13, kind)
    word = words_of(14, dev)[:1]
    got = run_mstopk(K.mstopk, a, k, iters, word)
    replay = run_mstopk(K.mstopk_torch, a, k, iters, word, stats=got["stats"])
    assert all(same(got[key], replay[key]) for key in ("idx", "val", "count"))
    own = run_mstopk(K.mstopk_torch, a, k, iters, word)
    ref = sod.mstopk(a, k, iters, word)
    assert torch.equal(own["idx"], ref.idx)
    assert same(own["val"], ref.val)
    assert int(own["count"]) == int(ref.count)
    ref_stats = device_stats(a)
    assert float(got["stats"][1]) == float(ref_stats.max_abs)
    if kind != "nonfinite":
        assert float(got["stats"][0]) == pytest.approx(float(ref_stats.sum_abs), rel=SUM_RTOL)


def test_mstopk_with_error_feedback_and_falling_thresholds(dev):
    a, b = data(5000, torch.float32, dev, 15), data(5000, torch.float32, dev, 16)
    word = words_of(17, dev)[:1]
    got = run_mstopk(K.mstopk, a, 60, 20, word, b=b)
    replay = run_mstopk(K.mstopk_torch, torch.add(a, b), 60, 20, word, stats=got["stats"])
    assert all(same(got[key], replay[key]) for key in ("idx", "val", "count"))
    x = near_constant(dev)
    for k, iters in ((1, 20), (x.numel() // 2, 14), (x.numel() - 1, 5)):
        got = run_mstopk(K.mstopk, x, k, iters, word)
        replay = run_mstopk(K.mstopk_torch, x, k, iters, word, stats=got["stats"])
        assert all(same(got[key], replay[key]) for key in ("idx", "val", "count")), (k, iters)


# --- random-k ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(10, 10), (1000, 7), (100_003, 1000), (5, 0), (2**31 + 5, 3)])
def test_stratified_randomk_one_per_stratum(dev, n, k):
    words = words_of(18, dev)
    idx = torch.empty(k, dtype=torch.int64, device=dev)
    sizes = torch.empty(k, dtype=torch.int32, device=dev)
    K.stratified_randomk(n, k, words, idx, sizes_out=sizes)
    i = torch.arange(k, device=dev)
    lo, hi = i * n // k, (i + 1) * n // k
    assert bool(((idx >= lo) & (idx < hi)).all())
    assert bool((idx[1:] > idx[:-1]).all())  # distinct and increasing
    assert torch.equal(sizes.long(), hi - lo)
    twin_idx, twin_sizes = torch.empty_like(idx), torch.empty_like(sizes)
    K.stratified_randomk_torch(n, k, words, twin_idx, sizes_out=twin_sizes)
    assert torch.equal(idx, twin_idx)
    assert torch.equal(sizes, twin_sizes)
    if 0 < n < 10**6:
        a, b = data(n, torch.bfloat16, dev, 19), data(n, torch.bfloat16, dev, 20)
        val = torch.empty(k, dtype=torch.bfloat16, device=dev)
        K.stratified_randomk(n, k, words, idx, a=a, b=b, val_out=val)
        assert torch.equal(val, torch.add(a, b)[idx])


@pytest.mark.parametrize("n", [1000, 1003])
def test_stratified_randomk_is_uniform_within_each_stratum(dev, n):
    """Chi-square over every position's count in 4000 draws (each draw new words): each stratum
    spreads its draws evenly (well inside 5 standard deviations of the statistic's mean, and
    not suspiciously even). The torch twin draws the very positions of the kernel (above)."""
    k, draws = 10, 4000
    g = torch.Generator().manual_seed(21)
    hits = torch.zeros(n, dtype=torch.int64)
    idx = torch.empty(k, dtype=torch.int64)
    for _ in range(draws):
        words = torch.randint(0, 2**32, (2,), generator=g, dtype=torch.int64)
        K.stratified_randomk_torch(n, k, words, idx)
        hits[idx] += 1
    i = torch.arange(k)
    sizes = (i + 1) * n // k - i * n // k
    expected = torch.repeat_interleave(draws / sizes.double(), sizes)
    chi2 = float(((hits - expected) ** 2 / expected).sum())
    dof = int((sizes - 1).sum())
    assert dof - 5 * math.sqrt(2 * dof) < chi2 < dof + 5 * math.sqrt(2 * dof), (chi2, dof)


# --- quantizers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 4097, 3 * 4096 + 9])
@pytest.mark.parametrize("dtype", DTYPES)
def test_onebit_codes_sums_and_residual(dev, n, dtype):
    kind = "nonfinite" if n > 4096 else "normal"
    a, b = data(n, dtype, dev, 22, kind), data(n, dtype, dev, 23)
    v = torch.add(a, b)
    codes = torch.empty(packed_nbytes(n, 1), dtype=torch.uint8, device=dev)
    sums, v_out = torch.empty(4, dtype=torch.float64, device=dev), torch.empty_like(a)
    K.onebit_encode(a, codes, sums, b=b, v_out=v_out)
    ref_codes = torch.empty_like(codes)
    ref_sums = sign_pack_on_device(v, ref_codes)
    assert torch.equal(codes, ref_codes)
    assert same(v_out, v)
    assert int(sums[1]) == int(ref_sums[1]) and int(sums[3]) == int(ref_sums[3])  # counts: exact
    assert torch.allclose(sums, ref_sums, rtol=SUM_RTOL, atol=1e-6, equal_nan=True)  # sums: rounding
    lut = torch.tensor([-0.7, 0.6], device=dev)
    residual = torch.empty_like(v)
    K.lut_residual(v, codes, 1, lut, residual)
    decoded = torch.empty_like(v)
    lut_decode(ref_codes, 1, lut, decoded)
    assert same(residual, v - decoded)
    twin_codes, twin_sums = torch.empty_like(codes), torch.empty_like(sums)
    K.onebit_encode_torch(a, twin_codes, twin_sums, b=b)
    assert torch.equal(twin_codes, codes)


@pytest.mark.parametrize("n", [0, 5, 4095, 2 * 4096 + 3])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tau_on_device", [False, True])
def test_tbq_codes_counts_and_residual(dev, n, dtype, tau_on_device):
    a, b = data(n, dtype, dev, 24, "nonfinite" if n > 4096 else "ties"), data(n, dtype, dev, 25)
    v = torch.add(a, b)
    tau = 0.5
    tau_arg = torch.tensor(tau, device=dev) if tau_on_device else tau
    codes = torch.empty(packed_nbytes(n, 2), dtype=torch.uint8, device=dev)
    counts = torch.empty(2, dtype=torch.int64, device=dev)
    residual = torch.empty_like(v)
    K.tbq_encode(a, tau_arg, codes, counts, b=b, residual_out=residual)
    ref_codes = torch.empty_like(codes)
    ref_counts = threshold_pack_on_device(v, tau, ref_codes)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(counts, ref_counts)
    t = torch.tensor(tau, device=dev)
    decoded = torch.empty_like(v)
    lut_decode(ref_codes, 2, torch.stack([torch.zeros_like(t), t, -t, torch.zeros_like(t)]), decoded)
    assert same(residual, v - decoded)
    twin = [torch.empty_like(codes), torch.empty_like(counts), torch.empty_like(v)]
    K.tbq_encode_torch(a, tau_arg, twin[0], twin[1], b=b, residual_out=twin[2])
    assert torch.equal(twin[0], codes) and torch.equal(twin[1], counts) and same(twin[2], residual)


def terngrad_lut(bits, scale, dev):
    """The decode table TernGrad builds on the device (level * scale / levels)."""
    levels = 2 ** (bits - 1) - 1
    code = torch.arange(1 << bits, device=dev)
    half = 1 << (bits - 1)
    level = torch.where((code & half) != 0, -(code & (half - 1)), code & (half - 1))
    return level.float() * (torch.tensor(scale, device=dev) / levels)


@pytest.mark.parametrize("n", [1, 4097, 2 * 4096 + 11])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4, 8])
def test_stochastic_codes_and_residual(dev, n, dtype, bits):
    a, b = data(n, dtype, dev, 26, "nonfinite" if n > 4096 else "normal"), data(n, dtype, dev, 27)
    v = torch.add(a, b)
    levels = 2 ** (bits - 1) - 1
    scale = 2.7
    mult = torch.tensor(levels / scale, device=dev)
    words = words_of(28, dev)
    lut = terngrad_lut(bits, scale, dev)
    codes = torch.empty(packed_nbytes(n, bits), dtype=torch.uint8, device=dev)
    residual = torch.empty_like(v)
    K.stochastic_encode(a, mult, levels, bits, words, codes, b=b, residual_out=residual, lut=lut)
    ref_codes = torch.empty_like(codes)
    stochastic_pack(v, mult, levels, bits, (words[0], words[1]), ref_codes)
    # NaN elements: their code's sign bit is the NaN's sign bit, which torch's own half casts
    # do not agree on (CPU vectorized, CPU scalar and CUDA differ); every other code is exact
    keep = ~torch.isnan(v)
    assert torch.equal(unpack_codes(codes, bits, n)[keep], unpack_codes(ref_codes, bits, n)[keep])
    decoded = torch.empty_like(v)
    lut_decode(codes, bits, lut, decoded)
    assert same(residual, v - decoded)
    twin_codes = torch.empty_like(codes)
    K.stochastic_encode_torch(v, mult, levels, bits, words, twin_codes)
    assert torch.equal(twin_codes, ref_codes)


@pytest.mark.parametrize("n", [0, 3, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", [torch.float16, torch.bfloat16])
def test_half_cast_flags_and_residual(dev, n, dtype, fmt):
    a, b = data(n, dtype, dev, 29, "nonfinite" if n > 4096 else "normal"), data(n, dtype, dev, 30)
    if n == 3 and dtype == torch.float32:
        a[1] = 60000.0  # finite, overflows float16 once scaled by 4
    v = torch.add(a, b)
    scale, decode_scale = torch.tensor(4.0, device=dev), torch.tensor(0.25, device=dev)
    out = torch.empty(n, dtype=torch.int16, device=dev)
    flags, residual = torch.empty(3, device=dev), torch.empty_like(v)
    K.cast_encode(a, fmt, scale, out, flags, b=b, residual_out=residual, decode_scale=decode_scale)
    ref_out = torch.empty_like(out)
    ref_flags = cast_on_device(v, fmt, scale, ref_out) if n else torch.zeros(3, device=dev)
    assert same(out.view(fmt), ref_out.view(fmt))
    assert torch.equal(flags, ref_flags)
    decoded = torch.empty_like(v)
    uncast(ref_out, fmt, decode_scale, decoded)
    assert same(residual, v - decoded)


# --- where the kernels run, and no host reads -----------------------------------------------------


def test_availability_follows_the_interpreter_setting(dev, monkeypatch):
    if dev.type == "cpu":
        assert K.available("cpu")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not K.available("cpu")  # then every function runs its torch twin
        a = data(100, torch.float32, dev)
        idx = torch.empty(10, dtype=torch.int32)
        val, nonfinite = torch.empty(10), torch.empty(1, dtype=torch.int32)
        K.chunked_topk(a, 10, 1, 0, idx, val, nonfinite)
        assert torch.equal(idx.long(), lowest_first(a, 10, 1, 0))
    assert not launch.available("meta")


def test_a_library_made_compiled_runs_the_torch_versions(tmp_path):
    """Triton's own functions are made compiled or interpreted when triton.language is first
    imported (torch.compile imports it too). Setting TRITON_INTERPRET=1 afterwards must not send
    interpreted kernels into compiled library functions: the torch versions run, right."""
    import subprocess
    import sys

    script = tmp_path / "late.py"
    script.write_text(
        "import os\n"
        "os.environ.pop('TRITON_INTERPRET', None)\n"
        "import triton.language\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import torch\n"
        "from gradsync.codecs import kernels as K\n"
        "assert not K.available('cpu')\n"
        "a = torch.randn(100, generator=torch.Generator().manual_seed(0))\n"
        "idx = torch.empty(10, dtype=torch.int32)\n"
        "val, bad = torch.empty(10), torch.empty(1, dtype=torch.int32)\n"
        "K.chunked_topk(a, 10, 1, 0, idx, val, bad)  # the largest |a| of each chunk of 10\n"
        "want = a.view(10, 10).abs().argmax(1) + torch.arange(0, 100, 10)\n"
        "assert torch.equal(idx.long().sort().values, want), (idx, want)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_no_host_reads(dev):
    """The torch twins (what a GPU without triton runs) and, on CUDA, the kernels make no read
    of a device value by the host."""
    from gradsync.sync.host_reads import audit_host_reads

    a, b = data(5000, torch.float32, dev, 31), data(5000, torch.float32, dev, 32)
    word, t = words_of(33, dev), torch.tensor(1.5, device=dev)
    suffixes = ("_torch", "") if dev.type == "cuda" else ("_torch",)
    with audit_host_reads() as audit:
        for suffix in suffixes:
            run_chunked(getattr(K, "chunked_topk" + suffix), a, b, 100, 2, 0)
            run_above(getattr(K, "select_above" + suffix), a, b, t, 60, True, True)
            run_mstopk(getattr(K, "mstopk" + suffix), a, 50, 20, word[:1], b=b)
            codes = torch.empty(packed_nbytes(5000, 2), dtype=torch.uint8, device=dev)
            counts = torch.empty(2, dtype=torch.int64, device=dev)
            getattr(K, "tbq_encode" + suffix)(a, 0.5, codes, counts, b=b)
            idx = torch.empty(10, dtype=torch.int64, device=dev)
            getattr(K, "stratified_randomk" + suffix)(5000, 10, word, idx)
    assert not audit.unexpected, audit.summary()


def test_hashes_match_the_reference_bit_for_bit(dev):
    """The sampled positions use hashed_uniform: its triton twin agrees on every counter."""
    words = words_of(34, dev)
    s = 5000
    a = torch.arange(s, dtype=torch.float32, device=dev) + 1.0  # key = position + 1
    keys = torch.empty(s, device=dev)
    K.sampled_threshold(a, 10, 1.0, words, torch.empty(1, device=dev), keys_out=keys)
    pos = (hashed_uniform(s, words[0], words[1], dev) * s).long().clamp(max=s - 1)
    assert torch.equal(keys, (pos + 1).float())


# ------------------------------------------------------------------ the codecs on the kernels
CODECS_ON_KERNELS = [
    "chunktopk:density=0.02,chunk=512",
    "chunktopk:density=0.02,chunk=512+ef",
    "sparseloco:density=0.02,chunk=512,bits=2+ef:decay=0.9",
    "mstopk:density=0.02",
    "mstopk:density=0.02+ef",
    "dgc:density=0.02",
    "graddrop:density=0.02",
    "randomk:density=0.02,unbiased=true",
    "onebit",
    "onebit+ef",
    "tbq:threshold=0.5",
    "terngrad",
    "terngrad:bits=4+ef",
    "fp16",
    "bf16+ef",
]


@pytest.mark.parametrize("spec", CODECS_ON_KERNELS)
def test_a_resident_codec_on_the_kernels_equals_its_torch_path(spec, dev, monkeypatch):
    """The resident codec with its work on the fused kernels sends what its torch path sends
    (GRADSYNC_KERNELS=0), step after step with error feedback, a non-finite step among them:
    the same bytes, decodes and residuals; MSTopK (its mean summed in another order) the same
    decode where its thresholds agree, which they do on this data."""
    n = 5000
    on, off = (gradsync_codec(spec) for _ in range(2))
    for step in range(4):
        g = data(n, torch.float32, dev, seed=step, kind="nonfinite" if step == 2 else "normal")
        got = on.encode(g, EncodeContext(key="b"))
        got_decoded = on.decode(got)
        monkeypatch.setenv("GRADSYNC_KERNELS", "0")
        want = off.encode(g, EncodeContext(key="b"))
        want_decoded = off.decode(want)
        monkeypatch.delenv("GRADSYNC_KERNELS")
        # onebit's scales are float sums; a 16-bit NaN's sign and payload bits are not defined
        # alike by torch's own casts (the flag is, and the decode is all NaN)
        nan_casts = step == 2 and spec.startswith(("fp16", "bf16"))
        exact = not spec.startswith(("onebit", "mstopk")) and not nan_casts
        if exact:
            assert torch.equal(got.data, want.data), (spec, step)
        tol = {"rtol": 1e-5, "atol": 1e-6} if spec.startswith("onebit") else {"rtol": 1e-6, "atol": 1e-7}
        torch.testing.assert_close(got_decoded.nan_to_num(7.0), want_decoded.nan_to_num(7.0),
                                   msg=f"{spec} step {step}", **tol)  # fmt: skip
        if "+ef" in spec:
            torch.testing.assert_close(on.residual("b"), off.residual("b"), **tol)


def gradsync_codec(spec):
    from gradsync.codecs import build_codec

    codec = build_codec(spec)
    codec.set_resident(True)
    return codec
