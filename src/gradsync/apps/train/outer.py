"""``gradsync train --outer H``: the model of a run under the DiLoCo-family outer loop.

Each node trains on its own: its ranks keep one copy, synchronized densely every step by
``gradsync.wrap`` over the node's own process group (:attr:`gradsync.OuterLoop.inner_group`:
``--scheme`` when it names a dense scheme, else a flat ring; with one rank per node nothing runs),
and :class:`gradsync.OuterLoop` averages the nodes every H steps. This class gives the trainer
what it asks of a wrapped model (forward, ``no_sync``, the synchronization state for checkpoints,
``close``)."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

import gradsync
from gradsync.outer import OuterLoop
from gradsync.sync import StepStats, SyncConfig


class NodeSync:
    """``net`` synchronized densely inside its node by ``gradsync.wrap`` with ``config`` (a dense
    scheme), and across nodes by ``outer``."""

    last_stats: StepStats | None = None
    """The engine's statistics of the last step (none here: the trainer counts the bytes itself)."""

    def __init__(self, net: nn.Module, outer: OuterLoop, config: SyncConfig, grad_scaler: Any | None) -> None:
        self.module = net
        self.outer = outer
        self.inner: gradsync.GradSync | None = None
        ranks = outer.topo.per_node
        if ranks > 1:
            assert outer.inner_group is not None
            self.inner = gradsync.wrap(net, config, grad_scaler=grad_scaler, process_group=outer.inner_group)
        grad_bytes = sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
        self.inner_bytes = int(2 * (ranks - 1) / ranks * grad_bytes) if ranks > 1 else 0
        """What a ring all-reduce sends per rank and step inside the node."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.inner if self.inner is not None else self.module)(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self.inner.no_sync() if self.inner is not None else contextlib.nullcontext()

    def sent_this_step(self) -> dict[str, int]:
        """Bytes this rank sent since the last call: the outer exchanges and the inner all-reduce."""
        sent = dict(self.outer.traffic.take())
        if self.inner_bytes:
            sent["intra"] = sent.get("intra", 0) + self.inner_bytes
        return sent

    def plan_table(self) -> str:
        return self.outer.describe()

    def sync_state_dict(self) -> dict[str, Any]:
        return {"outer": self.outer.state_dict()}

    def load_sync_state_dict(self, state: dict[str, Any]) -> None:
        self.outer.load_state_dict(state["outer"])

    def close(self) -> None:
        self.outer.close()
        if self.inner is not None:
            self.inner.close()


__all__ = ["NodeSync"]
