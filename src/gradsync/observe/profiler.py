"""Per-parameter gradient-ready times of one training step, measured in a single pass.

Paper 02 (§3.1) finds *when* each layer's gradient is computed by re-running the backward pass
once per layer. Here one ordinary training step gives all of it: every parameter gets a
``register_post_accumulate_grad_hook`` that stamps the moment its gradient has been accumulated
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

A profile is written as versioned JSON (:data:`PROFILE_FORMAT`, ``docs/profile.md`` describes
every field); :meth:`Profile.from_json` refuses another version and missing or malformed fields,
so the what-if simulator that replays it can trust what it reads.
"""

from __future__ import annotations

import dataclasses
import json
import math
import platform
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, cast

import torch
from torch import nn

import gradsync

PROFILE_FORMAT = "gradsync.profile/1"


class ProfileError(ValueError):
    """What was handed to :func:`profile_step` cannot be profiled (a batch without a target, a
    loss function that returns no scalar, a loader that yields nothing usable)."""


PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer", "step")

# How the step got its inputs: one batch given once (no data time), a loss function that makes
# its own inputs (no data time), or an iterable of batches drawn every step (data time measured).
DATA_SOURCES: tuple[str, ...] = ("batch", "loss_fn", "loader")

Batch = Sequence[torch.Tensor]
LossFn = Callable[[nn.Module], torch.Tensor]
BatchOrLossFn = Batch | LossFn | Iterable[Batch]


# --------------------------------------------------------------------------- the profile


def _percentile(ordered: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks of already sorted values (numpy's default)."""
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Spread:
    """A quantity measured once per step: its median and how far it strayed (same unit)."""

    median: float
    p10: float
    p90: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Spread:
        v = sorted(float(x) for x in values)
        if not v:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(v), _percentile(v, 0.1), _percentile(v, 0.9), v[0], v[-1])

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any, where: str) -> Spread:
        d = _mapping(d, where)
        values = {
            k: _number(_field(d, k, where), f"{where}.{k}") for k in ("median", "p10", "p90", "min", "max")
        }
        _no_extra(d, values, where)
        s = cls(**values)
        if not s.min <= s.p10 <= s.median <= s.p90 <= s.max:
            raise ValueError(f"profile field {where!r}: expected min <= p10 <= median <= p90 <= max, got {s}")
        return s


@dataclass(frozen=True)
class DeviceInfo:
    """Where the step ran: ``type`` (``cpu``, ``cuda``), a readable ``name`` (CPU model or GPU
    name) and the number of CPU threads torch used for intra-op parallelism."""

    type: str
    name: str
    threads: int


@dataclass(frozen=True)
class ParamProfile:
    """One parameter, in the model's registration order (``named_parameters()``).

    ``ready`` is the offset in seconds from the start of the backward pass to the moment its
    gradient was accumulated, over the ``ready_steps`` measured steps in which that happened;
    ``None`` (and ``backward_rank`` ``None``) when it never got a gradient (frozen or unused).
    ``bytes`` is ``numel`` times the dtype's size: what synchronizing its gradient moves densely.
    """

    name: str
    shape: tuple[int, ...]
    numel: int
    dtype: str
    bytes: int
    requires_grad: bool
    ready: Spread | None
    ready_steps: int
    backward_rank: int | None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "numel": self.numel,
            "dtype": self.dtype,
            "bytes": self.bytes,
            "requires_grad": self.requires_grad,
            "ready": self.ready.to_dict() if self.ready is not None else None,
            "ready_steps": self.ready_steps,
            "backward_rank": self.backward_rank,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str) -> ParamProfile:
        d = _mapping(d, where)
        shape = _field(d, "shape", where)
        if not isinstance(shape, list) or not all(_is_int(s) and s >= 0 for s in shape):
            raise ValueError(
                f"profile field {where + '.shape'!r}: expected a list of sizes >= 0, got {shape!r}"
            )
        ready = _field(d, "ready", where)
        rank = _field(d, "backward_rank", where)
        if rank is not None and not _is_int(rank):
            raise ValueError(f"profile field {where + '.backward_rank'!r}: expected an integer or null")
        out = cls(
            name=_string(_field(d, "name", where), f"{where}.name"),
            shape=tuple(shape),
            numel=_count(_field(d, "numel", where), f"{where}.numel"),
            dtype=_string(_field(d, "dtype", where), f"{where}.dtype"),
            bytes=_count(_field(d, "bytes", where), f"{where}.bytes"),
            requires_grad=_boolean(_field(d, "requires_grad", where), f"{where}.requires_grad"),
            ready=None if ready is None else Spread.from_dict(ready, f"{where}.ready"),
            ready_steps=_count(_field(d, "ready_steps", where), f"{where}.ready_steps"),
            backward_rank=rank,
        )
        _no_extra(d, cls.__dataclass_fields__, where)
        return out


@dataclass(frozen=True)
class Overhead:
    """The cost of measuring: ``rounds`` pairs of one profiled step (hooks and timers on) and one
    unprofiled step (none), run alternately on the same model; ``ratio`` spreads the per-round
    ratios profiled / unprofiled of the whole step's wall-clock time."""

    rounds: int
    profiled_step: Spread
    unprofiled_step: Spread
    ratio: Spread


@dataclass
class Profile:
    """A measured training step; :meth:`to_json` / :meth:`from_json` read and write the
    ``gradsync.profile/1`` document that ``docs/profile.md`` describes field by field."""

    model: str
    batch_size: int | None
    dtypes: list[str]
    steps: int
    warmup: int
    data_source: str
    phases: dict[str, Spread]
    parameters: list[ParamProfile]
    backward_order: list[int]
    order_stable_steps: int
    device: DeviceInfo
    overhead: Overhead | None = None
    format: str = PROFILE_FORMAT
    gradsync_version: str = gradsync.__version__
    torch_version: str = torch.__version__
    created: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def data_measured(self) -> bool:
        """Whether ``phases['data']`` was measured (an iterable of batches) or is 0 by construction."""
        return self.data_source == "loader"

    def total_bytes(self) -> int:
        """Bytes of every gradient the backward pass produced."""
        return sum(p.bytes for p in self.parameters if p.ready is not None)

    # ----------------------------------------------------------------- JSON
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "gradsync_version": self.gradsync_version,
            "torch_version": self.torch_version,
            "created": self.created,
            "device": dataclasses.asdict(self.device),
            "model": self.model,
            "batch_size": self.batch_size,
            "dtypes": list(self.dtypes),
            "steps": self.steps,
            "warmup": self.warmup,
            "data_source": self.data_source,
            "data_measured": self.data_measured,
            "unit": "seconds",
            "phases": {k: self.phases[k].to_dict() for k in PHASES},
            "parameters": [p.to_dict() for p in self.parameters],
            "backward_order": list(self.backward_order),
            "order_stable_steps": self.order_stable_steps,
            "overhead": None
            if self.overhead is None
            else {
                "rounds": self.overhead.rounds,
                "profiled_step": self.overhead.profiled_step.to_dict(),
                "unprofiled_step": self.overhead.unprofiled_step.to_dict(),
                "ratio": self.overhead.ratio.to_dict(),
            },
            "meta": dict(self.meta),
        }

    def to_json(self, indent: int | None = 1) -> str:
        self.validate()
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str) -> None:
        """Write the JSON document to ``path``."""
        text = self.to_json()
        with open(path, "w") as fh:
            fh.write(text + "\n")

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Parse and validate a profile; ``ValueError`` names the first field that is wrong."""
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a profile: invalid JSON ({e})") from e
        return cls.from_dict(d)

    @classmethod
    def load(cls, path: str) -> Profile:
        with open(path) as fh:
            return cls.from_json(fh.read())

    @classmethod
    def from_dict(cls, d: Any) -> Profile:
        d = _mapping(d, "profile")
        fmt = _field(d, "format", "")
        if fmt != PROFILE_FORMAT:
            raise ValueError(
                f"profile field 'format': expected {PROFILE_FORMAT!r}, got {fmt!r} "
                "(a profile written by another gradsync version; re-run gradsync profile)"
            )
        dev = _mapping(_field(d, "device", ""), "device")
        device = DeviceInfo(
            type=_string(_field(dev, "type", "device"), "device.type"),
            name=_string(_field(dev, "name", "device"), "device.name"),
            threads=_count(_field(dev, "threads", "device"), "device.threads"),
        )
        _no_extra(dev, DeviceInfo.__dataclass_fields__, "device")
        phases_raw = _mapping(_field(d, "phases", ""), "phases")
        phases = {k: Spread.from_dict(_field(phases_raw, k, "phases"), f"phases.{k}") for k in PHASES}
        _no_extra(phases_raw, phases, "phases")
        params_raw = _field(d, "parameters", "")
        if not isinstance(params_raw, list):
            raise ValueError("profile field 'parameters': expected a list")
        params = [ParamProfile.from_dict(p, f"parameters[{i}]") for i, p in enumerate(params_raw)]
        order = _field(d, "backward_order", "")
        if not isinstance(order, list) or not all(_is_int(i) for i in order):
            raise ValueError("profile field 'backward_order': expected a list of parameter indices")
        over_raw = _field(d, "overhead", "")
        overhead = None
        if over_raw is not None:
            o = _mapping(over_raw, "overhead")
            overhead = Overhead(
                rounds=_count(_field(o, "rounds", "overhead"), "overhead.rounds"),
                profiled_step=Spread.from_dict(
                    _field(o, "profiled_step", "overhead"), "overhead.profiled_step"
                ),
                unprofiled_step=Spread.from_dict(
                    _field(o, "unprofiled_step", "overhead"), "overhead.unprofiled_step"
                ),
                ratio=Spread.from_dict(_field(o, "ratio", "overhead"), "overhead.ratio"),
            )
            _no_extra(o, Overhead.__dataclass_fields__, "overhead")
        batch_size = _field(d, "batch_size", "")
        if batch_size is not None:
            batch_size = _count(batch_size, "batch_size")
        dtypes = _field(d, "dtypes", "")
        if not isinstance(dtypes, list) or not all(isinstance(t, str) for t in dtypes):
            raise ValueError("profile field 'dtypes': expected a list of dtype names")
        meta = _mapping(_field(d, "meta", ""), "meta")
        unit = _field(d, "unit", "")
        if unit != "seconds":
            raise ValueError(f"profile field 'unit': expected 'seconds', got {unit!r}")
        profile = cls(
            model=_string(_field(d, "model", ""), "model"),
            batch_size=batch_size,
            dtypes=list(dtypes),
            steps=_count(_field(d, "steps", ""), "steps"),
            warmup=_count(_field(d, "warmup", ""), "warmup"),
            data_source=_string(_field(d, "data_source", ""), "data_source"),
            phases=phases,
            parameters=params,
            backward_order=list(order),
            order_stable_steps=_count(_field(d, "order_stable_steps", ""), "order_stable_steps"),
            device=device,
            overhead=overhead,
            format=fmt,
            gradsync_version=_string(_field(d, "gradsync_version", ""), "gradsync_version"),
            torch_version=_string(_field(d, "torch_version", ""), "torch_version"),
            created=_string(_field(d, "created", ""), "created"),
            meta=dict(meta),
        )
        measured = _boolean(_field(d, "data_measured", ""), "data_measured")
        if measured != profile.data_measured:
            raise ValueError(
                f"profile field 'data_measured': {measured} contradicts data_source {profile.data_source!r}"
            )
        known = {f.name for f in dataclasses.fields(cls)} | {"data_measured", "unit"}
        _no_extra(d, known, "profile")
        profile.validate()
        return profile

    # ----------------------------------------------------------------- checks
    def validate(self) -> None:
        """Check the profile's internal consistency; ``ValueError`` names the offending field."""
        if self.format != PROFILE_FORMAT:
            raise ValueError(f"profile field 'format': expected {PROFILE_FORMAT!r}, got {self.format!r}")
        if self.data_source not in DATA_SOURCES:
            raise ValueError(
                f"profile field 'data_source': expected one of {', '.join(DATA_SOURCES)}, "
                f"got {self.data_source!r}"
            )
        if self.steps < 1:
            raise ValueError(f"profile field 'steps': expected >= 1, got {self.steps}")
        if set(self.phases) != set(PHASES):
            raise ValueError(f"profile field 'phases': expected exactly {', '.join(PHASES)}")
        for k, s in self.phases.items():
            if s.min < 0:
                raise ValueError(f"profile field 'phases.{k}': negative time {s.min}")
        if not self.data_measured and self.phases["data"].max != 0.0:
            raise ValueError("profile field 'phases.data': must be 0 when data_source is not 'loader'")
        names = set()
        for i, p in enumerate(self.parameters):
            where = f"parameters[{i}]"
            if p.name in names:
                raise ValueError(f"profile field '{where}.name': duplicate name {p.name!r}")
            names.add(p.name)
            if p.numel != math.prod(p.shape):
                raise ValueError(
                    f"profile field '{where}.numel': {p.numel} != product of shape {list(p.shape)}"
                )
            size = _itemsize(p.dtype, f"{where}.dtype")
            if p.bytes != p.numel * size:
                raise ValueError(
                    f"profile field '{where}.bytes': {p.bytes} != numel {p.numel} x {size} bytes of {p.dtype}"
                )
            if (p.ready is None) != (p.backward_rank is None) or (p.ready is None) != (p.ready_steps == 0):
                raise ValueError(
                    f"profile field '{where}.ready': ready, ready_steps and backward_rank must all be "
                    "set (a gradient was produced) or all be empty"
                )
            if p.ready is not None and p.ready.min < 0:
                raise ValueError(f"profile field '{where}.ready': negative offset {p.ready.min}")
            if p.ready_steps > self.steps:
                raise ValueError(f"profile field '{where}.ready_steps': more than steps ({self.steps})")
        with_grad = [i for i, p in enumerate(self.parameters) if p.ready is not None]
        if sorted(self.backward_order) != with_grad:
            raise ValueError(
                "profile field 'backward_order': must list each parameter that has a ready time exactly once"
            )
        for rank, i in enumerate(self.backward_order):
            if self.parameters[i].backward_rank != rank:
                raise ValueError(
                    f"profile field 'parameters[{i}].backward_rank': {self.parameters[i].backward_rank} "
                    f"but it is at position {rank} of backward_order"
                )
        ready = [self.parameters[i].ready for i in self.backward_order]
        for n in range(1, len(ready)):
            a, b, i = ready[n - 1], ready[n], self.backward_order[n]
            assert a is not None and b is not None  # backward_order holds parameters with ready times
            if b.median < a.median:
                raise ValueError(
                    f"profile field 'parameters[{i}].ready': median ready offsets must not decrease "
                    "along backward_order"
                )
        if not 0 <= self.order_stable_steps <= self.steps:
            raise ValueError(f"profile field 'order_stable_steps': expected 0..{self.steps}")
        if self.overhead is not None and self.overhead.rounds < 1:
            raise ValueError("profile field 'overhead.rounds': expected >= 1")
        for t in self.dtypes:
            _itemsize(t, "dtypes")


# --------------------------------------------------------------------------- JSON field helpers


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _mapping(d: Any, where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise ValueError(f"profile field {where!r}: expected an object, got {type(d).__name__}")
    return d


def _field(d: dict[str, Any], key: str, where: str) -> Any:
    name = f"{where}.{key}" if where else key
    if key not in d:
        raise ValueError(f"profile field {name!r} is missing")
    return d[key]


def _no_extra(d: dict[str, Any], known: Iterable[str], where: str) -> None:
    extra = sorted(set(d) - set(known))
    if extra:
        raise ValueError(
            f"profile field {where!r}: unknown field(s) {', '.join(extra)} (written by a newer format?)"
        )


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"profile field {where!r}: expected a finite number, got {v!r}")
    return float(v)


def _count(v: Any, where: str) -> int:
    if not _is_int(v) or v < 0:
        raise ValueError(f"profile field {where!r}: expected an integer >= 0, got {v!r}")
    return int(v)


def _string(v: Any, where: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"profile field {where!r}: expected a string, got {v!r}")
    return v


def _boolean(v: Any, where: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"profile field {where!r}: expected true or false, got {v!r}")
    return v


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``, the spelling profiles use."""
    return str(dtype).removeprefix("torch.")


def _itemsize(name: str, where: str) -> int:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"profile field {where!r}: unknown dtype {name!r}")
    return dtype.itemsize


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


def _to(batch: Batch, device: torch.device, dtype: torch.dtype | None) -> list[torch.Tensor]:
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
            self.batch = _to(batch, device, dtype)  # moved once: no data time
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
        return _to(batch, self.device, self.dtype)

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
    "DATA_SOURCES",
    "PHASES",
    "PROFILE_FORMAT",
    "DeviceInfo",
    "Overhead",
    "ParamProfile",
    "Profile",
    "ProfileError",
    "Spread",
    "default_loss",
    "device_info",
    "dtype_name",
    "profile_step",
]
