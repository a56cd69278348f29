"""The profile document: what :func:`gradsync.observe.profiler.profile_step` measured.

A profile is written as versioned JSON (:data:`PROFILE_FORMAT`, ``docs/profile.md`` describes
every field); :meth:`Profile.from_json` refuses another version and missing or malformed fields,
so the what-if simulator that replays it can trust what it reads.

:class:`Profile` holds, per phase and per parameter, a :class:`Spread` of the measured steps,
the :class:`DeviceInfo` of where it ran and, when measured, the :class:`Overhead` of measuring.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync.observe.profile_fields import (
    is_int,
    itemsize_of,
    no_extra_keys,
    read_boolean,
    read_count,
    read_field,
    read_mapping,
    read_number,
    read_string,
)
from gradsync.version import VERSION

PROFILE_FORMAT = "gradsync.profile/1"

PHASES: tuple[str, ...] = ("data", "forward", "backward", "optimizer", "step")

# How the step got its inputs: one batch given once (no data time), a loss function that makes
# its own inputs (no data time), or an iterable of batches drawn every step (data time measured).
DATA_SOURCES: tuple[str, ...] = ("batch", "loss_fn", "loader")


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
        d = read_mapping(d, where)
        values = {
            k: read_number(read_field(d, k, where), f"{where}.{k}")
            for k in ("median", "p10", "p90", "min", "max")
        }
        no_extra_keys(d, values, where)
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
        d = read_mapping(d, where)
        shape = read_field(d, "shape", where)
        if not isinstance(shape, list) or not all(is_int(s) and s >= 0 for s in shape):
            raise ValueError(
                f"profile field {where + '.shape'!r}: expected a list of sizes >= 0, got {shape!r}"
            )
        ready = read_field(d, "ready", where)
        rank = read_field(d, "backward_rank", where)
        if rank is not None and not is_int(rank):
            raise ValueError(f"profile field {where + '.backward_rank'!r}: expected an integer or null")
        out = cls(
            name=read_string(read_field(d, "name", where), f"{where}.name"),
            shape=tuple(shape),
            numel=read_count(read_field(d, "numel", where), f"{where}.numel"),
            dtype=read_string(read_field(d, "dtype", where), f"{where}.dtype"),
            bytes=read_count(read_field(d, "bytes", where), f"{where}.bytes"),
            requires_grad=read_boolean(read_field(d, "requires_grad", where), f"{where}.requires_grad"),
            ready=None if ready is None else Spread.from_dict(ready, f"{where}.ready"),
            ready_steps=read_count(read_field(d, "ready_steps", where), f"{where}.ready_steps"),
            backward_rank=rank,
        )
        no_extra_keys(d, cls.__dataclass_fields__, where)
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
    gradsync_version: str = VERSION
    torch_version: str = torch.__version__
    created: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    powersgd_hook: dict[int, float] = field(default_factory=dict)
    """PyTorch's PowerSGD hook's own work on this model and device, seconds per gradient byte, by
    matrix-approximation rank (``gradsync profile --powersgd-hook-ranks``); the simulator charges
    it to ``ddp-powersgd:rank=R``. Optional in the document (older profiles have none)."""

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
            "powersgd_hook_s_per_byte": {str(r): v for r, v in sorted(self.powersgd_hook.items())},
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
        d = read_mapping(d, "profile")
        fmt = read_field(d, "format", "")
        if fmt != PROFILE_FORMAT:
            raise ValueError(
                f"profile field 'format': expected {PROFILE_FORMAT!r}, got {fmt!r} "
                "(a profile written by another gradsync version; re-run gradsync profile)"
            )
        dev = read_mapping(read_field(d, "device", ""), "device")
        device = DeviceInfo(
            type=read_string(read_field(dev, "type", "device"), "device.type"),
            name=read_string(read_field(dev, "name", "device"), "device.name"),
            threads=read_count(read_field(dev, "threads", "device"), "device.threads"),
        )
        no_extra_keys(dev, DeviceInfo.__dataclass_fields__, "device")
        phases_raw = read_mapping(read_field(d, "phases", ""), "phases")
        phases = {k: Spread.from_dict(read_field(phases_raw, k, "phases"), f"phases.{k}") for k in PHASES}
        no_extra_keys(phases_raw, phases, "phases")
        params_raw = read_field(d, "parameters", "")
        if not isinstance(params_raw, list):
            raise ValueError("profile field 'parameters': expected a list")
        params = [ParamProfile.from_dict(p, f"parameters[{i}]") for i, p in enumerate(params_raw)]
        order = read_field(d, "backward_order", "")
        if not isinstance(order, list) or not all(is_int(i) for i in order):
            raise ValueError("profile field 'backward_order': expected a list of parameter indices")
        over_raw = read_field(d, "overhead", "")
        overhead = None
        if over_raw is not None:
            o = read_mapping(over_raw, "overhead")
            overhead = Overhead(
                rounds=read_count(read_field(o, "rounds", "overhead"), "overhead.rounds"),
                profiled_step=Spread.from_dict(
                    read_field(o, "profiled_step", "overhead"), "overhead.profiled_step"
                ),
                unprofiled_step=Spread.from_dict(
                    read_field(o, "unprofiled_step", "overhead"), "overhead.unprofiled_step"
                ),
                ratio=Spread.from_dict(read_field(o, "ratio", "overhead"), "overhead.ratio"),
            )
            no_extra_keys(o, Overhead.__dataclass_fields__, "overhead")
        batch_size = read_field(d, "batch_size", "")
        if batch_size is not None:
            batch_size = read_count(batch_size, "batch_size")
        dtypes = read_field(d, "dtypes", "")
        if not isinstance(dtypes, list) or not all(isinstance(t, str) for t in dtypes):
            raise ValueError("profile field 'dtypes': expected a list of dtype names")
        meta = read_mapping(read_field(d, "meta", ""), "meta")
        unit = read_field(d, "unit", "")
        if unit != "seconds":
            raise ValueError(f"profile field 'unit': expected 'seconds', got {unit!r}")
        profile = cls(
            model=read_string(read_field(d, "model", ""), "model"),
            batch_size=batch_size,
            dtypes=list(dtypes),
            steps=read_count(read_field(d, "steps", ""), "steps"),
            warmup=read_count(read_field(d, "warmup", ""), "warmup"),
            data_source=read_string(read_field(d, "data_source", ""), "data_source"),
            phases=phases,
            parameters=params,
            backward_order=list(order),
            order_stable_steps=read_count(read_field(d, "order_stable_steps", ""), "order_stable_steps"),
            device=device,
            overhead=overhead,
            format=fmt,
            gradsync_version=read_string(read_field(d, "gradsync_version", ""), "gradsync_version"),
            torch_version=read_string(read_field(d, "torch_version", ""), "torch_version"),
            created=read_string(read_field(d, "created", ""), "created"),
            meta=dict(meta),
            powersgd_hook=_hook_rates(d.get("powersgd_hook_s_per_byte", {})),
        )
        measured = read_boolean(read_field(d, "data_measured", ""), "data_measured")
        if measured != profile.data_measured:
            raise ValueError(
                f"profile field 'data_measured': {measured} contradicts data_source {profile.data_source!r}"
            )
        known = {f.name for f in dataclasses.fields(cls) if f.name != "powersgd_hook"}
        known |= {"data_measured", "unit", "powersgd_hook_s_per_byte"}
        no_extra_keys(d, known, "profile")
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
            size = itemsize_of(p.dtype, f"{where}.dtype")
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
            itemsize_of(t, "dtypes")
        for r, v in self.powersgd_hook.items():
            if not (isinstance(r, int) and r >= 1 and math.isfinite(v) and v >= 0):
                raise ValueError(
                    "profile field 'powersgd_hook_s_per_byte': expected ranks >= 1 mapped to "
                    f"non-negative seconds per byte, got {r!r}: {v!r}"
                )


def _hook_rates(raw: Any) -> dict[int, float]:
    """``powersgd_hook_s_per_byte``: ``{"1": seconds per byte, ...}`` (checked by ``validate``)."""
    rates = read_mapping(raw, "powersgd_hook_s_per_byte")
    out: dict[int, float] = {}
    for key, value in rates.items():
        if (
            not (isinstance(key, str) and key.isdigit())
            or isinstance(value, bool)
            or not isinstance(value, (int, float))
        ):
            raise ValueError(
                "profile field 'powersgd_hook_s_per_byte': expected {\"RANK\": seconds per byte}, "
                f"got {key!r}: {value!r}"
            )
        out[int(key)] = float(value)
    return out


__all__ = [
    "DATA_SOURCES",
    "PHASES",
    "PROFILE_FORMAT",
    "DeviceInfo",
    "Overhead",
    "ParamProfile",
    "Profile",
    "Spread",
]
