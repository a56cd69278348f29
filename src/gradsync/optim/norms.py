"""Per-tensor L2 norms of many tensors in a few kernel calls, and the layer-wise trust ratios.

Norms are accumulated in float32 whatever the tensors' dtype (bf16 and fp16 included: the
ImageNet-in-four-minutes paper computes LARS in FP32 because a half-precision trust ratio leaves the
representable range), and in float64 for float64 tensors. :func:`tensor_norms` groups the tensors by
device and dtype and calls ``torch._foreach_norm`` once per group: no Python loop over tensors doing
arithmetic, and nothing read back to the host, so a GPU step never waits on the device here.

References:

- ImageNet-in-four-minutes paper: Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a norm or trust ratio of a ``dtype`` tensor is computed in."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def result_dtype(tensors: Sequence[torch.Tensor]) -> torch.dtype:
    """float64 if any tensor is float64, else float32: one vector holds every tensor's norm."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def tensor_norms(tensors: Sequence[torch.Tensor], device: torch.device | None = None) -> torch.Tensor:
    """The L2 norm of each tensor, in order, as one 1-D tensor on ``device`` (default: the first
    tensor's) in :func:`result_dtype`."""
    if not tensors:
        return torch.zeros(0, device=device)
    device = device if device is not None else tensors[0].device
    dtype = result_dtype(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)

    def norms(idx: list[int], of: torch.dtype) -> torch.Tensor:
        values = torch._foreach_norm([tensors[i] for i in idx], 2, dtype=accumulate_dtype(of))
        return torch.stack(values).to(device=device, dtype=dtype)

    if len(groups) == 1:
        ((_, of),) = groups
        return norms(list(range(len(tensors))), of)
    out = torch.empty(len(tensors), dtype=dtype, device=device)
    for (_, of), idx in groups.items():
        out[torch.tensor(idx).to(device, non_blocking=True)] = norms(idx, of)
    return out


def safe_ratio(numerator: torch.Tensor, denominator: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``numerator / denominator`` where ``valid``, else 1, without a division by zero anywhere
    (so no NaN or inf leaks into the other entries' gradients or values)."""
    one = torch.ones_like(numerator)
    return torch.where(valid, numerator / torch.where(valid, denominator, one), one)
