"""Typed codec configuration and the compact spec-string syntax.

A spec names a codec and its options, then optional wrappers, each with their own options::

    topk:density=0.01
    terngrad:bits=4,seed=3
    dgc:density=0.001+ef:momentum=0.9,nesterov=true

Options are the fields of the codec's config dataclass. Values are coerced to the field's type;
unknown keys and out-of-range values raise ``ValueError`` naming the field and what is allowed.
The same string works from Python, the CLI and the what-if simulator.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

C = TypeVar("C", bound="OptionsConfig")

_KEY = re.compile(r"^[a-z_][a-z0-9_]*$")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclass(frozen=True)
class OptionsConfig:
    """A frozen dataclass of options that validates itself and parses from spec options.

    ``codec`` names the codec or wrapper in error messages and spec strings.
    """

    codec: ClassVar[str] = "options"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` for out-of-range fields (subclasses extend this)."""

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_options(cls: type[C], options: dict[str, Any]) -> C:
        """Build from ``{field: value}``; string values are coerced to the field type."""
        allowed = cls.field_names()
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for key, raw in options.items():
            if key not in allowed:
                raise ValueError(
                    f"{cls.codec}: unknown option {key!r}; allowed options: {', '.join(allowed)}"
                )
            kwargs[key] = _coerce(cls.codec, key, raw, hints[key])
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """Plain ``{field: value}`` (only str/int/float/bool/None values)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def spec(self) -> str:
        """The spec string of this config, listing the fields that differ from the defaults."""
        parts = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            default = f.default if f.default is not dataclasses.MISSING else None
            if value != default:
                parts.append(f"{f.name}={_format(value)}")
        return self.codec + (":" + ",".join(parts) if parts else "")


@dataclass(frozen=True)
class CodecConfig(OptionsConfig):
    """Base of every codec config. ``compile=true`` runs encode/decode through torch.compile."""

    codec: ClassVar[str] = "codec"

    compile: bool = False


def _format(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _coerce(codec: str, key: str, raw: Any, hint: Any) -> Any:
    """Coerce ``raw`` to the type annotation ``hint`` (``X | None`` allowed)."""
    args = typing.get_args(hint)
    optional = (typing.get_origin(hint) in (typing.Union, types.UnionType)) and type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    if optional and (raw is None or (isinstance(raw, str) and raw.strip().lower() in ("none", "null", ""))):
        return None
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        raise ValueError(f"{codec}: {key} needs a value of type {base.__name__}")
    if not isinstance(raw, str):
        if base is float and isinstance(raw, int) and not isinstance(raw, bool):
            return float(raw)
        if isinstance(raw, base) and not (base is int and isinstance(raw, bool)):
            return raw
        raise ValueError(f"{codec}: {key} must be {base.__name__}, got {raw!r}")
    text = raw.strip()
    try:
        if base is bool:
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError
        if base is int:
            return int(text)
        if base is float:
            return float(text)
        if base is str:
            return text
    except ValueError:
        pass
    kinds = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    raise ValueError(f"{codec}: {key} must be {kinds.get(base, base.__name__)}, got {raw!r}")


def check_range(
    codec: str,
    name: str,
    value: float | int,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> None:
    """Raise ``ValueError`` unless ``value`` lies in the interval (NaN never does)."""
    ok = not (isinstance(value, float) and math.isnan(value))
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        left = "-inf" if lo is None else f"{lo:g}"
        right = "inf" if hi is None else f"{hi:g}"
        interval = (
            f"{'(' if lo_open or lo is None else '['}{left}, {right}{')' if hi_open or hi is None else ']'}"
        )
        raise ValueError(f"{codec}: {name} must be in {interval}, got {value!r}")


def check_choice(codec: str, name: str, value: Any, choices: tuple[Any, ...]) -> None:
    """Raise ``ValueError`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{codec}: {name} must be one of {', '.join(map(str, choices))}; got {value!r}")


@dataclass(frozen=True)
class SparsityConfig(CodecConfig):
    """How many elements a sparsifier keeps: a ``density`` in (0, 1] or a fixed count ``k``.

    With neither given, ``density`` is 0.01.
    """

    density: float | None = None
    k: int | None = None

    def validate(self) -> None:
        super().validate()
        if self.density is not None and self.k is not None:
            raise ValueError(
                f"{self.codec}: give density or k, not both (got density={self.density}, k={self.k})"
            )
        if self.density is None and self.k is None:
            object.__setattr__(self, "density", 0.01)
        if self.density is not None:
            check_range(self.codec, "density", self.density, 0.0, 1.0, lo_open=True)
        if self.k is not None:
            check_range(self.codec, "k", self.k, 1)

    def k_for(self, numel: int, density: float | None = None) -> int:
        """Elements to keep from a tensor of ``numel`` (at least 1 for a non-empty tensor);
        ``density`` replaces the configured density or k (a density schedule's stage)."""
        if numel == 0:
            return 0
        if density is not None:
            return min(numel, max(1, math.ceil(density * numel)))
        if self.k is not None:
            if self.k > numel:
                raise ValueError(f"{self.codec}: k={self.k} exceeds the tensor's {numel} elements")
            return self.k
        assert self.density is not None
        return min(numel, max(1, math.ceil(self.density * numel)))


def split_spec_list(text: str) -> list[str]:
    """A comma-separated list of specs (schemes, contenders) whose codecs may have options of
    their own: ``none,topk:density=0.01,compile=false,outer@codec=sparseloco:density=0.2,bits=4``
    -> ``none``, ``topk:density=0.01,compile=false``, ``outer@codec=sparseloco:density=0.2,bits=4``.
    A piece of the form ``key=value`` whose key is a plain option name continues the spec before
    it; any other piece starts the next."""
    specs: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        key, eq, _ = piece.partition("=")
        if specs and eq and key.strip().isidentifier():
            specs[-1] += "," + piece
        elif piece:
            specs.append(piece)
    return specs


def split_spec(spec: str) -> list[tuple[str, dict[str, str]]]:
    """``"a:x=1,y=2+b:z=3"`` -> ``[("a", {"x": "1", "y": "2"}), ("b", {"z": "3"})]``."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a codec spec must be a non-empty string like 'topk:density=0.01', got {spec!r}")
    parts = []
    for part in spec.split("+"):
        name, _, rest = part.strip().partition(":")
        name = name.strip().lower()
        if not _KEY.match(name):
            raise ValueError(f"bad codec name {name!r} in spec {spec!r}")
        options: dict[str, str] = {}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            key = key.strip().lower()
            if not eq or not _KEY.match(key):
                raise ValueError(f"bad option {item!r} in spec {spec!r}: write key=value")
            if key in options:
                raise ValueError(f"option {key!r} given twice in spec {spec!r}")
            options[key] = value.strip()
        parts.append((name, options))
    return parts
