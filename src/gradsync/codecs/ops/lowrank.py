"""Low-rank helpers for PowerSGD: orthogonalization in float32."""

from __future__ import annotations

import torch


def orthogonalize_(m: torch.Tensor, eps: float = 1e-8, rel_eps: float = 1e-5) -> torch.Tensor:
    """Make the columns of a float32 matrix orthonormal in place (modified Gram-Schmidt).

    A column that is (numerically) a combination of the previous ones, i.e. whose norm after
    removing them is below ``rel_eps`` times its norm before, or below ``eps``, becomes zero
    instead of normalized rounding noise: a rank-deficient input (an all-zero gradient, a
    low-rank matrix under a larger rank) then gives zero columns, never NaN or garbage.
    Deterministic: the same input gives the same output on every rank.
    """
    if m.dtype != torch.float32:
        raise TypeError(f"orthogonalize_ works in float32, got {m.dtype}")
    cols = m.shape[1]
    before = torch.linalg.vector_norm(m, dim=0).tolist()
    for i in range(cols):
        col = m[:, i : i + 1]
        norm = float(torch.linalg.vector_norm(col))
        if norm <= max(eps, rel_eps * before[i]):
            col.zero_()
            continue
        col.div_(norm)
        if i + 1 < cols:
            rest = m[:, i + 1 :]
            rest.sub_(col @ (col.T @ rest))
    return m


def orthogonalize_on_device(m: torch.Tensor, eps: float = 1e-8, rel_eps: float = 1e-5) -> torch.Tensor:
    """:func:`orthogonalize_` with every decision taken on the device (a column's norm is never
    read by the host): a column below the bounds is multiplied by 0 instead of skipped."""
    if m.dtype != torch.float32:
        raise TypeError(f"orthogonalize_on_device works in float32, got {m.dtype}")
    cols = m.shape[1]
    before = torch.linalg.vector_norm(m, dim=0)
    for i in range(cols):
        col = m[:, i : i + 1]
        norm = torch.linalg.vector_norm(col)
        keep = norm > torch.clamp(rel_eps * before[i], min=eps)
        col.mul_(torch.where(keep, 1.0 / torch.where(keep, norm, 1.0), 0.0))
        if i + 1 < cols:
            rest = m[:, i + 1 :]
            rest.sub_(col @ (col.T @ rest))
    return m
