"""``gradsync train --pto auto``: the MSTopK paper's parallel tensor operator pays only where the
norm work it shares out outweighs one all-gather's start-up, which on a slow network can take
milliseconds. Before the first step every rank times the trust ratios of the model's own layers
computed alone, and a small all-gather on the operator's group; the cost model
(:meth:`~gradsync.collectives.cost.CostModel.parallel_tensor_op`) predicts the operator's time
from both, and the optimizer uses it where the prediction is below the local time.

Every timing is the slowest rank's, so every rank reaches the same decision.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from gradsync.collectives import Topology
from gradsync.collectives.cost import CostModel, measure_gather_start, time_slowest
from gradsync.optim import ParallelTensorOperator
from gradsync.optim.layerwise import LayerwiseOptimizer
from gradsync.optim.parallel import largest_share
from gradsync.planner.decide import DEFAULT_PARAMS


@dataclass(frozen=True)
class PtoChoice:
    local_s: float  # every trust ratio on one rank
    gather_s: float  # a small all-gather on the operator's group
    predicted_s: float  # the operator: the largest share's norms plus the all-gather
    layers: int
    elements: int

    @property
    def pays(self) -> bool:
        return self.predicted_s < self.local_s

    def summary(self) -> dict[str, Any]:
        return {
            "pto": "on" if self.pays else "off",
            "local_ms": round(self.local_s * 1e3, 4),
            "gather_ms": round(self.gather_s * 1e3, 4),
            "predicted_ms": round(self.predicted_s * 1e3, 4),
            "layers": self.layers,
            "elements": self.elements,
        }

    def line(self) -> str:
        return (
            f"--pto auto: {self.layers} layers ({self.elements:,} elements), trust ratios alone "
            f"{self.local_s * 1e3:.3f} ms, shared out {self.predicted_s * 1e3:.3f} ms predicted "
            f"(all-gather {self.gather_s * 1e3:.3f} ms): {'on' if self.pays else 'off'}"
        )


def choose_pto(
    optimizer: LayerwiseOptimizer, group: dist.ProcessGroup, topo: Topology, reps: int = 5
) -> PtoChoice:
    """Time, predict, and switch ``optimizer`` to the operator on ``group`` where it pays."""
    ws, groups = optimizer.adapted_layers()
    local = optimizer.pto
    optimizer.set_parallel(None)
    optimizer.trust_ratios(ws, ws, groups)  # warm-up (the weights stand in for the directions)
    local_s = time_slowest(topo, lambda: optimizer.trust_ratios(ws, ws, groups), reps)
    optimizer.set_parallel(local)
    gather_s = measure_gather_start(topo, group, reps)
    sizes = [w.numel() for w in ws]
    share, width = largest_share(sizes, topo.world)
    # the payload is a few bytes per rank: the default links' beta is as good as a calibrated one
    model = CostModel(replace(DEFAULT_PARAMS, gather_start=gather_s), topo.nodes, topo.per_node)
    predicted = model.parallel_tensor_op(local_s, share, width)
    choice = PtoChoice(local_s, gather_s, predicted, len(ws), sum(sizes))
    if choice.pays:
        optimizer.set_parallel(ParallelTensorOperator(group))
    return choice
