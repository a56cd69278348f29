"""Per-parameter gradient-ready times of one training step, measured in a single pass.

The network-bottleneck paper (§3.1) finds *when* each layer's gradient is computed by re-running the
backward pass once per layer. Here one ordinary training step gives all of it: every parameter gets
a ``register_post_accumulate_grad_hook`` that stamps the moment its gradient has been accumulated
into ``.grad``, the moment a synchronization engine could start sending it. On the CPU the stamp
is ``time.perf_counter()``; on CUDA the hook records a ``torch.cuda.Event`` on the current stream
and nothing waits for it until the step has ended, so the hooks never stall the device.

:func:`profile_step` runs ``warmup`` unmeasured steps and then ``steps`` measured ones and
returns a :class:`Profile`: per phase (data, forward, backward, optimizer, whole step) and per
parameter (ready offset from the start of the backward pass) the median and a spread over the
measured steps, the parameters' sizes and dtypes, and the order in which their gradients became
ready. With ``overhead=True`` (the default) every measured step is paired with a step of the same
model without hooks or events, the two run alternately, and the profile states the ratio of
their times: what the measuring itself cost.

The profile itself (the :class:`Profile` document, its JSON format and its checks) lives in
:mod:`gradsync.observe.profile_format`; its names are importable from here as well.

References:

- network-bottleneck paper: Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
"""

from __future__ import annotations

import platform
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import datetime, timezone
from typing import Any, cast

import torch
from torch import nn

from gradsync.observe.profile_fields import dtype_name
from gradsync.observe.profile_format import (
    PHASES,
    DeviceInfo,
    Overhead,
    ParamProfile,
    Profile,
    Spread,
)


class ProfileError(ValueError):
    """What was handed to :func:`profile_step` cannot be profiled (a batch without a target, a
    loss function that returns no scalar, a loader that yields nothing usable)."""


Batch = Sequence[torch.Tensor]
LossFn = Callable[[nn.Module], torch.Tensor]
BatchOrLossFn = Batch | LossFn | Iterable[Batch]


# --------------------------------------------------------------------------- measuring


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def device_info(device: torch.device) -> DeviceInfo:
    """What :class:`Profile` records about ``device``."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return DeviceInfo(type=device.type, name=name, threads=torch.get_num_threads())


def default_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension of ``out``: class logits (B, C) against labels (B,),
    or per-position logits (B, T, V) against token ids (B, T)."""
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))


def _is_batch(x: Any) -> bool:
    return isinstance(x, (tuple, list)) and len(x) > 0 and all(isinstance(t, torch.Tensor) for t in x)


def batch_to(batch: Batch, device: torch.device, dtype: torch.dtype | None) -> list[torch.Tensor]:
    """``batch`` on ``device``, its floating tensors in ``dtype`` (None: as they are)."""
    out = []
    for t in batch:
        t = t.to(device, non_blocking=False)
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        out.append(t)
    return out


class _Clock:
    """Stamps for one step: host ``perf_counter`` on the CPU, device events on CUDA (read after
    the step has been synchronized, never inside it)."""

    def __init__(self, device: torch.device, marks: int) -> None:
        self.cuda = device.type == "cuda"
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(marks)] if self.cuda else []
        self.times = [0.0] * marks

    def mark(self, i: int) -> None:
        if self.cuda:
            self.events[i].record()
        else:
            self.times[i] = time.perf_counter()

    def seconds(self, a: int, b: int) -> float:
        """Time from mark ``a`` to mark ``b``; on CUDA only after a synchronize."""
        if self.cuda:
            return float(self.events[a].elapsed_time(self.events[b])) / 1e3
        return self.times[b] - self.times[a]


# Phase marks of one profiled step.
_START, _DATA, _FORWARD, _BACKWARD, _OPTIMIZER = range(5)


class _Stepper:
    """Runs training steps of one model, profiled or not, and keeps the profiled measurements."""

    def __init__(
        self,
        model: nn.Module,
        source: BatchOrLossFn,
        optimizer: torch.optim.Optimizer,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: torch.device,
        dtype: torch.dtype | None,
    ) -> None:
        self.model, self.optimizer, self.loss, self.device, self.dtype = model, optimizer, loss, device, dtype
        self.loss_fn: LossFn | None = None
        self.batch: list[torch.Tensor] | None = None
        self.loader: Iterable[Batch] | None = None
        self._it: Iterator[Batch] | None = None
        self.loader_batch_size: int | None = None  # the first drawn batch's, for the profile
        if _is_batch(source):
            batch = list(cast(Batch, source))
            if len(batch) < 2:
                raise ProfileError("a batch needs at least one input and a target (the last tensor)")
            self.batch = batch_to(batch, device, dtype)  # moved once: no data time
            self.data_source = "batch"
        elif callable(source):
            self.loss_fn = source
            self.data_source = "loss_fn"
        elif isinstance(source, Iterable):
            self.loader = cast(Iterable[Batch], source)
            self.data_source = "loader"
        else:
            raise ProfileError(
                "batch_or_loss_fn must be a tuple of tensors (inputs..., target), a callable "
                f"loss_fn(model) -> loss, or an iterable of such batches; got {type(source).__name__}"
            )
        self.params = list(model.named_parameters())
        self.hooked = [i for i, (_, p) in enumerate(self.params) if p.requires_grad]
        self.cuda = device.type == "cuda"
        self.clock = _Clock(device, 5)
        self.hook_events = [torch.cuda.Event(enable_timing=True) for _ in self.params] if self.cuda else []
        self.hook_times = [0.0] * len(self.params)
        self.fired: list[int] = []
        # measurements of the profiled steps
        self.phase_samples: dict[str, list[float]] = {k: [] for k in PHASES}
        self.ready_samples: list[list[float]] = [[] for _ in self.params]
        self.orders: list[tuple[int, ...]] = []

    # the hooks: as little as possible happens inside them
    def _hook(self, i: int) -> Callable[[torch.Tensor], None]:
        fired = self.fired
        if self.cuda:
            event = self.hook_events[i]

            def on_cuda(_: torch.Tensor) -> None:
                event.record()
                fired.append(i)

            return on_cuda
        times = self.hook_times
        clock = time.perf_counter

        def on_cpu(_: torch.Tensor) -> None:
            times[i] = clock()
            fired.append(i)

        return on_cpu

    def _next_batch(self) -> list[torch.Tensor]:
        assert self.loader is not None
        if self._it is None:
            self._it = iter(self.loader)
        try:
            batch = next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            try:
                batch = next(self._it)
            except StopIteration:
                raise ProfileError("the data loader yields no batches") from None
        if not _is_batch(batch) or len(batch) < 2:
            raise ProfileError(
                "the data loader must yield tuples of tensors (inputs..., target), got "
                f"{type(batch).__name__}"
            )
        if self.loader_batch_size is None and batch[0].dim() > 0:
            self.loader_batch_size = int(batch[0].shape[0])
        return batch_to(batch, self.device, self.dtype)

    def _forward(self, batch: list[torch.Tensor] | None) -> torch.Tensor:
        if self.loss_fn is not None:
            loss = self.loss_fn(self.model)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise ProfileError(
                    f"loss_fn(model) must return a one-element loss tensor, got {type(loss).__name__}"
                    + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
                )
            return loss
        assert batch is not None
        return self.loss(self.model(*batch[:-1]), batch[-1])

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def plain(self) -> float:
        """One step without hooks or phase marks; its wall-clock seconds."""
        self._sync()
        t0 = time.perf_counter()
        batch = self._next_batch() if self.loader is not None else self.batch
        loss = self._forward(batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._sync()
        return time.perf_counter() - t0

    def profiled(self, record: bool) -> float:
        """One step with hooks and phase marks; its wall-clock seconds. ``record`` keeps the
        measurements (a warm-up step's are dropped)."""
        handles = [self.params[i][1].register_post_accumulate_grad_hook(self._hook(i)) for i in self.hooked]
        self.fired.clear()
        clock = self.clock
        try:
            self._sync()
            t0 = time.perf_counter()
            clock.mark(_START)
            batch = self._next_batch() if self.loader is not None else self.batch
            clock.mark(_DATA)
            loss = self._forward(batch)
            clock.mark(_FORWARD)  # also the origin of the ready offsets
            loss.backward()
            clock.mark(_BACKWARD)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            clock.mark(_OPTIMIZER)
            self._sync()
            wall = time.perf_counter() - t0
        finally:
            for h in handles:
                h.remove()
        if record:
            data = clock.seconds(_START, _DATA) if self.loader is not None else 0.0
            self.phase_samples["data"].append(data)
            self.phase_samples["forward"].append(clock.seconds(_DATA, _FORWARD))
            self.phase_samples["backward"].append(clock.seconds(_FORWARD, _BACKWARD))
            self.phase_samples["optimizer"].append(clock.seconds(_BACKWARD, _OPTIMIZER))
            self.phase_samples["step"].append(wall)
            origin = clock.times[_FORWARD]  # on the CPU, where the hooks' perf_counter stamps start
            for i in self.fired:
                if self.cuda:
                    offset = float(clock.events[_FORWARD].elapsed_time(self.hook_events[i])) / 1e3
                else:
                    offset = self.hook_times[i] - origin
                self.ready_samples[i].append(max(offset, 0.0))
            self.orders.append(tuple(self.fired))
        return wall


def _resolve_device(model: nn.Module, device: str | torch.device | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def profile_step(
    model: nn.Module,
    batch_or_loss_fn: BatchOrLossFn,
    optimizer: torch.optim.Optimizer | None = None,
    steps: int = 20,
    warmup: int = 5,
    device: str | torch.device | None = None,
    *,
    dtype: torch.dtype | None = None,
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = default_loss,
    overhead: bool = True,
    model_name: str | None = None,
    batch_size: int | None = None,
    meta: dict[str, Any] | None = None,
) -> Profile:
    """Measure ``model``'s training step; returns a validated :class:`Profile`.

    ``batch_or_loss_fn`` is one of:

    - a tuple (or list) of tensors ``(inputs..., target)``: each step computes
      ``loss(model(*inputs), target)`` (``loss`` defaults to cross-entropy over the last
      dimension); the batch is moved to ``device`` once, so the data phase is 0;
    - a callable ``loss_fn(model) -> loss tensor`` doing the whole forward pass with inputs it
      makes itself on the model's device (the data phase is 0);
    - an iterable of such tuples (a ``DataLoader``): a batch is drawn (and moved to ``device``)
      every step, starting over when it ends; that is the data phase.

    ``optimizer`` defaults to SGD (lr 0.01, momentum 0.9) over the model's parameters: the
    profile *trains* the model for ``warmup + steps`` steps (twice as many with ``overhead``).
    The optimizer phase includes ``zero_grad(set_to_none=True)``. ``device`` defaults to the
    model's; the model is moved there (and cast to ``dtype`` when given, with the batch's
    floating tensors). With ``overhead`` every step (warm-up included) is paired with an
    unprofiled one, alternating which runs first.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    dev = _resolve_device(model, device)
    model.to(dev)
    if dtype is not None:
        model.to(dtype)
    model.train()
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    stepper = _Stepper(model, batch_or_loss_fn, optimizer, loss, dev, dtype)
    if batch_size is None and stepper.batch is not None:
        batch_size = int(stepper.batch[0].shape[0]) if stepper.batch[0].dim() > 0 else None
    optimizer.zero_grad(set_to_none=True)

    plain: list[float] = []
    ratios: list[float] = []
    walls: list[float] = []
    for r in range(warmup + steps):
        record = r >= warmup
        if not overhead:
            stepper.profiled(record)
            continue
        if r % 2 == 0:  # alternate which goes first, so neither always follows the other
            a = stepper.profiled(record)
            b = stepper.plain()
        else:
            b = stepper.plain()
            a = stepper.profiled(record)
        if record:
            walls.append(a)
            plain.append(b)
            ratios.append(a / b if b > 0 else float("inf"))
    if batch_size is None and stepper.loader is not None:
        batch_size = stepper.loader_batch_size

    params: list[ParamProfile] = []
    ready = [Spread.of(s) if s else None for s in stepper.ready_samples]
    # firing position in the most frequent order, to break ties between equal median offsets
    modal = Counter(stepper.orders).most_common(1)[0][0] if stepper.orders else ()
    position = {i: k for k, i in enumerate(modal)}
    with_grad = [i for i, s in enumerate(ready) if s is not None]
    order = sorted(with_grad, key=lambda i: (ready[i].median, position.get(i, len(position)), i))  # type: ignore[union-attr]
    rank = {i: k for k, i in enumerate(order)}
    for i, (name, p) in enumerate(stepper.params):
        params.append(
            ParamProfile(
                name=name,
                shape=tuple(p.shape),
                numel=p.numel(),
                dtype=dtype_name(p.dtype),
                bytes=p.numel() * p.element_size(),
                requires_grad=p.requires_grad,
                ready=ready[i],
                ready_steps=len(stepper.ready_samples[i]),
                backward_rank=rank.get(i),
            )
        )
    over = None
    if overhead:
        over = Overhead(len(ratios), Spread.of(walls), Spread.of(plain), Spread.of(ratios))
    profile = Profile(
        model=model_name or type(model).__name__,
        batch_size=batch_size,
        dtypes=sorted({dtype_name(p.dtype) for _, p in stepper.params}),
        steps=steps,
        warmup=warmup,
        data_source=stepper.data_source,
        phases={k: Spread.of(v) for k, v in stepper.phase_samples.items()},
        parameters=params,
        backward_order=order,
        order_stable_steps=sum(1 for o in stepper.orders if list(o) == order),
        device=device_info(dev),
        overhead=over,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        meta=dict(meta or {}),
    )
    profile.validate()
    return profile


__all__ = [
    "ProfileError",
    "default_loss",
    "device_info",
    "profile_step",
]
