"""Triton building blocks shared by the kernels: the fused error-feedback add, magnitude keys,
the counter-based hashes of :mod:`gradsync.codecs.ops.random`, and scalar constructors.

Imported only when triton is usable (:mod:`gradsync.codecs.kernels.launch`). Everything here is
a ``@triton.jit`` function inlined into the kernels that call it. Only long-standing
``triton.language`` operations are used, so the same source compiles with the triton a CUDA
torch ships and runs under ``TRITON_INTERPRET=1`` on a CPU.
"""

import triton
import triton.language as tl

INF_BITS = tl.constexpr(0x7F800000)
"""The bit pattern of float32 +inf: the largest magnitude key (NaN keys are clamped to it)."""


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to ``dtype`` (float32, float16 or bfloat16) to nearest even, as torch
    rounds. bfloat16 is rounded with integer operations (torch's own formula, NaN to 0x7FC0):
    the interpreter's float-to-bfloat16 conversion truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        r = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        r = tl.where(x != x, 0x7FC0, r)
        y = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float16:
        y = x.to(tl.float16)
    else:
        y = x
    return y


@triton.jit
def load_sum(a_ptr, b_ptr, offs, mask, HAS_B: tl.constexpr):
    """``a[offs] (+ b[offs])`` in a's dtype, rounded as ``torch.add`` rounds it: the sum is formed
    in float32 and rounded once to the storage dtype (a no-op for float32)."""
    x = tl.load(a_ptr + offs, mask=mask, other=0.0)
    if HAS_B:
        y = tl.load(b_ptr + offs, mask=mask, other=0.0)
        x = round_to(x.to(tl.float32) + y.to(tl.float32), a_ptr.dtype.element_ty)
    return x


@triton.jit
def magnitude_bits(x):
    """``|x|`` (x converted to float32) as its int32 bit pattern, NaN mapped to +inf's pattern.
    For non-negative floats the patterns order as the values do."""
    bits = x.to(tl.float32).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return tl.minimum(bits, INF_BITS)


@triton.jit
def scalar_i32(value):
    """A 0-d int32 tensor holding ``value`` (usable as a loop-carried variable)."""
    return tl.max(tl.full([2], value, tl.int32), 0)


@triton.jit
def scalar_i64(value):
    """A 0-d int64 tensor holding ``value``."""
    return tl.max(tl.full([2], value, tl.int64), 0)


@triton.jit
def scalar_f32(value):
    """A 0-d float32 tensor holding ``value``."""
    return tl.max(tl.full([2], value, tl.float32), 0)


@triton.jit
def mix32(h):
    """The "lowbias32" integer hash on uint32 (wrapping multiplications, logical shifts)."""
    h = h ^ (h >> 16)
    h = h * 0x7FEB352D
    h = h ^ (h >> 15)
    h = h * 0x846CA68B
    h = h ^ (h >> 16)
    return h


@triton.jit
def load_words(words_ptr):
    """The two 32-bit key words stored as int64 in ``words_ptr[0:2]``, as uint32."""
    k1 = tl.load(words_ptr).to(tl.uint32)
    k2 = tl.load(words_ptr + 1).to(tl.uint32)
    return k1, k2


@triton.jit
def hashed_bits(i, k1, k2):
    """``mix(i + k1) ^ k2`` (mod 2^32) for int64 counters ``i``: the hash behind
    :func:`gradsync.codecs.ops.hashed_uniform`."""
    return mix32(i.to(tl.uint32) + k1) ^ k2


@triton.jit
def hashed_uniform(i, k1, k2):
    """:func:`gradsync.codecs.ops.hashed_uniform` at counters ``i``: float32 in [0, 1), 23 bits."""
    return (hashed_bits(i, k1, k2) >> 9).to(tl.float32) * (1.0 / 8388608.0)


@triton.jit
def hashed_uniform16(i, k1, k2):
    """:func:`gradsync.codecs.ops.hashed_uniform16` at counters ``i``: two 16-bit uniforms per
    hash, element ``i`` in block ``i // 16``, lane ``i % 8``, high half when ``i % 16 >= 8``."""
    h = mix32(((i >> 4) * 8 + (i & 7)).to(tl.uint32) + k1) ^ k2
    half = tl.where((i & 8) != 0, h >> 16, h & 0xFFFF)
    return half.to(tl.float32) * (1.0 / 65536.0)


@triton.jit
def probe_kernel(out_ptr):
    """Writes 1 into ``out_ptr[0]``: launched once to learn whether triton works on a device."""
    tl.store(out_ptr, 1)
