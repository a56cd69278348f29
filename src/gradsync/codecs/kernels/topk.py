"""Per-chunk top-k by magnitude in one pass over the data (SparseLoCo's and DeMo's selection,
:func:`gradsync.codecs.selection_on_device.chunked_topk`), with error feedback's add fused.

Each program of the kernel holds its chunks in registers, so the data are read once (twice
with the addend) and written at most twice (``v_out``, ``residual_out``). Within a chunk the
k-th largest magnitude is found exactly by bisection on the bit pattern of ``|v|`` (float32
patterns of non-negative values order as the values do; NaN counts as +inf, as the reference's
``nan_to_num(nan=inf)``), then the chunk is compacted with prefix sums. Where several elements
tie at the k-th magnitude the lowest positions are taken: ``torch.topk`` (the reference) leaves
the choice among ties unspecified, so with ties the two agree on the selected magnitudes, not
necessarily on the positions.
"""

from __future__ import annotations

import torch

from gradsync.codecs.kernels.launch import (
    cdiv,
    check_addend,
    check_out,
    module,
    next_pow2,
    use_kernels,
)

REGISTER_CHUNK = 8192
"""Chunks up to this size are held in registers (one read; compiled for sm_90 with at most a
few bytes of spill); larger ones take a looped kernel that re-reads the chunk once per
bisection step (correct, about 33 reads of it)."""

_ROW_ELEMENTS = 4096  # elements per program when several small chunks share one


def _check(a: torch.Tensor, chunk: int, per_chunk: int, of_tail: int) -> int:
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    n = a.numel()
    full, tail = divmod(n, chunk)
    if full and not 1 <= per_chunk <= chunk:
        raise ValueError(f"per_chunk must be in [1, chunk={chunk}], got {per_chunk}")
    if not 0 <= of_tail <= tail:
        raise ValueError(f"of_tail must be in [0, {tail}] (the last chunk's size), got {of_tail}")
    return full * per_chunk + of_tail


def chunked_topk(
    a: torch.Tensor,
    chunk: int,
    per_chunk: int,
    of_tail: int,
    idx_out: torch.Tensor,
    val_out: torch.Tensor,
    nonfinite_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> None:
    """The ``per_chunk`` largest ``|v|`` of every full ``chunk`` of ``v = a (+ b)`` and the
    ``of_tail`` largest of the shorter last chunk.

    Writes ``idx_out[:count]`` (int32, or int64: flat positions, increasing within each chunk,
    chunk after chunk, ``count = full * per_chunk + of_tail``), ``val_out[:count]`` (``v`` at
    those positions, a's dtype) and ``nonfinite_out[0]`` (int32 or int64: the number of inf/NaN
    elements of ``v``). With ``b``, ``v = torch.add(a, b)`` (same rounding); ``v_out`` receives
    ``v``; ``residual_out`` receives ``v`` with the selected elements set to 0 (error feedback's
    new residual ``v - sent``; equal to ``v.index_fill(0, idx, 0)``). ``v_out`` and
    ``residual_out`` may be ``a`` or ``b``: every element is read before it is written.

    No scratch, no allocation, no host read. Triton on CUDA (and on the CPU under the
    interpreter), for float32/float16/bfloat16; :func:`chunked_topk_torch` otherwise.
    """
    count = _check(a, chunk, per_chunk, of_tail)
    check_addend(a, b)
    _check_outputs(a, count, idx_out, val_out, nonfinite_out, v_out, residual_out)
    if not use_kernels(a):
        chunked_topk_torch(
            a,
            chunk,
            per_chunk,
            of_tail,
            idx_out,
            val_out,
            nonfinite_out,
            b=b,
            v_out=v_out,
            residual_out=residual_out,
        )
        return
    nonfinite_out.zero_()
    n = a.numel()
    if n == 0:
        return
    rows = cdiv(n, chunk)
    dummy = a
    args = (
        a,
        b if b is not None else dummy,
        v_out if v_out is not None else dummy,
        residual_out if residual_out is not None else dummy,
        idx_out,
        val_out,
        nonfinite_out,
        n,
        chunk,
        per_chunk,
        of_tail,
    )
    flags = {
        "HAS_B": b is not None,
        "WRITE_V": v_out is not None,
        "WRITE_RES": residual_out is not None,
        # (the looped kernel's later sweeps read v from v_out when it is written: it may alias
        # a or b; else a (+ b) again)
        "REREAD_B": b is not None and v_out is None,
    }
    kernels = module("topk")
    if chunk <= REGISTER_CHUNK:
        block = max(16, next_pow2(chunk))
        per_program = max(1, _ROW_ELEMENTS // block)
        warps = min(32, max(4, block * per_program // 256))  # 8 elements per thread
        kernels.chunk_topk_kernel[(cdiv(rows, per_program),)](
            *args, **flags, ROWS=per_program, BLOCK=block, num_warps=warps, enable_fp_fusion=False
        )
    else:
        kernels.chunk_topk_looped_kernel[(rows,)](
            *args,
            **flags,
            TILE=4096,
            num_warps=8,
            enable_fp_fusion=False,
        )


def _check_outputs(
    a: torch.Tensor,
    count: int,
    idx_out: torch.Tensor,
    val_out: torch.Tensor,
    nonfinite_out: torch.Tensor,
    v_out: torch.Tensor | None,
    residual_out: torch.Tensor | None,
) -> None:
    n, dev = a.numel(), a.device
    index_dtypes = (torch.int32, torch.int64) if n <= 2**31 - 1 else (torch.int64,)
    check_out("idx_out", idx_out, count, index_dtypes, dev)
    check_out("val_out", val_out, count, (a.dtype,), dev)
    check_out("nonfinite_out", nonfinite_out, 1, (torch.int32, torch.int64), dev)
    for name, t in (("v_out", v_out), ("residual_out", residual_out)):
        if t is not None:
            check_out(name, t, n, (a.dtype,), dev)


def chunked_topk_torch(
    a: torch.Tensor,
    chunk: int,
    per_chunk: int,
    of_tail: int,
    idx_out: torch.Tensor,
    val_out: torch.Tensor,
    nonfinite_out: torch.Tensor,
    *,
    b: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> None:
    """:func:`chunked_topk` in torch operations (the same outputs, ties included: the k-th
    magnitude from ``torch.topk``, then the lowest positions among those equal to it). Allocates
    temporaries; reads nothing back to the host."""
    count = _check(a, chunk, per_chunk, of_tail)
    check_addend(a, b)
    _check_outputs(a, count, idx_out, val_out, nonfinite_out, v_out, residual_out)
    n = a.numel()
    v = (torch.add(a, b) if b is not None else a).view(-1)
    raw = v.float().abs()
    nonfinite_out.view(-1)[:1].copy_((~torch.isfinite(raw)).sum().reshape(1))
    keys = raw.nan_to_num(nan=torch.inf)
    full = n // chunk
    sel = torch.zeros(n, dtype=torch.bool, device=a.device)
    if full:
        sel[: full * chunk] = _chunk_mask(keys[: full * chunk].view(full, chunk), per_chunk).view(-1)
    if of_tail:
        sel[full * chunk :] = _chunk_mask(keys[full * chunk :].view(1, -1), of_tail).view(-1)
    idx = torch.nonzero_static(sel, size=count).view(-1)
    idx_out[:count].copy_(idx)
    val_out[:count].copy_(v[idx])
    if v_out is not None:
        v_out.view(-1)[:n].copy_(v)
    if residual_out is not None:
        residual_out.view(-1)[:n].copy_(torch.where(sel, torch.zeros((), dtype=v.dtype, device=v.device), v))


def _chunk_mask(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Per row: the k largest keys, the lowest positions first among those equal to the k-th."""
    kth = rows.topk(k, dim=1, sorted=False).values.amin(dim=1, keepdim=True)
    above = rows > kth
    tie = rows == kth
    need = k - above.sum(dim=1, keepdim=True)
    return above | (tie & (tie.cumsum(dim=1) <= need))
