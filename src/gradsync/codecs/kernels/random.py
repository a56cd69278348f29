"""Random-k positions drawn on the device in O(k) work: one uniformly drawn position in each
of ``k`` strata, from the counter-based hash, keyed by words in a device tensor (a replayed
CUDA graph draws new positions when new words are written there).

Stratum ``i`` is ``[floor(i n / k), floor((i + 1) n / k))``, so the ``k`` positions are
distinct and increasing by construction, and every element lies in exactly one stratum. Each
element is drawn with probability ``1 / size`` of its stratum (sizes differ by at most one):
scaling the sent value by its stratum's size makes the estimate exactly unbiased (the
unbiased random-k). The position within a stratum comes from the 23-bit uniform of
:func:`gradsync.codecs.ops.hashed_uniform` as ``(m * size) >> 23``: each position's chance is
within ``size / 2^23`` (relative) of ``1 / size``.

This is a different draw from :func:`gradsync.codecs.selection_on_device.randomk` (the ``k``
largest of ``n`` hashed uniforms: any k-subset, O(n) work); stratified sampling never picks
two neighbours of one stratum, which for gradient compression only removes the variance of
clustered draws.
"""

from __future__ import annotations

from typing import Any

import torch

from gradsync.codecs.kernels.launch import (
    KERNEL_DTYPES,
    available,
    cdiv,
    check_addend,
    check_out,
    check_words,
    module,
)
from gradsync.codecs.ops import hashed_uniform

_BLOCK = 1024


def _check(
    n: int,
    k: int,
    words: torch.Tensor,
    idx_out: torch.Tensor,
    sizes_out: torch.Tensor | None,
    a: torch.Tensor | None,
    b: torch.Tensor | None,
    val_out: torch.Tensor | None,
) -> None:
    if not 0 <= k <= n:
        raise ValueError(f"k must be in [0, n={n}], got {k}")
    dev = words.device
    check_words(words, dev)
    index_dtypes = (torch.int32, torch.int64) if n <= 2**31 - 1 else (torch.int64,)
    check_out("idx_out", idx_out, k, index_dtypes, dev)
    if sizes_out is not None:
        check_out("sizes_out", sizes_out, k, (torch.int32, torch.int64, torch.float32), dev)
    if (a is None) != (val_out is None):
        raise ValueError("give a and val_out together (the values gathered at the positions)")
    if a is not None and val_out is not None:
        check_addend(a, b)
        if a.numel() != n:
            raise ValueError(f"a has {a.numel()} elements, n is {n}")
        check_out("val_out", val_out, k, (a.dtype,), dev)


def stratified_randomk(
    n: int,
    k: int,
    words: torch.Tensor,
    idx_out: torch.Tensor,
    *,
    sizes_out: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    val_out: torch.Tensor | None = None,
) -> None:
    """``k`` distinct positions in ``[0, n)``, increasing, one per stratum, into ``idx_out``
    (int32 or int64); ``words``: int64 device tensor ``[w1, w2]`` keying the hash. Optionally
    ``sizes_out`` (int32/int64/float32): each stratum's size, and with ``a`` (and ``b``)
    ``val_out``: ``v = a (+ b)`` at the positions. O(k) work, no scratch, no host read."""
    _check(n, k, words, idx_out, sizes_out, a, b, val_out)
    if k == 0:
        return
    if not available(words.device) or (a is not None and a.dtype not in KERNEL_DTYPES):
        stratified_randomk_torch(n, k, words, idx_out, sizes_out=sizes_out, a=a, b=b, val_out=val_out)
        return
    dummy = idx_out
    src = a if a is not None else dummy
    module("random").strata_kernel[(cdiv(k, _BLOCK),)](
        words,
        idx_out,
        sizes_out if sizes_out is not None else dummy,
        src,
        b if b is not None else src,
        val_out if val_out is not None else dummy,
        n,
        k,
        WRITE_SIZE=sizes_out is not None,
        GATHER=a is not None,
        HAS_B=b is not None,
        BLOCK=_BLOCK,
        num_warps=4,
        enable_fp_fusion=False,
    )


def stratified_randomk_torch(
    n: int,
    k: int,
    words: torch.Tensor,
    idx_out: torch.Tensor,
    *,
    sizes_out: torch.Tensor | None = None,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    val_out: torch.Tensor | None = None,
) -> None:
    """:func:`stratified_randomk` in torch operations (the same positions)."""
    _check(n, k, words, idx_out, sizes_out, a, b, val_out)
    if k == 0:
        return
    dev = words.device
    i = torch.arange(k, dtype=torch.int64, device=dev)
    lo = i * n // k
    size = (i + 1) * n // k - lo
    w1: Any = words[0]  # (0-dim device tensors: the hash takes them as it takes ints)
    w2: Any = words[1]
    draw = (hashed_uniform(k, w1, w2, dev) * 8388608.0).long()  # the 23-bit integer, exactly
    pos = lo + ((draw * size) >> 23)
    idx_out[:k].copy_(pos)
    if sizes_out is not None:
        sizes_out[:k].copy_(size)
    if a is not None and val_out is not None:
        picked = a.view(-1)[pos] if b is None else torch.add(a.view(-1)[pos], b.view(-1)[pos])
        val_out[:k].copy_(picked)
