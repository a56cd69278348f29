"""MSTopK (the MSTopK paper's Algorithm 1, :func:`gradsync.codecs.selection_on_device.mstopk`)
in five reads of the data instead of ``iters`` counting passes.

The reference bisects a ratio in [0, 1] between the mean and the maximum of ``|v|``, one
counting pass per step. Its ratios are dyadic: ``iters`` steps only ever try ``m / 2^iters``.
So the steps can be replayed on a histogram:

1. statistics, fused with error feedback's add (:func:`~gradsync.codecs.kernels.threshold.fused_stats`);
2. a histogram of every key against the thresholds of the first ``min(iters, 12)`` steps
   (up to 4096 bins), and one program that replays those steps on it;
3. for ``iters > 12``, a histogram inside the one coarse bin where the search ends
   (``2^(iters-12)`` sub-bins), and one program that replays the remaining steps;
4. per block, the counts of the selected classes (above the upper threshold, in the band,
   below the upper threshold), and one program that places the random run in the band and
   each block's first output slot;
5. the compaction of the selected positions, in increasing order.

Each key's bin is estimated from ``(|v| - mean) / (top - mean)`` and settled against the
exact thresholds, computed in registers in float32 with the reference's roundings
(``mean + ratio * (top - mean)``, no fused multiply-add) and compared as the reference compares
(``|v| >= t``); a block with a key the estimate does not settle bisects over the bins instead.
Given the same mean and maximum the selection equals the reference's bit for bit; the mean
comes from this package's statistics pass, whose sum differs from torch's in the last bits (so
on real data the selection can differ from the reference's where the mean's last bit moves a
threshold across a key).
``iters`` above 24 (where the ratios stop being exact in float32) runs :func:`mstopk_torch`.
"""

from __future__ import annotations

import math

import torch

from gradsync.codecs.kernels.launch import (
    ScratchLayout,
    cdiv,
    check_addend,
    check_out,
    module,
    use_kernels,
)
from gradsync.codecs.kernels.threshold import (
    BLOCK,
    fill_slots,
    fused_stats_torch,
    position_dtype,
    stats_kernels,
    stats_layout,
)

MAX_ITERS = 24
"""The most bisection steps the kernels replay; more run the torch version."""

COARSE_BITS = 12
_TILE = 1024


def mstopk_layout(n: int, k: int) -> ScratchLayout:
    """Scratch of :func:`mstopk` (sizes from ``n`` and ``k`` only)."""
    blocks = cdiv(n, BLOCK)
    return ScratchLayout(
        (
            *stats_layout(n).parts,
            ("hist", 1 << COARSE_BITS, torch.int32),
            ("sub", 1 << COARSE_BITS, torch.int32),
            ("state_f", 2, torch.float32),
            ("state_i", 8, torch.int64),
            ("part_c", 3 * blocks, torch.int32),
            ("offsets", 2 * blocks + 1, torch.int64),
            ("pool", min(k, n), position_dtype(n)),
        )
    )


def _check(
    a: torch.Tensor,
    k: int,
    iters: int,
    word: torch.Tensor,
    idx_out: torch.Tensor,
    val_out: torch.Tensor,
    count_out: torch.Tensor,
    stats_out: torch.Tensor,
    b: torch.Tensor | None,
    v_out: torch.Tensor | None,
) -> int:
    check_addend(a, b)
    n, dev = a.numel(), a.device
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if word.dtype != torch.int64 or word.numel() < 1 or word.device != dev:
        raise ValueError(f"word must be a one-element int64 tensor on {dev}")
    cap = min(k, n)
    index_dtypes = (torch.int32, torch.int64) if n <= 2**31 - 1 else (torch.int64,)
    check_out("idx_out", idx_out, cap, index_dtypes, dev)
    check_out("val_out", val_out, cap, (a.dtype,), dev)
    check_out("count_out", count_out, 1, (torch.int64,), dev)
    check_out("stats_out", stats_out, 4, (torch.float64,), dev)
    if v_out is not None:
        check_out("v_out", v_out, n, (a.dtype,), dev)
    elif b is not None:
        raise ValueError("mstopk with b needs v_out: the passes after the first read v from it")
    return cap


def mstopk(
    a: torch.Tensor,
    k: int,
    iters: int,
    word: torch.Tensor,
    idx_out: torch.Tensor,
    val_out: torch.Tensor,
    count_out: torch.Tensor,
    stats_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """MSTopK of ``v = a (+ b)``: ``min(k, numel)`` slots of positions (increasing, then padding
    that repeats the first) in ``idx_out``, their values in ``val_out``, the real count in
    ``count_out`` (int64, one element), the statistics in ``stats_out`` (as
    :func:`~gradsync.codecs.kernels.threshold.fused_stats`).

    ``word``: a one-element int64 device tensor holding the 32-bit word the reference draws
    from its generator (or the first of its device words) for the start of the band's random
    run. With ``b``, ``v_out`` is required and receives ``v`` (it may be ``a`` or ``b``).
    Scratch: :func:`mstopk_layout`. Falls back to :func:`mstopk_torch` for ``iters > 24``.
    """
    cap = _check(a, k, iters, word, idx_out, val_out, count_out, stats_out, b, v_out)
    n, dev = a.numel(), a.device
    if iters > MAX_ITERS or not use_kernels(a):
        mstopk_torch(a, k, iters, word, idx_out, val_out, count_out, stats_out, b=b, v_out=v_out)
        return
    if n == 0:
        stats_out[:4].zero_()
        count_out.zero_()
        return
    parts = mstopk_layout(n, k).carve(scratch, dev)
    stats_kernels(a, b, v_out, stats_out, parts)
    v = v_out if v_out is not None else a
    blocks = cdiv(n, BLOCK)
    kernels = module("approx_topk")
    opts = {"enable_fp_fusion": False}
    coarse = min(iters, COARSE_BITS)
    parts["hist"].zero_()
    kernels.hist_kernel[(blocks,)](
        v,
        stats_out,
        parts["hist"],
        n,
        BITS=coarse,
        NB=1 << coarse,
        SCALE=2.0**-coarse,
        BLOCK=BLOCK,
        num_warps=8,
        **opts,
    )
    kernels.coarse_kernel[(1,)](
        parts["hist"],
        stats_out,
        parts["state_f"],
        parts["state_i"],
        n,
        k,
        STEPS=coarse,
        NB=1 << coarse,
        SCALE=2.0**-coarse,
        num_warps=8,
        **opts,
    )
    fine = iters - coarse
    if fine:
        parts["sub"].zero_()
        kernels.refine_kernel[(blocks,)](
            v,
            stats_out,
            parts["state_i"],
            parts["sub"],
            n,
            BITS=fine,
            NS=1 << fine,
            SCALE=2.0**-iters,
            BLOCK=BLOCK,
            num_warps=8,
            **opts,
        )
        kernels.fine_kernel[(1,)](
            parts["sub"],
            stats_out,
            parts["state_f"],
            parts["state_i"],
            n,
            k,
            BITS=fine,
            NS=1 << fine,
            SCALE=2.0**-iters,
            num_warps=8,
            **opts,
        )
    kernels.count_kernel[(blocks,)](
        v, parts["state_f"], parts["part_c"], n, blocks, BLOCK=BLOCK, num_warps=8, **opts
    )
    kernels.scan_kernel[(1,)](
        parts["part_c"],
        parts["state_i"],
        word,
        parts["offsets"],
        count_out,
        blocks,
        cap,
        TILE=_TILE,
        num_warps=4,
        **opts,
    )
    pool = parts["pool"]
    pool.fill_(-1)
    kernels.compact_kernel[(blocks,)](
        v,
        parts["state_f"],
        parts["state_i"],
        parts["offsets"],
        pool,
        n,
        blocks,
        cap,
        BLOCK=BLOCK,
        num_warps=8,
        **opts,
    )
    fill_slots(pool, v, None, idx_out, val_out)


def mstopk_torch(
    a: torch.Tensor,
    k: int,
    iters: int,
    word: torch.Tensor,
    idx_out: torch.Tensor,
    val_out: torch.Tensor,
    count_out: torch.Tensor,
    stats_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
    stats: torch.Tensor | None = None,
) -> None:
    """:func:`mstopk` in torch operations: the reference's algorithm, step for step (``iters``
    counting passes), with the run's word from a device tensor. ``stats`` (float64
    ``[sum |v|, max |v|, ...]``): use these statistics instead of computing them (to replay a
    kernel run exactly); they are what ``stats_out`` receives then. ``scratch`` unused."""
    cap = _check(a, k, iters, word, idx_out, val_out, count_out, stats_out, b, v_out)
    n = a.numel()
    fused_stats_torch(a, stats_out, b=b, v_out=v_out)
    if stats is not None:
        stats_out[:4].copy_(stats[:4])
    if n == 0:
        count_out.zero_()
        return
    v = (v_out if v_out is not None else a).view(-1)
    keys = v.float().abs()
    mean = (stats_out[0] / n).float()
    top = stats_out[1].float()
    lo, hi = torch.zeros_like(mean), torch.ones_like(mean)
    thres1 = torch.full_like(mean, math.inf)
    k1 = torch.zeros((), dtype=torch.int64, device=v.device)
    thres2 = torch.zeros_like(mean)
    for _ in range(iters):
        ratio = lo + (hi - lo) / 2
        t = mean + ratio * (top - mean)
        count = (keys >= t).sum()
        fits = count <= k
        hi, lo = torch.where(fits, ratio, hi), torch.where(fits, lo, ratio)
        thres1, k1 = torch.where(fits, t, thres1), torch.where(fits, count, k1)
        thres2 = torch.where(fits, thres2, t)
    upper = keys >= thres1
    need = (cap - k1).clamp(min=0)
    band = (keys >= thres2) & ~upper
    band = torch.where(band.sum() >= need, band, (keys < thres1))
    rank = band.cumsum(0, dtype=torch.int64) - 1
    u = (word.view(-1)[0] >> 8).to(torch.float32) * (1.0 / 16777216.0)
    start = torch.floor(u * (band.sum() - need + 1).clamp(min=1).to(torch.float32))
    run = band & (rank >= start) & (rank < start + need)
    pool = torch.nonzero_static(upper | run, size=cap, fill_value=-1).view(-1)
    count_out.view(-1)[:1].copy_((pool >= 0).sum().reshape(1))
    fill_slots(pool, v, None, idx_out, val_out)
