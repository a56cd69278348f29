"""Layer-wise adaptive optimizers for large-batch training: LARS and LAMB with float32 trust
ratios under mixed precision, the MSTopK paper's parallel tensor operator (PTO) across ranks, and
the param groups that leave biases and normalization out of weight decay and adaptation
(ImageNet-in-four-minutes paper). And the Adam family that owns its communication (1-bit Adam, 0/1
Adam, 1-bit LAMB): a dense warm-up, a frozen variance, then momentum exchanged compressed with error
feedback.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- ImageNet-in-four-minutes paper: Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
"""

from gradsync.optim.compressed_momentum import CompressedMomentumOptimizer
from gradsync.optim.groups import layerwise_param_groups
from gradsync.optim.lamb import LAMB
from gradsync.optim.lars import LARS
from gradsync.optim.norms import tensor_norms
from gradsync.optim.onebit_adam import OneBitAdam
from gradsync.optim.onebit_lamb import OneBitLamb
from gradsync.optim.parallel import ParallelTensorOperator, balanced_shares
from gradsync.optim.zeroone_adam import ZeroOneAdam

__all__ = [
    "LAMB",
    "LARS",
    "CompressedMomentumOptimizer",
    "OneBitAdam",
    "OneBitLamb",
    "ParallelTensorOperator",
    "ZeroOneAdam",
    "balanced_shares",
    "layerwise_param_groups",
    "tensor_norms",
]
