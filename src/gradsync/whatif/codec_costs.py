"""Codec costs at the target device's speed: measured here, or read from a table.

:class:`CodecTable` times each codec the contenders need once, on this machine, with
:func:`gradsync.collectives.cost.measure_codec` (the planner's own measurement) at a fixed set of
sizes, and scales encode and decode by ``scale`` (the target device's time over this machine's).
A table measured on the target device itself (``gradsync whatif --save-codec-costs`` run there,
e.g. on a GPU) is read with ``--codec-costs`` and used as it is. Format ``gradsync.codec-costs/1``::

    {"format": "gradsync.codec-costs/1", "device": "cpu AMD EPYC", "sizes": [...],
     "codecs": {"mstopk:density=0.01": {"encode": [a, b], "decode": [a, b], "payload": [a, b],
                                        "summable": false, "lowrank": false}}}

with each pair ``[a, b]`` the line ``a + b * bytes`` (seconds, or payload bytes).
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import torch

from gradsync.codecs import build_codec
from gradsync.collectives.cost import CodecCost, Linear, measure_codec

CODEC_COSTS_FORMAT = "gradsync.codec-costs/1"
SIZES = (1 << 18, 1 << 22, 1 << 24)
"""Bytes each codec is timed at (256 KiB, 4 MiB, 16 MiB): the lines are fitted through them."""


class CodecTable:
    """``table(spec, sizes) -> CodecCost`` (the simulator's codec-cost source)."""

    def __init__(
        self,
        scale: float = 1.0,
        device: str = "cpu",
        entries: dict[str, CodecCost] | None = None,
        sizes: tuple[int, ...] = SIZES,
        measured_on: str = "",
    ) -> None:
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(f"--codec-scale must be a positive number, got {scale!r}")
        self.scale = scale
        self.device = device
        self.sizes = sizes
        self.entries: dict[str, CodecCost] = dict(entries or {})
        if not measured_on and torch.device(device).type == "cuda":
            measured_on = f"{device} {torch.cuda.get_device_name(torch.device(device))}"
        self.measured_on = measured_on or device
        self.measured: list[str] = []

    def __call__(self, spec: str, sizes: list[float]) -> CodecCost:
        if spec not in self.entries:
            # on a GPU the codecs run resident, as the engine runs them there (host-free, their
            # work replayed as CUDA graphs)
            codec = build_codec(spec, resident=torch.device(self.device).type == "cuda")
            torch.manual_seed(0)
            self.entries[spec] = measure_codec(codec, list(self.sizes), reps=3, device=self.device)
            self.measured.append(spec)
        c = self.entries[spec]
        s = self.scale
        return replace(
            c, encode=Linear(c.encode.a * s, c.encode.b * s), decode=Linear(c.decode.a * s, c.decode.b * s)
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CODEC_COSTS_FORMAT,
            "device": self.measured_on,
            "sizes": list(self.sizes),
            "codecs": {spec: c.to_dict() for spec, c in sorted(self.entries.items())},
        }

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1)

    @classmethod
    def load(cls, path: str, scale: float = 1.0) -> CodecTable:
        where = f"--codec-costs {path}"
        try:
            with open(path) as fh:
                doc = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{where}: cannot read it: {e}") from None
        return cls.from_dict(doc, where, scale)

    @classmethod
    def from_dict(cls, doc: Any, where: str, scale: float = 1.0) -> CodecTable:
        """A ``gradsync.codec-costs/1`` document (``ValueError`` naming ``where`` and the field)."""
        if not isinstance(doc, dict) or doc.get("format") != CODEC_COSTS_FORMAT:
            raise ValueError(f"{where}: not a {CODEC_COSTS_FORMAT} table")
        entries = {}
        codecs = doc.get("codecs")
        if not isinstance(codecs, dict):
            raise ValueError(f"{where}: codecs must be an object of codec spec -> costs")
        for spec, d in codecs.items():
            build_codec(spec)
            entries[spec] = CodecCost.from_dict(d, f"{where}: codecs[{spec!r}]")
        return cls(scale, entries=entries, measured_on=str(doc.get("device", "")))
