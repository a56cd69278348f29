"""What one worker computes in a step, as the simulator replays it: read from a profile.

A :class:`Workload` holds, per parameter, its size, shape, dtype and the median offset from the
start of the backward pass at which its gradient became ready (``gradsync profile``, docs/profile.md), and
the medians of the step's phases (data, forward, backward, optimizer). All times are seconds of
one worker computing alone on the profiled device.

Profiled on another device than the one being asked about, the times are scaled by
``compute_scale``: the target's time for the same work over the profiled device's (0.05: the
target computes 20 times faster). :meth:`Workload.scaled_to_step` derives that ratio from a step
time measured or published for the target (data + forward + backward + optimizer).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gradsync.observe.profile_format import Profile


@dataclass(frozen=True)
class Tensor:
    """One parameter: ``ready`` is None when it never got a gradient (it is never synchronized).
    ``shape``: the parameter's shape (what a per-tensor codec such as PowerSGD sees); None where
    it is not known (a synthetic workload), taken as a vector of ``numel``."""

    name: str
    numel: int
    itemsize: int
    floating: bool
    ready: float | None
    shape: tuple[int, ...] | None = None

    @property
    def dims(self) -> tuple[int, ...]:
        """The shape, or ``(numel,)`` where it is not known."""
        return self.shape if self.shape is not None else (self.numel,)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class Workload:
    model: str
    batch_size: int | None
    tensors: tuple[Tensor, ...]
    data: float
    forward: float
    backward: float
    optimizer: float
    device: str
    compute_scale: float = 1.0

    @classmethod
    def from_profile(cls, profile: Profile) -> Workload:
        tensors = []
        for p in profile.parameters:
            if not p.requires_grad:
                continue
            dtype = p.dtype
            tensors.append(
                Tensor(
                    p.name, p.numel, p.bytes // max(p.numel, 1) if p.numel else 4,
                    dtype.startswith(("float", "bfloat")), p.ready.median if p.ready else None,
                    tuple(p.shape),
                )
            )  # fmt: skip
        ph = profile.phases
        data = ph["data"].median if profile.data_measured else 0.0
        backward = max(ph["backward"].median, max((t.ready or 0.0 for t in tensors), default=0.0))
        return cls(
            profile.model, profile.batch_size, tuple(tensors), data, ph["forward"].median, backward,
            ph["optimizer"].median, f"{profile.device.type} {profile.device.name}",
        )  # fmt: skip

    @property
    def step(self) -> float:
        """One worker's step alone: T_1 of the scaling factor."""
        return self.data + self.forward + self.backward + self.optimizer

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors if t.ready is not None)

    def scaled(self, ratio: float) -> Workload:
        """Every compute time times ``ratio`` (the target device's time over the profiled one's)."""
        if not (math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"--compute-scale must be a positive number, got {ratio!r}")
        tensors = tuple(replace(t, ready=None if t.ready is None else t.ready * ratio) for t in self.tensors)
        return replace(
            self, tensors=tensors, data=self.data * ratio, forward=self.forward * ratio,
            backward=self.backward * ratio, optimizer=self.optimizer * ratio,
            compute_scale=self.compute_scale * ratio,
        )  # fmt: skip

    def scaled_to_step(self, step_s: float) -> Workload:
        """Scaled so that one worker's step takes ``step_s`` seconds."""
        if not (math.isfinite(step_s) and step_s > 0):
            raise ValueError(f"--step-time must be a positive duration, got {step_s!r}")
        return self.scaled(step_s / self.step)

    def ready_order(self) -> list[int]:
        """Indices of the tensors with a gradient, by ready time (ties: later registered first,
        the order backward visits them)."""
        have = [i for i, t in enumerate(self.tensors) if t.ready is not None]
        return sorted(have, key=lambda i: (self.tensors[i].ready, -i))
