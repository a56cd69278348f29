"""The planner: per bucket, compress or not and in how many parts (paper 05's selective
compression and partitioning), from the alpha-beta cost model of :mod:`gradsync.collectives.cost`.

Inputs are measured on the running job: alpha and beta of each link level (calibrated after the
first step) and the encode / decode times of the actual codec at the actual sizes (timed on
rank 0). For each bucket of S bytes the planner predicts

- dense: the cheapest of flat, hierarchical and torus2d (or the configured algorithm);
- compressed in K parts (K = 1, 2, 4, or the configured count): one part costs t(S/K) by the
  scheme's formula, split into compute c (encode + decode) and communication x = t - c; parts
  pipeline on the task manager's two threads, so K parts take ``t + (K - 1) max(c, x)``;

and picks the cheapest (``plan="auto"``), or forces compression (``compress``) or dense
(``dense``). Rank 0 decides and broadcasts the plan as an int64 tensor, so every rank runs the
same plan; it is saved in checkpoints so that a resumed run does not re-plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from gradsync.collectives.cost import CodecCost, CostModel
from gradsync.collectives.dense import ALGORITHMS, HybridPolicy
from gradsync.collectives.hitopk_pipeline import pipeline_chunks
from gradsync.sync.scheme import Scheme

DENSE_ALGORITHMS = ("flat", "hierarchical", "torus2d")
# compress a bucket only when the model predicts at least a 2x win: at about 1 MiB the
# compressed schemes took up to 2.0x their predicted time in the collectives benchmark (several
# small collectives whose latency the calibrated alpha underestimates), dense all-reduces 1.0-1.1x
COMPRESS_MARGIN = 0.5


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


@dataclass
class Plan:
    buckets: list[BucketPlan] = field(default_factory=list)

    # ------------------------------------------------------------------ wire and disk
    def to_tensor(self) -> torch.Tensor:
        words: list[int] = [len(self.buckets)]
        for b in self.buckets:
            words += [
                len(b.slots), b.codec_id, int(b.compress), b.partitions, ALGORITHMS.index(b.dense_algorithm),
                _us(b.dense_ms), _us(b.compressed_ms), DENSE_REASONS.index(b.dense_reason), *b.slots,
            ]  # fmt: skip
        return torch.tensor(words, dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> Plan:
        w = t.tolist()
        pos, buckets = 1, []
        for _ in range(w[0]):
            n, codec_id, compress, parts, algo, dense_us, comp_us, reason = w[pos : pos + 8]
            pos += 8
            buckets.append(
                BucketPlan(
                    w[pos : pos + n], codec_id, bool(compress), parts, ALGORITHMS[algo],
                    _ms(dense_us), _ms(comp_us), DENSE_REASONS[reason],
                )
            )  # fmt: skip
            pos += n
        return cls(buckets)

    def to_state(self) -> list[dict[str, Any]]:
        return [asdict(b) for b in self.buckets]

    @classmethod
    def from_state(cls, state: list[dict[str, Any]]) -> Plan:
        return cls([BucketPlan(**b) for b in state])

    # ------------------------------------------------------------------ display
    def rows(self, names: list[str], nbytes: list[int], scheme: Scheme, codecs: list[str]) -> list[list[str]]:
        out = []
        for i, b in enumerate(self.buckets):
            first, last = names[b.slots[0]], names[b.slots[-1]]
            size = sum(nbytes[s] for s in b.slots)
            if b.compress:
                how = f"{'+local ' if scheme.local else ''}{scheme.strategy} {codecs[b.codec_id]}"
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

    def table(self, names: list[str], nbytes: list[int], scheme: Scheme, codecs: list[str]) -> str:
        head = ["bucket", "tensors", "MiB", "parameters", "synchronized as", "dense ms", "compressed ms"]
        rows = [head, *self.rows(names, nbytes, scheme, codecs)]
        widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _us(ms: float | None) -> int:
    return -1 if ms is None or not math.isfinite(ms) else round(ms * 1000)


def _ms(us: int) -> float | None:
    return None if us < 0 else us / 1000


def _fmt(ms: float | None) -> str:
    return "" if ms is None else f"{ms:.2f}"


# ---------------------------------------------------------------------------------- predictions
def predict(scheme: Scheme, model: CostModel, nbytes: float, codec: CodecCost | None) -> float:
    """Predicted seconds of one synchronization of ``nbytes`` (float32 bytes) with ``scheme``."""
    if scheme.kind == "dense":
        algo = scheme.algorithm
        if algo == "hybrid":
            algo = HybridPolicy().pick(int(nbytes))
        return getattr(model, algo)(nbytes // 2 if scheme.comm_dtype else nbytes)
    if codec is None:
        raise ValueError("a compressed scheme needs the codec's measured cost")
    if codec.lowrank and not scheme.local:
        return model.lowrank(nbytes, codec)
    if scheme.strategy == "allgather" and scheme.local:  # hitopk, pipelined in chunks
        return model.hitopk(nbytes, codec, pipeline_chunks(int(nbytes), 4))
    if scheme.local:
        return model.locally_aggregated(scheme.strategy or "allgather", nbytes, codec)
    if scheme.strategy == "allgather":
        return model.naive(nbytes, codec)
    return model.casync(scheme.strategy or "ring", nbytes, codec, messages=2)


def encode_sizes(scheme: Scheme, nbytes: float, nodes: int, per_node: int) -> float:
    """Bytes one encode call of the scheme sees for a bucket of ``nbytes``."""
    if scheme.local and per_node > 1 and nodes > 1:
        nbytes /= per_node
    if scheme.strategy in ("ring", "ps"):
        nbytes /= nodes if scheme.local else nodes * per_node
    return nbytes


def best_dense(model: CostModel, nbytes: float, algorithm: str) -> tuple[str, float]:
    """The dense algorithm to use (``auto``: the cheapest) and its predicted seconds."""
    if algorithm != "auto":
        return algorithm, predict(Scheme("", "dense", algorithm), model, nbytes, None)
    costs = {a: getattr(model, a)(nbytes) for a in DENSE_ALGORITHMS}
    best = min(costs, key=costs.__getitem__)
    return best, costs[best]


def best_partitions(
    scheme: Scheme, model: CostModel, nbytes: float, codec: CodecCost, nodes: int, per_node: int, fixed: int
) -> tuple[int, float]:
    """The number of pipelined parts (``fixed`` if nonzero) and the predicted seconds."""
    choices = [fixed] if fixed else ([1] if codec.lowrank else [1, 2, 4])
    best = (1, math.inf)
    for k in choices:
        part = nbytes / k
        t = predict(scheme, model, part, codec)
        enc = encode_sizes(scheme, part, nodes, per_node)
        c = min(codec.encode(enc) + codec.decode(enc), t)
        total = t + (k - 1) * max(c, t - c)
        if total < best[1]:
            best = (k, total)
    return best


def make_plan(
    groups: list[tuple[list[int], int]],
    nbytes: list[int],
    scheme: Scheme,
    model: CostModel,
    codec_costs: dict[int, CodecCost],
    mode: str,
    dense_algorithm: str,
    partitions: int,
    fuse_bytes: int | None = None,
    kinds: list[object] | None = None,
    rejects: Callable[[int, list[int], int], str | None] | None = None,
) -> Plan:
    """Decide every bucket. ``groups`` are (slot indices, codec id) in launch order.

    With ``fuse_bytes``, neighbouring buckets that both stay dense are fused again (up to that
    many bytes, only slots of one ``kinds`` entry together: same dtype and device), as DDP fuses
    by size alone: the buckets were cut apart by codec class and by the fusion timeout for the
    sake of compression, and a dense bucket gains little from the cut but pays one more
    collective's latency (measured: 11 dense buckets of a 0.7 MB ResNet took 1.24x DDP's step at
    1 Gbit/s).

    ``rejects(codec_id, slots, partitions)`` says why the codec cannot compress a bucket (None
    when it can); such a bucket stays dense with ``dense_reason="codec"``, in every mode."""
    plan = Plan()
    for slots, codec_id in groups:
        size = float(sum(nbytes[s] for s in slots))
        if scheme.kind == "dense":
            algo = scheme.algorithm
            plan.buckets.append(
                BucketPlan(slots, -1, False, 1, algo, predict(scheme, model, size, None) * 1e3)
            )
            continue
        algo, t_dense = best_dense(model, size, dense_algorithm)
        b = BucketPlan(slots, codec_id, False, 1, algo, t_dense * 1e3)
        if codec_id >= 0 and mode == "dense":
            b.dense_reason = "plan"
        elif codec_id >= 0:
            k, t_comp = best_partitions(
                scheme, model, size, codec_costs[codec_id], model.m, model.n, partitions
            )
            b.partitions, b.compressed_ms = k, t_comp * 1e3
            b.compress = mode == "compress" or t_comp < COMPRESS_MARGIN * t_dense
            b.dense_reason = "" if b.compress else "cost"
            if b.compress and rejects is not None and rejects(codec_id, slots, k) is not None:
                b.compress, b.partitions, b.dense_reason = False, 1, "codec"
        plan.buckets.append(b)
    if fuse_bytes is not None:

        def dense_cost(size: float) -> tuple[str, float]:
            if scheme.kind == "dense":
                return scheme.algorithm, predict(scheme, model, size, None)
            return best_dense(model, size, dense_algorithm)

        plan = _fuse_dense(plan, nbytes, dense_cost, fuse_bytes, kinds or [None] * len(nbytes))
    return plan


def _fuse_dense(
    plan: Plan,
    nbytes: list[int],
    dense_cost: Callable[[float], tuple[str, float]],
    fuse_bytes: int,
    kinds: list[object],
) -> Plan:
    out = Plan()
    for b in plan.buckets:
        prev = out.buckets[-1] if out.buckets else None
        if (
            prev is not None
            and not prev.compress
            and not b.compress
            and kinds[prev.slots[0]] == kinds[b.slots[0]]
            and (not prev.dense_reason or not b.dense_reason or prev.dense_reason == b.dense_reason)
            and sum(nbytes[s] for s in prev.slots + b.slots) <= fuse_bytes
        ):
            slots = prev.slots + b.slots
            algo, t = dense_cost(float(sum(nbytes[s] for s in slots)))
            # a fused bucket's codec class is only a label now (it is never compressed); the
            # report reads why each of its tensors is dense from the buckets before fusion
            reason = prev.dense_reason or b.dense_reason
            out.buckets[-1] = BucketPlan(
                slots, max(prev.codec_id, b.codec_id), False, 1, algo, t * 1e3, dense_reason=reason
            )
        else:
            out.buckets.append(b)
    return out
