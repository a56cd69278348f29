"""Typed signatures of the compiled module ``gradsync._native`` (built from ``_native.c``).

Callers go through :func:`gradsync.codecs.ops.native.ext`, whose return type is checked against
this file, so a type checker sees every kernel call. Conventions of every function:

- arguments are positional only; a pointer is the integer address of a contiguous CPU buffer
  (:func:`gradsync.codecs.ops.native.ptr`), ``x``/``n`` style pairs give an input and its
  element count;
- every buffer a kernel writes comes with its size in bytes (``*_nbytes``, ``tensor.nbytes``);
  a buffer too small raises ``ValueError`` naming it and the sizes before anything is written
  (``range_positions`` may have filled ``pos`` up to its end first);
- a negative count raises ``ValueError``; a non-number in ``thresholds`` or ``lut`` raises
  ``TypeError`` naming the item;
- ``mode`` selects the key compared with thresholds: 0 ``|x|``, 1 ``x``, 2 ``-x``.

The functions exist only where the module was built for x86-64 (``SUPPORTED`` says whether the
CPU also has AVX2, FMA and F16C; callers use nothing but ``SUPPORTED`` unless it is true).
"""

from collections.abc import Sequence

SUPPORTED: int

def stats(x: int, n: int, /) -> tuple[float, float, int, float]:
    """``(sum |x|, max |x|, non-finite count, sum x^2)`` of ``n`` floats."""

def absmax(x: int, n: int, /) -> tuple[float, int]:
    """``(max |x|, 1 if any element is inf or NaN else 0)``."""

def scan_select(
    x: int, n: int, t: float, mode: int, want_sum: bool, idx: int, val: int, cap: int, /
) -> tuple[int, float, float, int]:
    """Compact the elements with ``key >= t`` into ``idx`` (int32) / ``val`` (float32), which hold
    ``cap`` entries each; returns ``(count, sum |x| or NaN, max |x|, non-finite flag)`` with the
    full count, which exceeds ``cap`` when the buffers were too small (nothing written past them).
    ``n`` is at most 2^31 - 1."""

def sum_scan_select(
    x: int,
    y: int,
    n: int,
    out: int,
    out_nbytes: int,
    t: float,
    mode: int,
    want_sum: bool,
    idx: int,
    val: int,
    cap: int,
    /,
) -> tuple[int, float, float, int]:
    """``out = x + y`` (``4 n`` bytes; each sum one float32 add, as ``torch.add`` rounds it), and
    :func:`scan_select` over ``out`` in the same pass."""

def count_ge(x: int, n: int, thresholds: Sequence[float], mode: int, /) -> list[int]:
    """``#{i : key(x_i) >= t}`` for each of 1 to 16 thresholds."""

def kth_largest(v: int, n: int, k: int, mode: int, scratch: int, scratch_nbytes: int, /) -> float:
    """The ``k``-th largest key (1-based, NaN keys count as -inf); ``scratch`` holds ``4 n`` bytes."""

def keep_top(idx: int, val: int, n: int, k: int, kth: float, mode: int, /) -> int:
    """Keep, in place and in index order, the ``k`` of ``n`` candidates with the largest keys
    (ties at ``kth`` by lower position); returns the number kept."""

def sign_pack(x: int, n: int, bits: int, bits_nbytes: int, /) -> tuple[float, int, float, int]:
    """One bit per element (1 where ``x >= 0``) into ``bits`` (``ceil(n / 8)`` bytes); returns
    ``(sum of non-negatives, their count, sum of negatives, non-finite count)``."""

def ternary_pack(x: int, n: int, tau: float, out: int, out_nbytes: int, /) -> tuple[int, int]:
    """2-bit codes (1: ``x > tau``, 2: ``x < -tau``) into ``out`` (``ceil(n / 4)`` bytes); returns
    ``(non-zero codes, non-finite flag)``."""

def stoch_pack(
    x: int, n: int, mult: float, levels: int, bits: int, k1: int, k2: int, out: int, out_nbytes: int, /
) -> None:
    """Stochastic ``bits``-bit codes (2, 4 or 8; ``0 <= levels < 2^(bits-1)``) into ``out``
    (``ceil(n bits / 8)`` bytes), uniforms keyed by the 32-bit words ``k1``, ``k2``."""

def lut_unpack(
    codes: int,
    codes_nbytes: int,
    n: int,
    bits: int,
    lut: Sequence[float],
    out: int,
    out_nbytes: int,
    accumulate: bool,
    /,
) -> None:
    """``out[i] (+)= lut[code_i]`` for ``n`` codes of ``bits`` bits (1, 2, 4 or 8; ``lut`` has
    ``2^bits`` entries); ``codes`` holds ``ceil(n bits / 8)`` bytes, ``out`` ``4 n``."""

def to_half(x: int, n: int, scale: float, out: int, out_nbytes: int, bf16: bool, /) -> tuple[float, int, int]:
    """``out = fp16/bf16(x * scale)`` (``2 n`` bytes); returns ``(max |x|, non-finite flag,
    overflow flag)``."""

def from_half(
    h: int, n: int, scale: float, out: int, out_nbytes: int, bf16: bool, accumulate: bool, /
) -> None:
    """``out (+)= float(h) * scale`` for ``n`` fp16/bf16 values; ``out`` holds ``4 n`` bytes."""

def sparse_add(out: int, n: int, idx: int, val: int, m: int, alpha: float, /) -> int:
    """``out[idx[j]] += alpha * val[j]`` into the ``n`` floats of ``out``; returns how many of the
    ``m`` indices were outside ``[0, n)`` (skipped)."""

def sparse_to_dense(out: int, n: int, idx: int, val: int, m: int, /) -> int:
    """``out = 0`` except ``out[idx[j]] = val[j]``; 0 on success, 1 if an index is outside
    ``[0, n)`` (``out`` untouched), 2 if the indices are not strictly increasing."""

def copy_check(x: int, n: int, out: int, out_nbytes: int, /) -> bool:
    """``out = x`` (``4 n`` bytes); True if any element is inf or NaN."""

def range_positions(keys: int, n: int, lo: float, hi: float, pos: int, pos_nbytes: int, /) -> int:
    """Positions (int32, ascending) of the keys in ``[lo, hi)`` into ``pos``; returns their count
    (``ValueError`` if ``pos`` cannot hold them). ``n`` is at most 2^31 - 1."""

def random_subset(
    n: int, k: int, seed: int, idx: int, idx_nbytes: int, bitmap: int, bitmap_nbytes: int, /
) -> None:
    """``k`` distinct sorted int32 indices from ``range(n)`` into ``idx`` (``4 k`` bytes); ``bitmap``
    is scratch of ``8 ceil(n / 64)`` bytes."""

def gather(x: int, n: int, idx: int, m: int, val: int, val_nbytes: int, /) -> None:
    """``val[j] = x[idx[j]]`` for ``m`` int32 indices (``val`` holds ``4 m`` bytes); an index
    outside the ``n`` floats of ``x`` raises ``IndexError``."""
