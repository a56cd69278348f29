"""Low-rank helpers for PowerSGD: orthogonalization in float32."""

from __future__ import annotations

import torch


def orthogonalize_(m: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Make the columns of a float32 matrix orthonormal in place (modified Gram-Schmidt).

    A zero column stays zero (divided by ``eps`` rather than by 0), so an all-zero gradient
    never produces NaN. Deterministic: the same input gives the same output on every rank.
    """
    if m.dtype != torch.float32:
        raise TypeError(f"orthogonalize_ works in float32, got {m.dtype}")
    cols = m.shape[1]
    for i in range(cols):
        col = m[:, i : i + 1]
        col.div_(torch.linalg.vector_norm(col).clamp_min(eps))
        if i + 1 < cols:
            rest = m[:, i + 1 :]
            rest.sub_(col @ (col.T @ rest))
    return m
