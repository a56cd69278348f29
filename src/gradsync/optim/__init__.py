"""Layer-wise adaptive optimizers for large-batch training: LARS and LAMB with float32 trust
ratios under mixed precision, paper 01's parallel tensor operator (PTO) across ranks, and the
param groups that leave biases and normalization out of weight decay and adaptation (paper 03)."""

from gradsync.optim.groups import layerwise_param_groups
from gradsync.optim.lamb import LAMB
from gradsync.optim.lars import LARS
from gradsync.optim.norms import tensor_norms
from gradsync.optim.parallel import ParallelTensorOperator, balanced_shares

__all__ = [
    "LAMB",
    "LARS",
    "ParallelTensorOperator",
    "balanced_shares",
    "layerwise_param_groups",
    "tensor_norms",
]
