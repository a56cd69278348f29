"""What LARS and LAMB share: layers batched by dtype, trust ratios in float32, the PTO option.

A *layer* is one parameter tensor (the MSTopK paper counts ResNet-50's 161 tensors as its 161
layers). Each step:

1. the parameters with a gradient are batched per param group, device and dtype (a handful of
   batches, not one per parameter);
2. the subclass computes each batch's update direction in the *work dtype*: float32 for bf16 and
   fp16 parameters, the parameter's own dtype otherwise, so a 16-bit model's step is computed in
   float32 and rounded once when written back (its optimizer state is float32 too, and two
   float32 work buffers per 16-bit parameter, for its values and its gradient, are kept from
   step to step: a fresh allocation per step costs page faults on the CPU);
3. the trust ratio of every adapted layer is computed from two norms per layer
   (:mod:`gradsync.optim.norms`), on this rank alone or split over the ranks by the parallel
   tensor operator (:mod:`gradsync.optim.parallel`);
4. the subclass applies the direction scaled by ``lr * trust ratio``.

A param group with ``adapt=False`` (biases and normalization parameters, from
:func:`gradsync.optim.groups.layerwise_param_groups`) gets trust ratio 1: plain momentum SGD
(LARS) or AdamW (LAMB) with its own weight decay.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsync.optim.norms import result_dtype, tensor_norms
from gradsync.optim.parallel import ParallelTensorOperator

LOW_PRECISION = (torch.float16, torch.bfloat16)

Parallel = bool | dist.ProcessGroup | ParallelTensorOperator | None


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a parameter's update and optimizer state are computed and kept in."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


@dataclass
class Batch:
    """The parameters of one param group, on one device, of one dtype, that have a gradient."""

    group: dict[str, Any]
    params: list[torch.Tensor]
    grads: list[torch.Tensor]
    offset: int  # position of its first layer among the step's adapted layers (-1: not adapted)
    workspace: Callable[[list[torch.Tensor], str, torch.dtype], list[torch.Tensor]]

    @property
    def low_precision(self) -> bool:
        return self.params[0].dtype in LOW_PRECISION

    def work_params(self) -> list[torch.Tensor]:
        """The parameters in the work dtype: the parameters themselves, or float32 copies (into
        buffers kept across steps: a fresh allocation per step costs page faults on the CPU)."""
        if not self.low_precision:
            return list(self.params)
        work = self.workspace(self.params, "param", torch.float32)
        torch._foreach_copy_(work, self.params)
        return work

    def work_grads(self) -> list[torch.Tensor]:
        """The gradients in the work dtype (float32 copies for 16-bit, else the gradients)."""
        if not self.low_precision:
            return list(self.grads)
        work = self.workspace(self.params, "grad", torch.float32)
        torch._foreach_copy_(work, self.grads)
        return work

    def write_back(self, work: list[torch.Tensor]) -> None:
        if self.low_precision:
            torch._foreach_copy_(self.params, work)


Rate = torch.Tensor | float
"""A batch's rate: one number (no trust ratio), or a 1-D tensor of one rate per layer."""


def per_layer(rate: Rate, scale: float = 1.0, offset: float = 0.0) -> list[torch.Tensor] | float:
    """``offset + scale * rate`` as :func:`add_scaled_` and ``torch._foreach_*`` take it: a
    number, or one 0-dim tensor per layer (computed in one vector operation on the device)."""
    if isinstance(rate, torch.Tensor):
        return list((rate * scale + offset).unbind())
    return offset + scale * rate


def add_scaled_(
    target: list[torch.Tensor],
    source: list[torch.Tensor],
    rate: list[torch.Tensor] | float,
    sign: float = 1.0,
) -> None:
    """``target += sign * rate * source`` in one pass; ``rate`` is one number, or one 0-dim tensor
    per tensor (kept on the device: no host synchronization)."""
    if isinstance(rate, float):
        torch._foreach_add_(target, source, alpha=sign * rate)
    else:
        torch._foreach_addcmul_(target, source, rate, value=sign)


def check_hyperparameter(
    name: str, value: object, low: float, high: float | None = None, *, low_open: bool = False
) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    bad_low = value <= low if low_open else value < low
    bad_high = high is not None and value >= high
    if bad_low or bad_high:
        bound = f"{'>' if low_open else '>='} {low}" + (f" and < {high}" if high is not None else "")
        raise ValueError(f"{name} must be {bound}, got {value!r}")


def parallel_operator(parallel: Parallel) -> ParallelTensorOperator | None:
    """``parallel`` as an operator: None/False local, True the world, a group, or an operator."""
    if parallel is None or parallel is False:
        return None
    if isinstance(parallel, ParallelTensorOperator):
        return parallel
    if parallel is True:
        return ParallelTensorOperator(None)
    if isinstance(parallel, dist.ProcessGroup):
        return ParallelTensorOperator(parallel)
    raise ValueError(
        f"parallel must be None, False, True (the world), a torch.distributed ProcessGroup or a "
        f"ParallelTensorOperator, got {parallel!r}"
    )


class LayerwiseOptimizer(torch.optim.Optimizer):
    """Base of :class:`~gradsync.optim.LARS` and :class:`~gradsync.optim.LAMB` (see the module)."""

    # state entries kept in float32 for 16-bit parameters (restored so by load_state_dict)
    _float32_state: tuple[str, ...] = ()

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], parallel: Parallel) -> None:
        check_hyperparameter("lr", defaults["lr"], 0.0)
        check_hyperparameter("weight_decay", defaults["weight_decay"], 0.0)
        check_hyperparameter("trust_coefficient", defaults["trust_coefficient"], 0.0, low_open=True)
        defaults.setdefault("adapt", True)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if not p.is_floating_point():
                    raise ValueError(f"params must be floating point tensors, got one of dtype {p.dtype}")
        self.pto = parallel_operator(parallel)
        """The parallel tensor operator that computes the trust ratios, or None (locally)."""
        self._workspace: dict[tuple[int, str], torch.Tensor] = {}

    def workspace(self, params: list[torch.Tensor], name: str, dtype: torch.dtype) -> list[torch.Tensor]:
        """One ``dtype`` buffer per parameter under ``name``, kept from step to step and out of
        the state dict (nothing in it outlives a step): on the CPU a fresh allocation per step
        costs page faults."""
        out = []
        for p in params:
            key = (id(p), name)
            buf = self._workspace.get(key)
            if buf is None or buf.shape != p.shape or buf.dtype != dtype or buf.device != p.device:
                buf = self._workspace[key] = torch.empty_like(p, dtype=dtype)
            out.append(buf)
        return out

    def set_parallel(self, parallel: Parallel) -> None:
        """Compute the trust ratios with ``parallel`` from the next step on (as the constructor's
        argument); the result does not change, only who computes which layer."""
        self.pto = parallel_operator(parallel)

    def adapted_layers(self) -> tuple[list[torch.Tensor], list[dict[str, Any]]]:
        """The layers that have a trust ratio, group by group, in the dtype their norms are taken
        in (float32 copies of 16-bit ones), with their groups: what :meth:`trust_ratios` takes."""
        ws: list[torch.Tensor] = []
        groups: list[dict[str, Any]] = []
        for group in self.param_groups:
            if group["adapt"]:
                ws += [p.detach().to(work_dtype(p.dtype)) for p in group["params"]]
                groups += [group] * len(group["params"])
        return ws, groups

    # ------------------------------------------------------------------ subclass interface
    def _direction(self, batch: Batch, work: list[torch.Tensor]) -> list[torch.Tensor]:
        """The batch's update direction in the work dtype (the gradients themselves, or the
        optimizer's workspace: never written into by :meth:`_apply`), state updated."""
        raise NotImplementedError

    def _norm_inputs(
        self, batch: Batch, work: list[torch.Tensor], direction: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The two tensors per layer whose norms give its trust ratio."""
        raise NotImplementedError

    def _trust(
        self, w_norm: torch.Tensor, x_norm: torch.Tensor, groups: list[dict[str, Any]]
    ) -> torch.Tensor:
        """Trust ratios from the norms of each layer (its group's hyper-parameters in ``groups``)."""
        raise NotImplementedError

    def _apply(
        self, batch: Batch, work: list[torch.Tensor], direction: list[torch.Tensor],
        rate: Rate,
    ) -> None:  # fmt: skip
        """Move ``work`` by ``direction`` scaled by ``rate`` (per layer: lr x trust ratio)."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the step
    def _batches(self) -> list[Batch]:
        batches: list[Batch] = []
        adapted = 0
        for group in self.param_groups:
            keyed: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
                keyed.setdefault((p.device, p.dtype), []).append(p)
            for params in keyed.values():
                offset = adapted if group["adapt"] else -1
                if group["adapt"]:
                    adapted += len(params)
                grads = [p.grad for p in params if p.grad is not None]
                batches.append(Batch(group, params, grads, offset, self.workspace))
        return batches

    @torch.no_grad()
    def trust_ratios(
        self, ws: Sequence[torch.Tensor], xs: Sequence[torch.Tensor], groups: Sequence[dict[str, Any]]
    ) -> torch.Tensor:
        """Every adapted layer's trust ratio: here, or each rank its share (PTO)."""
        if not ws:
            return torch.zeros(0)

        def compute(share: range) -> torch.Tensor:
            w_norm = tensor_norms(ws[share.start : share.stop], device=ws[0].device)
            x_norm = tensor_norms(xs[share.start : share.stop], device=ws[0].device)
            return self._trust(w_norm, x_norm, list(groups[share.start : share.stop]))

        if self.pto is None:
            return compute(range(len(ws)))
        dtype = result_dtype(ws)
        return self.pto.map([w.numel() for w in ws], compute, dtype, ws[0].device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        batches = self._batches()
        works = [b.work_params() for b in batches]
        directions = [self._direction(b, w) for b, w in zip(batches, works, strict=True)]
        ws: list[torch.Tensor] = []
        xs: list[torch.Tensor] = []
        groups: list[dict[str, Any]] = []
        for b, w, d in zip(batches, works, directions, strict=True):
            if b.offset >= 0:
                a, x = self._norm_inputs(b, w, d)
                ws += a
                xs += x
                groups += [b.group] * len(a)
        ratios = self.trust_ratios(ws, xs, groups)
        for b, w, d in zip(batches, works, directions, strict=True):
            lr = float(b.group["lr"])
            rate: Rate = lr
            if b.offset >= 0:
                rate = (ratios[b.offset : b.offset + len(b.params)] * lr).to(work_dtype(b.params[0].dtype))
            self._apply(b, w, d, rate)
            b.write_back(w)
        return loss

    # ------------------------------------------------------------------ state
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, except that the float32 state of 16-bit parameters stays float32 (torch
        casts every floating state tensor to its parameter's dtype)."""
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params, strict=True):
            if p.dtype in LOW_PRECISION and i in saved:
                for key in self._float32_state:
                    if key in saved[i]:
                        self.state[p][key] = saved[i][key].to(device=p.device, dtype=torch.float32, copy=True)
