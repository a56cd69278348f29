"""Param groups for layer-wise optimizers: what gets weight decay and a trust ratio.

The ImageNet-in-four-minutes paper removes weight decay from biases and from batch normalization's
scale and shift (it raised ResNet-50 at 64K from 71.9 % to 76.2 % top-1), and LARS/LAMB
implementations leave the same parameters out of the layer-wise adaptation: their norms say little
about a useful step.

References:

- ImageNet-in-four-minutes paper: Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
"""

from __future__ import annotations

from typing import Any

from torch import nn

NORMALIZATION = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*d, SyncBatchNorm, InstanceNorm*d
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)


def is_excluded(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """A bias, a normalization layer's parameter, or any parameter of fewer than 2 dimensions
    (which covers the scales and shifts of normalization layers this list does not know)."""
    return name == "bias" or isinstance(module, NORMALIZATION) or param.dim() < 2


def layerwise_param_groups(model: nn.Module, weight_decay: float, **options: Any) -> list[dict[str, Any]]:
    """Two param groups of ``model``'s trainable parameters, in model order:

    - weights: ``weight_decay`` and ``adapt=True`` (a trust ratio per tensor);
    - biases and normalization parameters (:func:`is_excluded`): no weight decay, ``adapt=False``.

    ``options`` go into both groups (e.g. ``lr``). An empty group is left out. Shared parameters
    appear once. Optimizers without trust ratios (SGD, AdamW) ignore ``adapt``.
    """
    seen: set[int] = set()
    adapted: list[nn.Parameter] = []
    excluded: list[nn.Parameter] = []
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            (excluded if is_excluded(module, name, p) else adapted).append(p)
    groups = [
        {"params": adapted, "weight_decay": weight_decay, "adapt": True, **options},
        {"params": excluded, "weight_decay": 0.0, "adapt": False, **options},
    ]
    return [g for g in groups if g["params"]]
