"""A quick check of the fused codec kernels (gradsync.codecs.kernels), not a test.

    python scripts/kernels_check.py            # outputs == eager references at 2^16 elements
    python scripts/kernels_check.py compile    # compile every kernel variant for CUDA (sm_90)

``check`` runs on CUDA where triton works, else on the CPU under triton's interpreter (set here
before triton is imported): each kernel on random float32 data of 2^16 elements (with error
feedback's second addend, and inf/NaN where the reference defines the result), against the
eager operator it replaces; prints one line per kernel and exits non-zero on a mismatch.

``compile`` needs no GPU: it records the launches the wrappers make for a set of calls, then
compiles each distinct kernel variant with triton's own pipeline for ``sm_90`` (frontend, its
passes, LLVM NVPTX and ptxas, all on the host), and reports the float multiply-adds left in the
PTX of the kernels whose float32 roundings must match the reference's (there must be none).
"""

from __future__ import annotations

import math
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # (imports no triton: the kernels are defined on first use)

MODE = sys.argv[1] if len(sys.argv) > 1 else "check"
if MODE == "check" and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before any kernel is defined

from gradsync.codecs import kernels as K  # noqa: E402
from gradsync.codecs import selection_on_device as sod  # noqa: E402
from gradsync.codecs.ops import (  # noqa: E402
    cast_on_device,
    device_stats,
    lut_decode,
    packed_nbytes,
    sign_pack_on_device,
    stochastic_pack,
    threshold_pack_on_device,
    uncast,
)

N = 1 << 16


def same(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape or x.dtype != y.dtype:
        return False
    if not x.is_floating_point():
        return torch.equal(x, y)
    nx, ny = torch.isnan(x), torch.isnan(y)
    z = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.equal(nx, ny) and torch.equal(torch.where(nx, z, x), torch.where(ny, z, y))


def check() -> int:
    dev = torch.device("cuda" if torch.cuda.is_available() and K.available("cuda") else "cpu")
    if not K.available(dev):
        print("triton does not run here")
        return 2
    g = torch.Generator().manual_seed(0)
    a = torch.randn(N, generator=g).to(dev)
    b = torch.randn(N, generator=g).to(dev)
    bad_a = a.clone()
    bad_a[[5, 700, 40000]] = torch.tensor([math.nan, math.inf, -math.inf], device=dev)
    v = torch.add(a, b)
    words = torch.randint(0, 2**32, (2,), generator=g, dtype=torch.int64).to(dev)
    results: list[tuple[str, bool, float]] = []

    def run(name: str, fn) -> None:  # noqa: ANN001
        t0 = time.perf_counter()
        ok = bool(fn())
        results.append((name, ok, time.perf_counter() - t0))
        print(f"{'ok  ' if ok else 'FAIL'} {name:<34} {time.perf_counter() - t0:6.2f} s", flush=True)

    def chunked() -> bool:
        idx = torch.empty(16 * 41, dtype=torch.int32, device=dev)
        val = torch.empty(16 * 41, device=dev)
        nf = torch.empty(1, dtype=torch.int32, device=dev)
        res = torch.empty_like(a)
        K.chunked_topk(a, 4096, 41, 0, idx, val, nf, b=b, residual_out=res)
        ref = sod.chunked_topk(v, 4096, 41, 0)
        return (
            torch.equal(idx, ref.idx)
            and same(val, ref.val)
            and int(nf) == 0
            and same(res, v.clone().index_fill_(0, ref.idx.long(), 0))
        )

    def stats() -> bool:
        st = torch.empty(4, dtype=torch.float64, device=dev)
        K.fused_stats(bad_a, st, b=b)
        ref = device_stats(torch.add(bad_a, b))
        return float(st[1]) == float(ref.max_abs) and int(st[2]) == 3

    def above() -> bool:
        t = torch.tensor(2.5, device=dev)
        idx = torch.empty(655, dtype=torch.int32, device=dev)
        val = torch.empty(655, device=dev)
        cnt = torch.empty(1, dtype=torch.int64, device=dev)
        st = torch.empty(4, dtype=torch.float64, device=dev)
        K.select_above(a, t, 655, idx, val, cnt, st, b=b, strict=True, v_out=torch.empty_like(a))
        ref = sod.above(v, v.abs(), t, 655, strict=True)
        return torch.equal(idx, ref.idx) and same(val, ref.val) and int(cnt) == int(ref.count)

    def sampled() -> bool:
        t = torch.empty(1, device=dev)
        K.sampled_threshold(a, 655, 0.01, words, t, b=b)
        return torch.equal(t.view(()), sod.sampled_threshold(v, 655, 0.01, words))

    def mstopk() -> bool:
        out = [
            torch.empty(655, dtype=torch.int32, device=dev),
            torch.empty(655, device=dev),
            torch.empty(1, dtype=torch.int64, device=dev),
            torch.empty(4, dtype=torch.float64, device=dev),
        ]
        K.mstopk(a, 655, 20, words[:1], *out, b=b, v_out=torch.empty_like(a))
        replay = [torch.empty_like(o) for o in out]
        K.mstopk_torch(v, 655, 20, words[:1], *replay, stats=out[3])
        return all(same(x, y) for x, y in zip(out[:3], replay[:3], strict=True))

    def randomk() -> bool:
        idx = torch.empty(655, dtype=torch.int32, device=dev)
        twin = torch.empty_like(idx)
        K.stratified_randomk(N, 655, words, idx)
        K.stratified_randomk_torch(N, 655, words, twin)
        i = torch.arange(655, device=dev)
        return torch.equal(idx, twin) and bool(((idx >= i * N // 655) & (idx < (i + 1) * N // 655)).all())

    def onebit() -> bool:
        codes = torch.empty(packed_nbytes(N, 1), dtype=torch.uint8, device=dev)
        sums = torch.empty(4, dtype=torch.float64, device=dev)
        K.onebit_encode(a, codes, sums, b=b)
        ref_codes = torch.empty_like(codes)
        ref = sign_pack_on_device(v, ref_codes)
        return torch.equal(codes, ref_codes) and torch.allclose(sums, ref, rtol=1e-4)

    def tbq() -> bool:
        codes = torch.empty(packed_nbytes(N, 2), dtype=torch.uint8, device=dev)
        counts = torch.empty(2, dtype=torch.int64, device=dev)
        res = torch.empty_like(a)
        K.tbq_encode(a, 0.5, codes, counts, b=b, residual_out=res)
        ref_codes = torch.empty_like(codes)
        ref = threshold_pack_on_device(v, 0.5, ref_codes)
        t = torch.tensor(0.5, device=dev)
        dec = torch.empty_like(v)
        lut_decode(ref_codes, 2, torch.stack([t * 0, t, -t, t * 0]), dec)
        return torch.equal(codes, ref_codes) and torch.equal(counts, ref) and same(res, v - dec)

    def terngrad() -> bool:
        mult = torch.tensor(1 / 4.5, device=dev)
        codes = torch.empty(packed_nbytes(N, 2), dtype=torch.uint8, device=dev)
        K.stochastic_encode(a, mult, 1, 2, words, codes, b=b)
        ref_codes = torch.empty_like(codes)
        stochastic_pack(v, mult, 1, 2, (words[0], words[1]), ref_codes)
        return torch.equal(codes, ref_codes)

    def fp16() -> bool:
        out = torch.empty(N, dtype=torch.int16, device=dev)
        flags, res = torch.empty(3, device=dev), torch.empty_like(a)
        one = torch.tensor(1.0, device=dev)
        K.cast_encode(a, torch.float16, one, out, flags, b=b, residual_out=res, decode_scale=one)
        ref_out = torch.empty_like(out)
        ref = cast_on_device(v, torch.float16, one, ref_out)
        dec = torch.empty_like(v)
        uncast(ref_out, torch.float16, one, dec)
        return torch.equal(out, ref_out) and torch.equal(flags, ref) and same(res, v - dec)

    print(f"fused kernels on {dev}{' (interpreter)' if dev.type == 'cpu' else ''}, {N} float32 elements")
    for name, fn in [
        ("chunked top-k (+ef, residual)", chunked),
        ("statistics (+ef, inf/NaN)", stats),
        ("threshold selection (+ef)", above),
        ("sampled threshold (+ef)", sampled),
        ("mstopk, 20 steps (+ef)", mstopk),
        ("stratified random-k", randomk),
        ("onebit (+ef)", onebit),
        ("tbq (+ef, residual)", tbq),
        ("terngrad 2-bit (+ef)", terngrad),
        ("fp16 cast (+ef, residual)", fp16),
    ]:
        run(name, fn)
    return 0 if all(ok for _, ok, _ in results) else 1


def compile_all() -> int:
    """Record every launch of a set of wrapper calls, then compile each variant for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    from gradsync.codecs.kernels import approx_topk, launch, quantize, random, threshold, topk

    names = {
        torch.float32: "fp32",
        torch.float16: "fp16",
        torch.bfloat16: "bf16",
        torch.float64: "fp64",
        torch.int32: "i32",
        torch.int64: "i64",
        torch.uint8: "u8",
        torch.int16: "i16",
    }
    launches: list[tuple[object, tuple, dict, dict]] = []
    real_module = launch.module

    class Recorder:
        def __init__(self, module: object) -> None:
            self.module = module

        def __getattr__(self, name: str) -> object:
            fn = getattr(self.module, name)
            if not isinstance(fn, triton.runtime.jit.JITFunction):
                return fn

            class Grid:
                def __getitem__(self, grid: object) -> object:
                    def record(*args: object, **kwargs: object) -> None:
                        opts = {k: kwargs.pop(k) for k in ("num_warps", "enable_fp_fusion") if k in kwargs}
                        launches.append((fn, args, kwargs, opts))

                    return record

            return Grid()

    for mod in (approx_topk, quantize, random, threshold, topk):
        mod.module = lambda name: Recorder(real_module(name))  # type: ignore[attr-defined]
        for attr in ("use_kernels", "available"):
            if hasattr(mod, attr):
                setattr(mod, attr, lambda *args, **kwargs: True)
    n = 10000
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        a, b = torch.randn(n, dtype=dtype), torch.randn(n, dtype=dtype)
        v, st = torch.empty_like(a), torch.empty(4, dtype=torch.float64)
        idx, val = torch.empty(n, dtype=torch.int32), torch.empty(n, dtype=dtype)
        one, count = torch.ones(1, dtype=torch.int64), torch.empty(1, dtype=torch.int64)
        for chunk, per, of_tail in ((4096, 41, 18), (64, 1, 1), (16384, 1, 100), (20000, 1, 100)):
            nf = torch.empty(1, dtype=torch.int32)
            K.chunked_topk(a, chunk, per, of_tail, idx, val, nf, b=b, v_out=v, residual_out=v)
        K.fused_stats(a, st, b=b, v_out=v)
        for strict in (False, True):
            for t in (torch.tensor(1.0), torch.tensor(1.0, dtype=torch.float64)):
                K.select_above(a, t, 50, idx, val, count, st, strict=strict, b=b)
                K.select_above(a, t, 50, idx, val, count, st, strict=strict, b=b, v_out=v)
        K.sampled_threshold(a, 100, 0.01, one.repeat(2), torch.empty(1), b=b)
        for iters in (8, 20, 24):
            K.mstopk(a, 100, iters, one, idx, val, count, st, b=b, v_out=v)
        codes = torch.empty(n, dtype=torch.uint8)
        K.onebit_encode(a, codes, st, b=b, v_out=v)
        K.lut_residual(a, codes, 1, torch.zeros(2), v)
        for tau in (0.5, torch.tensor(0.5)):
            K.tbq_encode(a, tau, codes, count.repeat(2), b=b, v_out=v, residual_out=v)
        for bits in (2, 4, 8):
            K.stochastic_encode(
                a, torch.tensor(1.0), 2 ** (bits - 1) - 1, bits, one.repeat(2), codes, b=b, v_out=v,
                residual_out=v, lut=torch.zeros(1 << bits),
            )  # fmt: skip
        for fmt in (torch.float16, torch.bfloat16):
            half = torch.empty(n, dtype=torch.int16)
            K.cast_encode(
                a, fmt, torch.tensor(1.0), half, torch.empty(3), b=b, v_out=v, residual_out=v,
                decode_scale=torch.tensor(1.0),
            )  # fmt: skip
        K.stratified_randomk(n, 100, one.repeat(2), idx, sizes_out=idx, a=a, b=b, val_out=val)
    K.stratified_randomk(2**33, 100, one.repeat(2), torch.empty(100, dtype=torch.int64))
    probe = real_module("common").probe_kernel
    launches.append((probe, (torch.empty(1, dtype=torch.int32),), {}, {"enable_fp_fusion": False}))

    target = GPUTarget("cuda", 90, 32)
    seen: set[str] = set()
    failures = 0
    for fn, args, kwargs, opts in launches:
        values = dict(zip(fn.arg_names, args, strict=False)) | kwargs
        signature, constants = {}, {}
        for param, name in zip(fn.params, fn.arg_names, strict=True):
            value = values[name]
            if param.is_constexpr:
                signature[name], constants[name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[name] = "*" + names[value.dtype]
            elif isinstance(value, float):
                signature[name] = "fp32"
            else:
                signature[name] = "i32" if -(2**31) <= int(value) < 2**31 else "i64"
        key = f"{fn.__name__} {sorted(signature.items())} {sorted(constants.items())}"
        if key in seen:
            continue
        seen.add(key)
        try:
            kernel = triton_compile(ASTSource(fn, signature, constants), target=target, options=opts)
        except Exception as error:  # report every failing variant, not only the first
            failures += 1
            print(f"FAIL {fn.__name__} {constants}: {type(error).__name__}: {str(error)[:400]}")
            continue
        fused = len(re.findall(r"\bfma\.rn\.f32", kernel.asm["ptx"]))
        print(f"ok   {fn.__name__:<26} fma.f32={fused:<4} {constants}")
    print(f"{len(seen)} variants compiled for sm_90, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(compile_all() if MODE == "compile" else check())
