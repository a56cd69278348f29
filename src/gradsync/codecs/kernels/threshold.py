"""Threshold selection on the device in two reads of the data: the rule of
:func:`gradsync.codecs.selection_on_device.above` (DGC, GradDrop, bsearch's reused threshold),
its statistics pass, and DGC's sampled threshold, each fused with error feedback's add.

The pipeline of :func:`select_above`:

1. one pass: ``v = a (+ b)`` (written to ``v_out``), and per block of 4096 elements the
   partials of :func:`gradsync.codecs.ops.device_stats` and the count of keys passing ``t``;
2. one program: the statistics (float64 sums in a fixed order), the effective threshold
   ``min(t, max |v|)`` and each block's first output slot (a prefix sum over blocks);
3. one pass: every block writes its passing positions, in increasing order, into the pool of
   the first ``2 * capacity``;
4. when the pool can exceed the capacity, the ``capacity`` largest of the pool (a small
   ``torch.topk``, the reference's own), then the slots.

Statistics: maxima and counts are exact; the float sums are accumulated per block in float32
and across blocks in float64, so they differ from torch's reduction order in the last bits.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

from gradsync.codecs.kernels.launch import (
    ScratchLayout,
    cdiv,
    check_addend,
    check_out,
    check_words,
    module,
    use_kernels,
)
from gradsync.codecs.ops import DeviceStats, dgc_sample, hashed_uniform, stats_vector

BLOCK = 4096
"""Elements per program of the passes (and per partial)."""

_TILE = 1024  # blocks per step of the one-program finish
_SLOTS_BLOCK = 1024


def _index_dtype(n: int) -> tuple[torch.dtype, ...]:
    return (torch.int32, torch.int64) if n <= 2**31 - 1 else (torch.int64,)


def position_dtype(n: int) -> torch.dtype:
    """The dtype of scratch position lists for a tensor of ``n`` elements."""
    return torch.int32 if n <= 2**31 - 1 else torch.int64


def stats_layout(n: int) -> ScratchLayout:
    """Scratch of :func:`fused_stats`: the per-block partials."""
    blocks = cdiv(n, BLOCK)
    return ScratchLayout((("part_f", 3 * blocks, torch.float32), ("part_i", 3 * blocks, torch.int32)))


def select_layout(n: int, capacity: int) -> ScratchLayout:
    """Scratch of :func:`select_above`: partials, block offsets, the pool and two scalars."""
    blocks = cdiv(n, BLOCK)
    return ScratchLayout(
        (
            ("part_f", 3 * blocks, torch.float32),
            ("part_i", 3 * blocks, torch.int32),
            ("offsets", blocks + 1, torch.int64),
            ("state", 2, torch.float32),
            ("pool", min(n, 2 * capacity), position_dtype(n)),
        )
    )


def _check_stats_out(stats_out: torch.Tensor, device: torch.device) -> None:
    check_out("stats_out", stats_out, 4, (torch.float64,), device)


def fused_stats(
    a: torch.Tensor,
    stats_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """:func:`gradsync.codecs.ops.device_stats` of ``v = a (+ b)`` in one read, writing
    ``stats_out[0:4]`` (float64): sum |v|, max |v| ignoring NaN, the number of inf/NaN elements,
    sum v^2 (the layout of the stats behind :class:`~gradsync.codecs.ops.DeviceStats`; see
    :func:`as_device_stats`). ``v_out`` receives ``v`` (it may be ``a`` or ``b``).

    Scratch: :func:`stats_layout` (``scratch=None`` allocates it, a size that depends on
    ``numel`` only). The maximum and the count are exact; the sums match torch's to rounding.
    """
    check_addend(a, b)
    dev, n = a.device, a.numel()
    _check_stats_out(stats_out, dev)
    if v_out is not None:
        check_out("v_out", v_out, n, (a.dtype,), dev)
    if n == 0:
        stats_out[:4].zero_()
        return
    if not use_kernels(a):
        fused_stats_torch(a, stats_out, b=b, v_out=v_out)
        return
    stats_kernels(a, b, v_out, stats_out, stats_layout(n).carve(scratch, dev))


def stats_kernels(
    a: torch.Tensor,
    b: torch.Tensor | None,
    v_out: torch.Tensor | None,
    stats_out: torch.Tensor,
    parts: dict[str, torch.Tensor],
) -> None:
    """The two launches of :func:`fused_stats` with its scratch already carved (``part_f`` and
    ``part_i`` of :func:`stats_layout`): for the pipelines that begin with it."""
    _scan(a, b, v_out, None, False, parts)
    module("threshold").finish_kernel[(1,)](
        parts["part_f"],
        parts["part_i"],
        stats_out,
        stats_out,
        stats_out,
        stats_out,
        stats_out,
        cdiv(a.numel(), BLOCK),
        0,
        HAS_T=False,
        STRICT=False,
        TILE=_TILE,
        num_warps=4,
        enable_fp_fusion=False,
    )


def _scan(
    a: torch.Tensor,
    b: torch.Tensor | None,
    v_out: torch.Tensor | None,
    t: torch.Tensor | None,
    strict: bool,
    parts: dict[str, torch.Tensor],
) -> None:
    n = a.numel()
    blocks = cdiv(n, BLOCK)
    module("threshold").scan_kernel[(blocks,)](
        a,
        b if b is not None else a,
        v_out if v_out is not None else a,
        t if t is not None else a,
        parts["part_f"],
        parts["part_i"],
        n,
        blocks,
        HAS_B=b is not None,
        WRITE_V=v_out is not None,
        HAS_T=t is not None,
        STRICT=strict,
        BLOCK=BLOCK,
        num_warps=8,
        enable_fp_fusion=False,
    )


def fused_stats_torch(
    a: torch.Tensor,
    stats_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """:func:`fused_stats` in torch operations (``scratch`` unused)."""
    check_addend(a, b)
    v = (torch.add(a, b) if b is not None else a).view(-1)
    stats_out[:4].copy_(stats_vector(v))
    if v_out is not None:
        v_out.view(-1)[: v.numel()].copy_(v)


def as_device_stats(stats: torch.Tensor, numel: int) -> DeviceStats:
    """The :class:`~gradsync.codecs.ops.DeviceStats` of a ``stats_out`` tensor (views, no copy)."""
    return DeviceStats(numel, stats[0], stats[1], stats[2] > 0, stats[3])


def select_above(
    a: torch.Tensor,
    t: torch.Tensor,
    capacity: int,
    idx_out: torch.Tensor,
    val_out: torch.Tensor,
    count_out: torch.Tensor,
    stats_out: torch.Tensor,
    *,
    strict: bool = False,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """:func:`gradsync.codecs.selection_on_device.above` of ``v = a (+ b)`` with keys ``|v|``:
    the elements whose key reaches ``t`` (exceeds it with ``strict``, where the largest element
    passes anyway), the threshold lowered to ``max |v|`` so that at least that one passes; at
    most ``capacity``: the largest of the first ``2 * capacity`` passing ones by position.

    ``t``: a 0-dim (or 1-element) float device tensor, read on the device. Writes, in
    ``slots = min(capacity, numel)`` slots, ``idx_out[:slots]`` (positions in increasing order,
    then padding that repeats the first one), ``val_out[:slots]`` (``v`` there, 0 in padding),
    ``count_out`` (int64, one element: how many slots are real), ``stats_out[0:4]`` (as
    :func:`fused_stats`) and ``v_out`` (which may be ``a`` or ``b``). Equal to the reference
    bit for bit (indices, values, count) given the same ``t``.

    Scratch: :func:`select_layout`. When ``2 * capacity`` can exceed ``capacity`` slots (always,
    unless ``capacity >= numel``) the last step is a ``torch.topk`` over the pool (allocates
    temporaries of the pool's size). No host read.
    """
    check_addend(a, b)
    n, dev = a.numel(), a.device
    _check_select(a, t, capacity, idx_out, val_out, count_out, stats_out, v_out)
    if not use_kernels(a):
        select_above_torch(
            a, t, capacity, idx_out, val_out, count_out, stats_out, strict=strict, b=b, v_out=v_out
        )
        return
    if n == 0:
        stats_out[:4].zero_()
        count_out.zero_()
        return
    parts = select_layout(n, capacity).carve(scratch, dev)
    kernels = module("threshold")
    pool = parts["pool"]
    blocks = cdiv(n, BLOCK)
    _scan(a, b, v_out, t, strict, parts)
    kernels.finish_kernel[(1,)](
        parts["part_f"],
        parts["part_i"],
        stats_out,
        t,
        parts["state"],
        parts["offsets"],
        count_out,
        blocks,
        min(capacity, pool.numel()),
        HAS_T=True,
        STRICT=strict,
        TILE=_TILE,
        num_warps=4,
        enable_fp_fusion=False,
    )
    pool.fill_(-1)
    src, add = (v_out, None) if v_out is not None else (a, b)
    kernels.compact_kernel[(blocks,)](
        src,
        add if add is not None else src,
        parts["state"],
        parts["offsets"],
        pool,
        n,
        pool.numel(),
        HAS_B=add is not None,
        STRICT=strict,
        BLOCK=BLOCK,
        num_warps=8,
        enable_fp_fusion=False,
    )
    v = v_out if v_out is not None else a  # (the values: v itself, or recomputed at the slots)
    cand = pool if pool.numel() <= capacity else largest_of(v, b if v_out is None else None, pool, capacity)
    fill_slots(cand, v, b if v_out is None else None, idx_out, val_out)


def _check_select(
    a: torch.Tensor,
    t: torch.Tensor,
    capacity: int,
    idx_out: torch.Tensor,
    val_out: torch.Tensor,
    count_out: torch.Tensor,
    stats_out: torch.Tensor,
    v_out: torch.Tensor | None,
) -> None:
    n, dev = a.numel(), a.device
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    if t.numel() != 1 or not t.is_floating_point() or t.device != dev:
        raise ValueError(f"t must be a one-element float tensor on {dev}")
    slots = min(capacity, n)
    check_out("idx_out", idx_out, slots, _index_dtype(n), dev)
    check_out("val_out", val_out, slots, (a.dtype,), dev)
    check_out("count_out", count_out, 1, (torch.int64,), dev)
    _check_stats_out(stats_out, dev)
    if v_out is not None:
        check_out("v_out", v_out, n, (a.dtype,), dev)


def largest_of(v: torch.Tensor, b: torch.Tensor | None, pool: torch.Tensor, capacity: int) -> torch.Tensor:
    """The ``capacity`` candidates of ``pool`` (positions, -1 for none) of largest ``|v|``
    (``v = v + b`` where ``b`` is given), in increasing order, -1 after them: the reference's
    own small ``torch.topk``, so that ties resolve identically."""
    n = v.numel()
    cand = pool.long()
    at = cand.clamp(min=0)
    picked = v[at] if b is None else torch.add(v[at], b[at])
    score = torch.where(cand >= 0, picked.float().abs(), -1.0)
    kept = cand[score.topk(capacity, sorted=False).indices]
    order = torch.where(kept >= 0, kept, n).sort().values
    return torch.where(order < n, order, -1)


def fill_slots(
    cand: torch.Tensor, v: torch.Tensor, b: torch.Tensor | None, idx_out: torch.Tensor, val_out: torch.Tensor
) -> None:
    """``idx_out``/``val_out`` from candidates (positions increasing, then -1): real slots keep
    theirs, empty ones repeat the first position with the value 0. ``v (+ b)`` gives the values.
    A kernel where triton runs, torch operations elsewhere."""
    cap = cand.numel()
    if cap == 0:
        return
    if b is None and use_kernels(v):
        module("threshold").slots_kernel[(cdiv(cap, _SLOTS_BLOCK),)](
            cand, v, idx_out, val_out, cap, BLOCK=_SLOTS_BLOCK, num_warps=4, enable_fp_fusion=False
        )
        return
    cand = cand.long()
    real = cand >= 0
    idx = torch.where(real, cand, cand[:1].clamp(min=0))
    picked = v[idx] if b is None else torch.add(v[idx], b[idx])
    idx_out[:cap].copy_(idx)
    val_out[:cap].copy_(torch.where(real, picked, torch.zeros((), dtype=v.dtype, device=v.device)))


def select_above_torch(
    a: torch.Tensor,
    t: torch.Tensor,
    capacity: int,
    idx_out: torch.Tensor,
    val_out: torch.Tensor,
    count_out: torch.Tensor,
    stats_out: torch.Tensor,
    *,
    strict: bool = False,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """:func:`select_above` in torch operations (``scratch`` unused)."""
    check_addend(a, b)
    _check_select(a, t, capacity, idx_out, val_out, count_out, stats_out, v_out)
    n = a.numel()
    v = (torch.add(a, b) if b is not None else a).view(-1)
    stats = stats_vector(v)
    stats_out[:4].copy_(stats)
    if v_out is not None:
        v_out.view(-1)[:n].copy_(v)
    if n == 0:
        count_out.zero_()
        return
    keys = v.float().abs()
    top = stats[1].float()
    tt = torch.minimum(t.reshape(()).float(), top)
    mask = keys > tt if strict else keys >= tt
    if strict:
        mask = mask | (keys >= top)
    pool = torch.nonzero_static(mask, size=min(n, 2 * capacity), fill_value=-1).view(-1)
    cand = pool if pool.numel() <= capacity else largest_of(v, None, pool, capacity)
    count_out.view(-1)[:1].copy_((cand >= 0).sum().reshape(1))
    fill_slots(cand, v, None, idx_out, val_out)


def _f32(x: float) -> float:
    """``x`` rounded to float32 (how torch takes an integer scalar into a float32 product)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def sampled_threshold(
    a: torch.Tensor,
    k: int,
    sample: float,
    words: torch.Tensor,
    t_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    keys_out: torch.Tensor | None = None,
) -> None:
    """:func:`gradsync.codecs.selection_on_device.sampled_threshold` of ``v = a (+ b)``: the
    order statistic of :func:`gradsync.codecs.ops.dgc_sample` among its ``s`` magnitudes at
    the hashed positions keyed by ``words`` (int64 device tensor ``[w1, w2]``: the two words
    the reference draws from its generator). Writes ``t_out`` (one float32 element).

    The gather of the ``s`` keys (with the add) is one kernel into ``keys_out`` (float32, ``s``
    elements; allocated when None); the order statistic over them is a ``torch.topk``. Equal to
    the reference bit for bit.
    """
    check_addend(a, b)
    n, dev = a.numel(), a.device
    if n == 0:
        raise ValueError("sampled_threshold needs a non-empty tensor")
    check_words(words, dev)
    check_out("t_out", t_out, 1, (torch.float32,), dev)
    s, rank = dgc_sample(n, k, sample)
    if keys_out is None:
        keys_out = torch.empty(s, dtype=torch.float32, device=dev)
    check_out("keys_out", keys_out, s, (torch.float32,), dev)
    keys = keys_out[:s]
    if use_kernels(a):
        module("threshold").sample_kernel[(cdiv(s, _SLOTS_BLOCK),)](
            a,
            b if b is not None else a,
            words,
            keys,
            n,
            _f32(n),
            s,
            HAS_B=b is not None,
            BLOCK=_SLOTS_BLOCK,
            num_warps=4,
            enable_fp_fusion=False,
        )
    else:
        w1: Any = words[0]  # (0-dim device tensors: the hash takes them as it takes ints)
        w2: Any = words[1]
        pos = (hashed_uniform(s, w1, w2, dev) * n).long().clamp(max=n - 1)
        picked = a.view(-1)[pos] if b is None else torch.add(a.view(-1)[pos], b.view(-1)[pos])
        keys.copy_(picked.float().abs().nan_to_num(nan=-math.inf))
    t_out.view(-1)[:1].copy_(keys.topk(rank, sorted=False).values.min().reshape(1))
