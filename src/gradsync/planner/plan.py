"""The plan: per bucket, which parameters, compressed or dense, in how many parts, and why.

The planner (:mod:`gradsync.planner.decide`) makes it after the first step; rank 0 sends it to every
rank as an int64 tensor (:meth:`Plan.to_tensor`) and it is saved in checkpoints
(:meth:`Plan.to_state`), so that every rank runs the same plan and a resumed run does not re-plan.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gradsync.collectives.dense import dense_algorithm_names
from gradsync.sync.scheme import Scheme

DENSE_REASONS = ("", "cost", "plan", "codec")
"""Why a bucket whose tensors may be compressed is synchronized densely: not at all (""),
the cost model predicts dense faster (``cost``), ``plan="dense"`` (``plan``), or the codec
cannot take the sizes its encode calls would see, e.g. ``k`` above them (``codec``)."""


@dataclass
class BucketPlan:
    """One bucket of the plan: its parameters (engine slot indices) and how it is synchronized."""

    slots: list[int]
    codec_id: int  # -1: never compressed (small tensors); else an index into the engine's codecs
    compress: bool = False
    partitions: int = 1
    dense_algorithm: str = "hybrid"
    dense_ms: float | None = None  # predictions, for the log
    compressed_ms: float | None = None
    dense_reason: str = ""  # one of DENSE_REASONS
    stages_ms: tuple[float, ...] | None = None
    """Compressed: one part's steps predicted, on the compute and the communication thread in
    turn (encode, communication, decode; a low-rank codec has more:
    :func:`gradsync.planner.decide.stage_times`), for the planner's order of work
    (:func:`gradsync.planner.recut.span`); not sent with the plan (a re-cut runs where the plan is
    made)."""


@dataclass
class Plan:
    buckets: list[BucketPlan] = field(default_factory=list)

    # ------------------------------------------------------------------ wire and disk
    def to_tensor(self) -> torch.Tensor:
        words: list[int] = [len(self.buckets)]
        algorithms = dense_algorithm_names()
        for b in self.buckets:
            words += [
                len(b.slots), b.codec_id, int(b.compress), b.partitions, algorithms.index(b.dense_algorithm),
                _us(b.dense_ms), _us(b.compressed_ms), DENSE_REASONS.index(b.dense_reason), *b.slots,
            ]  # fmt: skip
        return torch.tensor(words, dtype=torch.int64, device="cpu")

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Plan:
        w = t.tolist()
        pos, buckets = 1, []
        for _ in range(w[0]):
            n, codec_id, compress, parts, algo, dense_us, comp_us, reason = w[pos : pos + 8]
            pos += 8
            buckets.append(
                BucketPlan(
                    w[pos : pos + n], codec_id, bool(compress), parts, dense_algorithm_names()[algo],
                    _ms(dense_us), _ms(comp_us), DENSE_REASONS[reason],
                )
            )  # fmt: skip
            pos += n
        return cls(buckets)

    def to_state(self) -> list[dict[str, Any]]:
        return [asdict(b) for b in self.buckets]

    @classmethod
    def from_state(cls, state: list[dict[str, Any]]) -> Plan:
        out = []
        for b in state:  # a state read back from JSON holds a list; older states no stages
            stages = b.get("stages_ms")
            out.append(BucketPlan(**{**b, "stages_ms": None if stages is None else tuple(stages)}))
        return cls(out)

    # ------------------------------------------------------------------ display
    def rows(
        self, names: list[str], nbytes: list[int], scheme: Scheme, codecs: list[str],
        schemes: Sequence[Scheme] | None = None,
    ) -> list[list[str]]:  # fmt: skip
        """One row per bucket (``schemes``: the scheme of each codec id, where they differ)."""
        out = []
        for i, b in enumerate(self.buckets):
            first, last = names[b.slots[0]], names[b.slots[-1]]
            size = sum(nbytes[s] for s in b.slots)
            if b.compress:
                mine = schemes[b.codec_id] if schemes is not None else scheme
                how = f"{'+local ' if mine.local else ''}{mine.strategy} {codecs[b.codec_id]}"
                how += f" x{b.partitions}" if b.partitions > 1 else ""
            else:
                how = f"dense {b.dense_algorithm}" + (f"/{scheme.comm_dtype}" if scheme.comm_dtype else "")
            out.append(
                [
                    str(i), str(len(b.slots)), f"{size / 2**20:.2f}",
                    first if first == last else f"{first} .. {last}",
                    how, _fmt(b.dense_ms), _fmt(b.compressed_ms),
                ]
            )  # fmt: skip
        return out

    def table(
        self, names: list[str], nbytes: list[int], scheme: Scheme, codecs: list[str],
        schemes: Sequence[Scheme] | None = None,
    ) -> str:  # fmt: skip
        head = ["bucket", "tensors", "MiB", "parameters", "synchronized as", "dense ms", "compressed ms"]
        rows = [head, *self.rows(names, nbytes, scheme, codecs, schemes)]
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def same_plan(a: Plan, b: Plan) -> bool:
    """The same buckets synchronized the same way (predictions aside)."""
    key = [(x.slots, x.codec_id, x.compress, x.partitions, x.dense_algorithm) for x in a.buckets]
    return key == [(x.slots, x.codec_id, x.compress, x.partitions, x.dense_algorithm) for x in b.buckets]


def _us(ms: float | None) -> int:
    return -1 if ms is None or not math.isfinite(ms) else round(ms * 1000)


def _ms(us: int) -> float | None:
    return None if us < 0 else us / 1000


def _fmt(ms: float | None) -> str:
    return "" if ms is None else f"{ms:.2f}"
