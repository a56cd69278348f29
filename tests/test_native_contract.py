"""The contract of the compiled kernels (gradsync._native), called directly through native.ext().

Three promises, each against an independent reference (plain torch or Python):
- a buffer the caller declares too small is refused with ValueError naming it and the sizes,
  and nothing is written past its end (every buffer here carries a guard region after the
  declared capacity, filled with a sentinel that must survive);
- a non-number among the floats of a sequence argument raises TypeError naming the item;
- well-formed calls compute what plain torch computes;
and the typed stub (_native.pyi) declares exactly what the module exports, argument by argument.
"""

import ast
import math
import re
from pathlib import Path

import pytest
import torch

import gradsync
from gradsync.codecs.ops import native

pytestmark = pytest.mark.skipif(
    not native.AVAILABLE,
    reason="gradsync._native is not built, or the CPU lacks AVX2/FMA/F16C (the torch operators run)",
)

SENTINEL = 0xA5
GUARD = 64  # bytes after every declared capacity that must stay untouched
SIZES = [1, 7, 8, 17, 1000, 4099]  # below, at and across the 8- and 16-wide vector steps


def ext() -> native.Kernels:
    return native.ext()


def guarded(nbytes: int) -> torch.Tensor:
    """A byte buffer of ``nbytes`` plus a guard region, all set to the sentinel."""
    return torch.full((nbytes + GUARD,), SENTINEL, dtype=torch.uint8)


def untouched(buf: torch.Tensor, start: int = 0) -> bool:
    return bool((buf[start:] == SENTINEL).all())


def as_f32(buf: torch.Tensor, n: int) -> torch.Tensor:
    return buf[: 4 * n].view(torch.float32)


def ref_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Little-endian packing of ``bits``-bit codes into bytes (element 0 in the low bits)."""
    per = 8 // bits
    n = codes.numel()
    padded = torch.zeros(math.ceil(n / per) * per, dtype=torch.int64)
    padded[:n] = codes.long()
    shifts = torch.arange(per) * bits
    return (padded.view(-1, per) << shifts).sum(1).to(torch.uint8)


# --------------------------------------------------------------------------------------------
# the stub


def _stub_functions() -> dict[str, list[str]]:
    stub = Path(gradsync.__file__).with_name("_native.pyi")
    tree = ast.parse(stub.read_text())
    return {
        node.name: [a.arg for a in node.args.posonlyargs + node.args.args]
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
    }


def test_stub_declares_every_export_with_its_arguments():
    from gradsync import _native

    stub = _stub_functions()
    exported = {
        name for name in dir(_native) if not name.startswith("_") and callable(getattr(_native, name))
    }
    assert exported == set(stub)
    for name, params in stub.items():
        # each method's docstring opens with its signature: "name(a, b, c): what it does"
        doc = getattr(_native, name).__doc__
        m = re.match(rf"{name}\(([^)]*)\):", doc)
        assert m, f"{name}: docstring does not open with its signature: {doc!r}"
        assert [p.strip() for p in m.group(1).split(",")] == params, name
    assert isinstance(_native.SUPPORTED, int)


@pytest.mark.parametrize("name", sorted(_stub_functions()))
def test_every_function_takes_as_many_arguments_as_the_stub_says(name):
    params = _stub_functions()[name]
    with pytest.raises(TypeError, match=rf"takes exactly {len(params)} arguments? \(0 given\)"):
        getattr(ext(), name)()


def test_ptr_refuses_what_a_kernel_cannot_address():
    with pytest.raises(ValueError, match="not contiguous"):
        native.ptr(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="not on the CPU"):
        native.ptr(torch.empty(4, device="meta"))
    assert native.ptr(torch.zeros(0)) == 0


# --------------------------------------------------------------------------------------------
# capacities: too small is refused, nothing written


def _call_short(fn: str, n: int, short: int, keep: list[torch.Tensor]) -> int:
    """Call ``fn`` on ``n`` elements declaring one buffer ``short`` bytes below what it needs.

    Every guarded buffer goes into ``keep``; returns the byte count declared for the buffer the
    call writes, past which nothing may change.
    """

    def buf(nbytes: int) -> torch.Tensor:
        keep.append(guarded(nbytes))
        return keep[-1]

    x = torch.randn(n)
    e = ext()
    if fn == "kth_largest":
        need = 4 * n
        e.kth_largest(native.ptr(x), n, 1, 1, native.ptr(buf(need)), need - short)
    elif fn == "sign_pack":
        need = math.ceil(n / 8)
        e.sign_pack(native.ptr(x), n, native.ptr(buf(need)), need - short)
    elif fn == "ternary_pack":
        need = math.ceil(n / 4)
        e.ternary_pack(native.ptr(x), n, 0.5, native.ptr(buf(need)), need - short)
    elif fn.startswith("stoch_pack"):
        bits = int(fn.rsplit("_", 1)[1])
        need = math.ceil(n * bits / 8)
        e.stoch_pack(native.ptr(x), n, 1.0, 1, bits, 1, 2, native.ptr(buf(need)), need - short)
    elif fn == "lut_unpack:out":
        codes = torch.zeros(n, dtype=torch.uint8)
        need = 4 * n
        e.lut_unpack(native.ptr(codes), n, n, 8, [0.0] * 256, native.ptr(buf(need)), need - short, False)
    elif fn == "lut_unpack:codes":
        # an input this time: reading past the end of codes is refused just the same
        codes = torch.zeros(math.ceil(n / 2), dtype=torch.uint8)
        need = 4 * n
        e.lut_unpack(
            native.ptr(codes), codes.numel() - short, n, 4, [1.0] * 16, native.ptr(buf(need)), need, False
        )
        return need
    elif fn == "to_half":
        need = 2 * n
        e.to_half(native.ptr(x), n, 1.0, native.ptr(buf(need)), need - short, False)
    elif fn == "from_half":
        h = x.half()
        need = 4 * n
        e.from_half(native.ptr(h), n, 1.0, native.ptr(buf(need)), need - short, False, False)
    elif fn == "copy_check":
        need = 4 * n
        e.copy_check(native.ptr(x), n, native.ptr(buf(need)), need - short)
    elif fn == "random_subset:idx":
        need = 4 * n
        bitmap = torch.empty(math.ceil(n / 64), dtype=torch.int64)
        e.random_subset(n, n, 7, native.ptr(buf(need)), need - short, native.ptr(bitmap), bitmap.nbytes)
    elif fn == "random_subset:bitmap":
        need = 8 * math.ceil(n / 64)
        idx = torch.empty(n, dtype=torch.int32)
        e.random_subset(n, n, 7, native.ptr(idx), idx.nbytes, native.ptr(buf(need)), need - short)
    elif fn == "gather":
        idx = torch.arange(n, dtype=torch.int32)
        need = 4 * n
        e.gather(native.ptr(x), n, native.ptr(idx), n, native.ptr(buf(need)), need - short)
    else:
        raise AssertionError(fn)
    return need - short


# call -> (function named in the error, buffer named in the error)
SHORT_CALLS = {
    "kth_largest": ("kth_largest", "scratch"),
    "sign_pack": ("sign_pack", "bits"),
    "ternary_pack": ("ternary_pack", "out"),
    "stoch_pack_2": ("stoch_pack", "out"),
    "stoch_pack_4": ("stoch_pack", "out"),
    "stoch_pack_8": ("stoch_pack", "out"),
    "lut_unpack:out": ("lut_unpack", "out"),
    "lut_unpack:codes": ("lut_unpack", "codes"),
    "to_half": ("to_half", "out"),
    "from_half": ("from_half", "out"),
    "copy_check": ("copy_check", "out"),
    "random_subset:idx": ("random_subset", "idx"),
    "random_subset:bitmap": ("random_subset", "bitmap"),
    "gather": ("gather", "val"),
}


@pytest.mark.parametrize("short", [1, 3])
@pytest.mark.parametrize("n", [17, 4099])
@pytest.mark.parametrize("call", list(SHORT_CALLS))
def test_a_short_buffer_is_refused_and_nothing_is_written(call, n, short):
    fn, name = SHORT_CALLS[call]
    keep: list[torch.Tensor] = []
    with pytest.raises(ValueError, match=rf"^{fn}: {name} holds (\d+) bytes but {n} \S.* need (\d+)$") as err:
        _call_short(call, n, short, keep)
    have, need = (int(v) for v in re.findall(r"holds (\d+) bytes.* need (\d+)$", str(err.value))[0])
    assert need - have == short
    assert keep and all(untouched(b) for b in keep)  # not one byte changed, guard included


@pytest.mark.parametrize("call", list(SHORT_CALLS))
def test_the_exact_size_is_enough(call):
    keep: list[torch.Tensor] = []
    end = _call_short(call, 1000, 0, keep)
    assert untouched(keep[0], end)  # nothing past the declared end


def test_range_positions_refuses_a_short_pos_and_stops_at_its_end():
    keys = torch.arange(100, dtype=torch.float32)
    pos = guarded(4 * 100)
    # 50 keys in [10, 60); room for 12.5 of them: 12 are written, the rest refused
    with pytest.raises(ValueError, match=r"range_positions: pos holds 50 bytes but 50 positions need 200"):
        ext().range_positions(native.ptr(keys), 100, 10.0, 60.0, native.ptr(pos), 50)
    assert pos[:48].view(torch.int32).tolist() == list(range(10, 22))
    assert untouched(pos, 48)


def test_scan_select_never_writes_past_cap():
    x = torch.randn(10_000)
    idx, val = guarded(4 * 10), guarded(4 * 10)
    cnt, *_ = ext().scan_select(native.ptr(x), x.numel(), 0.0, 0, True, native.ptr(idx), native.ptr(val), 10)
    assert cnt == x.numel()  # the full count comes back, so the caller can grow and rescan
    assert untouched(idx, 40) and untouched(val, 40)
    assert idx[:40].view(torch.int32).tolist() == list(range(10))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mode", [0, 1, 2])
def test_sum_scan_select_is_an_add_then_a_scan(n, mode):
    x, y = torch.randn(n), torch.randn(n)
    y[n // 2] = -x[n // 2]  # an exact zero among the sums
    out = guarded(4 * n)
    idx, val = guarded(4 * n), guarded(4 * n)
    p = native.ptr
    cnt, s, m, nf = ext().sum_scan_select(p(x), p(y), n, p(out), 4 * n, 0.5, mode, True, p(idx), p(val), n)
    want = x + y  # torch's own float32 addition
    assert torch.equal(as_f32(out, n), want) and untouched(out, 4 * n)
    key = want.abs() if mode == 0 else (want if mode == 1 else -want)
    picked = torch.nonzero(key >= 0.5).flatten()
    assert cnt == picked.numel()
    assert idx[: 4 * cnt].view(torch.int32).tolist() == picked.tolist()
    assert torch.equal(as_f32(val, cnt), want[picked])
    assert m == want.abs().max().item() and nf == 0
    assert s == pytest.approx(want.abs().double().sum().item(), rel=1e-5)


def test_sum_scan_select_refuses_a_short_out():
    x = torch.randn(100)
    out = guarded(4 * 99)
    with pytest.raises(ValueError, match="sum_scan_select: out"):
        p = native.ptr
        ext().sum_scan_select(p(x), p(x), 100, p(out), 4 * 99, 0.0, 0, True, 0, 0, 0)
    assert untouched(out)


def test_gather_refuses_an_index_outside_x():
    x = torch.randn(10)
    val = guarded(4 * 3)
    for bad in (10, -1):
        idx = torch.tensor([0, bad, 2], dtype=torch.int32)
        with pytest.raises(IndexError, match=rf"gather: idx\[1\] = {bad} is outside x of 10 elements"):
            ext().gather(native.ptr(x), 10, native.ptr(idx), 3, native.ptr(val), 12)
        assert untouched(val, 4)  # stopped at the bad index


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda e, p: e.stats(p, -1), "stats: n must be in"),
        (lambda e, p: e.sparse_to_dense(p, -5, p, p, 0), "sparse_to_dense: n must be in"),
        (lambda e, p: e.sparse_add(p, 4, p, p, -1, 1.0), "sparse_add: m must be in"),
        (lambda e, p: e.copy_check(p, 4, p, -16), "copy_check: out_nbytes must be >= 0, got -16"),
        (
            lambda e, p: e.range_positions(p, 2**31, 0.0, 1.0, p, 2**40),
            r"range_positions: n must be in \[0, 2147483647\]",
        ),
        (lambda e, p: e.scan_select(p, 4, 0.0, 0, True, p, p, -1), "scan_select: cap must be in"),
        (lambda e, p: e.random_subset(-1, 0, 0, p, 0, p, 0), "random_subset: n must be in"),
        (lambda e, p: e.kth_largest(p, 4, 5, 0, p, 16), "kth_largest needs 1 <= k <= n, got k=5, n=4"),
        (
            lambda e, p: e.stoch_pack(p, 4, 1.0, 2, 2, 0, 0, p, 1),
            r"2-bit codes take levels in \[0, 1\], got 2",
        ),
        (lambda e, p: e.stoch_pack(p, 4, 1.0, 1, 3, 0, 0, p, 1), r"bits in \{2, 4, 8\}, got 3"),
        (lambda e, p: e.lut_unpack(p, 4, 4, 3, [0.0] * 8, p, 16, False), r"bits in \{1, 2, 4, 8\}, got 3"),
        (
            lambda e, p: e.lut_unpack(p, 4, 4, 2, [0.0] * 3, p, 16, False),
            "a 2-bit lut must have 4 entries, got 3",
        ),
        (lambda e, p: e.count_ge(p, 4, [0.0] * 17, 0), "count_ge takes 1 to 16 thresholds, got 17"),
    ],
)
def test_bad_counts_are_refused_before_any_work(call, match):
    buf = guarded(64)
    with pytest.raises(ValueError, match=match):
        call(ext(), native.ptr(buf))
    assert untouched(buf)


# --------------------------------------------------------------------------------------------
# non-numbers in float sequences


class _Unfloatable:
    def __float__(self) -> float:
        raise RuntimeError("no float for you")


@pytest.mark.parametrize("bad", ["0.5", None, object(), [1.0], 1j])
def test_count_ge_refuses_a_non_number_threshold(bad):
    x = torch.randn(100)
    with pytest.raises(TypeError, match=r"count_ge: thresholds\[2\] must be a real number, not "):
        ext().count_ge(native.ptr(x), 100, [0.0, 1.0, bad, 2.0], 0)


@pytest.mark.parametrize("bad", ["1", None, object()])
def test_lut_unpack_refuses_a_non_number_entry_and_writes_nothing(bad):
    codes = torch.zeros(4, dtype=torch.uint8)
    out = guarded(4 * 16)
    lut = [1.0, 2.0, 3.0, bad]
    with pytest.raises(TypeError, match=r"lut_unpack: lut\[3\] must be a real number, not "):
        ext().lut_unpack(native.ptr(codes), 4, 16, 2, lut, native.ptr(out), 64, False)
    assert untouched(out)


def test_other_conversion_errors_pass_through():
    x = torch.randn(10)
    with pytest.raises(RuntimeError, match="no float for you"):
        ext().count_ge(native.ptr(x), 10, [0.0, _Unfloatable()], 0)
    with pytest.raises(OverflowError):
        ext().count_ge(native.ptr(x), 10, [10**400], 0)
    with pytest.raises(TypeError, match="count_ge: thresholds must be a sequence"):
        ext().count_ge(native.ptr(x), 10, 0.5, 0)


def test_numbers_that_are_not_floats_are_fine():
    x = torch.tensor([-1.0, 0.0, 1.0, 2.0])
    assert ext().count_ge(native.ptr(x), 4, [0, True, 2], 1) == [3, 2, 1]


# --------------------------------------------------------------------------------------------
# well-formed calls against plain torch


@pytest.mark.parametrize("n", SIZES)
def test_range_positions_matches_torch(n):
    keys = torch.randn(n)
    pos = torch.empty(n, dtype=torch.int32)
    m = ext().range_positions(native.ptr(keys), n, -0.5, 0.7, native.ptr(pos), pos.nbytes)
    want = torch.nonzero((keys >= -0.5) & (keys < 0.7)).flatten()
    assert torch.equal(pos[:m].long(), want)


@pytest.mark.parametrize("n", SIZES)
def test_gather_matches_torch(n):
    x = torch.randn(n)
    idx = torch.randint(0, n, (2 * n + 3,), dtype=torch.int32)
    val = torch.empty(idx.numel())
    ext().gather(native.ptr(x), n, native.ptr(idx), idx.numel(), native.ptr(val), val.nbytes)
    assert torch.equal(val, x[idx.long()])


@pytest.mark.parametrize("n", SIZES)
def test_kth_largest_matches_torch(n):
    x = torch.randn(n)
    scratch = torch.empty(n)
    for k in {1, (n + 1) // 2, n}:
        got = ext().kth_largest(native.ptr(x), n, k, 0, native.ptr(scratch), scratch.nbytes)
        assert got == float(x.abs().sort(descending=True).values[k - 1])


@pytest.mark.parametrize("n", SIZES)
def test_count_ge_matches_torch(n):
    x = torch.randn(n)
    ts = [-1.0, 0.0, 0.25, 3.0]
    assert ext().count_ge(native.ptr(x), n, ts, 1) == [int((x >= t).sum()) for t in ts]


@pytest.mark.parametrize("n", SIZES)
def test_sign_and_ternary_pack_match_torch(n):
    x = torch.randn(n)
    bits = torch.empty(math.ceil(n / 8), dtype=torch.uint8)
    sp, cp, sn, nf = ext().sign_pack(native.ptr(x), n, native.ptr(bits), bits.nbytes)
    assert torch.equal(bits, ref_pack((x >= 0).long(), 1))
    assert cp == int((x >= 0).sum()) and nf == 0
    assert sp == pytest.approx(float(x.clamp(min=0).double().sum()), rel=1e-5, abs=1e-5)
    assert sn == pytest.approx(float(x.clamp(max=0).double().sum()), rel=1e-5, abs=1e-5)
    codes = torch.empty(math.ceil(n / 4), dtype=torch.uint8)
    nz, nf = ext().ternary_pack(native.ptr(x), n, 0.5, native.ptr(codes), codes.nbytes)
    want = (x > 0.5).long() + 2 * (x < -0.5).long()
    assert torch.equal(codes, ref_pack(want, 2))
    assert nz == int((want != 0).sum()) and nf == 0


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_stoch_pack_codes_round_to_a_neighbouring_level(bits, n):
    x = torch.randn(n)
    levels = 2 ** (bits - 1) - 1
    mult = levels / float(x.abs().max())
    out = torch.empty(math.ceil(n * bits / 8), dtype=torch.uint8)
    ext().stoch_pack(native.ptr(x), n, mult, levels, bits, 12345, 678, native.ptr(out), out.nbytes)
    per = 8 // bits
    shifts = torch.arange(per) * bits
    codes = ((out.long().unsqueeze(1) >> shifts) & (2**bits - 1)).flatten()[:n]
    sign, level = codes >> (bits - 1), codes & levels
    assert torch.equal(sign, (x < 0).long())
    scaled = (x.abs() * mult).double()
    assert bool(((level >= scaled.floor() - 1e-6) & (level <= scaled.ceil() + 1e-6)).all())


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("n", SIZES)
def test_lut_unpack_matches_torch(bits, n):
    codes = torch.randint(0, 2**bits, (n,))
    packed = ref_pack(codes, bits)
    lut = torch.randn(2**bits).tolist()
    out = torch.empty(n)
    ext().lut_unpack(native.ptr(packed), packed.nbytes, n, bits, lut, native.ptr(out), out.nbytes, False)
    want = torch.tensor(lut)[codes]
    assert torch.equal(out, want)
    base = torch.randn(n)
    acc = base.clone()
    ext().lut_unpack(native.ptr(packed), packed.nbytes, n, bits, lut, native.ptr(acc), acc.nbytes, True)
    torch.testing.assert_close(acc, base + want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", SIZES)
def test_half_casts_match_torch(dtype, n):
    x = torch.randn(n) * 100
    bf16 = dtype == torch.bfloat16
    h = torch.empty(n, dtype=torch.int16)
    max_abs, nf, overflow = ext().to_half(native.ptr(x), n, 0.5, native.ptr(h), h.nbytes, bf16)
    assert torch.equal(h.view(dtype), (x * 0.5).to(dtype))
    assert max_abs == float(x.abs().max()) and nf == 0 and overflow == 0
    out = torch.empty(n)
    ext().from_half(native.ptr(h), n, 4.0, native.ptr(out), out.nbytes, bf16, False)
    assert torch.equal(out, h.view(dtype).float() * 4.0)


@pytest.mark.parametrize("n", SIZES)
def test_copy_check_matches_torch(n):
    x = torch.randn(n)
    out = torch.empty(n)
    assert ext().copy_check(native.ptr(x), n, native.ptr(out), out.nbytes) is False
    assert torch.equal(out, x)
    x[n // 2] = math.nan
    assert ext().copy_check(native.ptr(x), n, native.ptr(out), out.nbytes) is True


@pytest.mark.parametrize(("n", "k"), [(1, 1), (10, 0), (100, 7), (5000, 4999), (70_000, 300)])
def test_random_subset_is_a_sorted_subset(n, k):
    idx = torch.empty(k, dtype=torch.int32)
    bitmap = torch.empty(math.ceil(n / 64), dtype=torch.int64)
    ext().random_subset(n, k, 99, native.ptr(idx), idx.nbytes, native.ptr(bitmap), bitmap.nbytes)
    got = idx.long()
    assert got.numel() == k
    assert bool((got[1:] > got[:-1]).all()) if k > 1 else True
    assert k == 0 or (int(got.min()) >= 0 and int(got.max()) < n)
