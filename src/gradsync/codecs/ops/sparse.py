"""Sparse add (the decode of every sparsifier) with bounds checks on received indices."""

from __future__ import annotations

import torch

from gradsync.codecs.ops import native


def sparse_add_(
    out: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, alpha: float = 1.0, *, on_device: bool = False
) -> torch.Tensor:
    """``out[idx[j]] += alpha * val[j]`` for a 1-D ``out``; duplicates accumulate.

    Indices come from peers, so each is checked against ``out.numel()`` first; an out-of-range
    index raises ``IndexError`` and leaves ``out`` unchanged. On a GPU (or with ``on_device``)
    the check runs on the device instead (``torch._assert_async``: the host does not wait for
    it; a bad index still fails loudly, as a ``RuntimeError`` or a device-side assertion).
    """
    if idx.numel() != val.numel():
        raise ValueError(f"idx and val must have the same length, got {idx.numel()} and {val.numel()}")
    n = out.numel()
    if idx.numel() == 0:
        return out
    if on_device or idx.device.type != "cpu":
        _assert_in_range(idx, n)
        v = val.to(out.dtype)
        return out.index_add_(0, idx.long(), v if alpha == 1.0 else v * alpha)
    if (
        native.usable(out, val)
        and idx.dtype == torch.int32
        and idx.is_contiguous()
        and idx.device.type == "cpu"
    ):
        lo, hi = torch.aminmax(idx)
        _check_range(int(lo), int(hi), n)
        native.ext().sparse_add(native.ptr(out), n, native.ptr(idx), native.ptr(val), idx.numel(), alpha)
        return out
    lo, hi = torch.aminmax(idx)
    _check_range(int(lo), int(hi), n)
    v = val.to(out.dtype)
    return out.index_add_(0, idx.long(), v if alpha == 1.0 else v * alpha)


def sparse_to_dense_(
    out: torch.Tensor, idx: torch.Tensor, val: torch.Tensor, *, on_device: bool = False
) -> torch.Tensor:
    """``out = 0`` except ``out[idx[j]] = val[j]`` (duplicates add up), with bounds checks.

    With strictly increasing int32 indices on the native path this is one streaming pass that
    writes zeros only between the indices.
    """
    if idx.numel() != val.numel():
        raise ValueError(f"idx and val must have the same length, got {idx.numel()} and {val.numel()}")
    if (
        not on_device
        and native.usable(out, val)
        and idx.dtype == torch.int32
        and idx.is_contiguous()
        and idx.device.type == "cpu"
    ):
        r = native.ext().sparse_to_dense(
            native.ptr(out), out.numel(), native.ptr(idx), native.ptr(val), idx.numel()
        )
        if r == 0:
            return out
        if r == 1:
            lo, hi = torch.aminmax(idx)
            _check_range(int(lo), int(hi), out.numel())
    out.zero_()
    return sparse_add_(out, idx, val, on_device=on_device)


def _assert_in_range(idx: torch.Tensor, n: int) -> None:
    torch._assert_async(
        ((idx >= 0) & (idx < n)).all(),
        f"a sparse index is outside a tensor of {n} elements (corrupt or mismatched payload)",
    )


def _check_range(lo: int, hi: int, n: int) -> None:
    if lo < 0 or hi >= n:
        bad = lo if lo < 0 else hi
        raise IndexError(
            f"sparse index {bad} is outside a tensor of {n} elements (corrupt or mismatched payload)"
        )


def gather(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]`` for in-range indices."""
    if native.usable(x) and idx.dtype == torch.int32 and idx.is_contiguous():
        val = torch.empty(idx.numel(), dtype=torch.float32)
        native.ext().gather(
            native.ptr(x), x.numel(), native.ptr(idx), idx.numel(), native.ptr(val), val.nbytes
        )
        return val
    return x[idx.long()]
