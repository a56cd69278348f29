"""What a plan compresses, and why the rest is not: compression must never be silently off.

After planning, every rank turns the plan into a :class:`PlanReport`: per tensor, compressed or
dense and for what reason (smaller than ``min_compress_bytes``, not floating point, the cost
model predicts dense faster, ``plan="dense"``, the codec cannot take the sizes, PowerSGD's rank
is not below the tensor's dimensions, nothing crosses a node). Rank 0 logs its one-line summary;
every rank warns when a compressed scheme ends up compressing nothing, or when
``plan="compress"`` cannot be honoured for some tensors. Every rank has the same plan, so every
rank reaches the same words.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from gradsync.codecs import Compressor
from gradsync.collectives.topology import Topology
from gradsync.planner.decide import scheme_for
from gradsync.planner.plan import Plan
from gradsync.sync.buckets import Slot
from gradsync.sync.codec_set import CodecSet
from gradsync.sync.config import SyncConfig
from gradsync.sync.scheme import Scheme

log = logging.getLogger("gradsync")

# what to do about each reason, for the warning
_HINTS = {
    "small": "lower min_compress_bytes to compress small tensors",
    "dtype": "only floating-point tensors can be compressed",
    "cost": "pass plan='compress' to compress where the cost model predicts no gain",
    "plan": "plan='dense' turns compression off",
    "codec": "give the codec a density instead of a fixed k, or a smaller k",
    "lowrank": "use a lower rank, or a codec that sparsifies or quantizes",
    "one node": "hitopk and +local schemes compress only across nodes; on one node use e.g. 'allgather/topk'",
}


@dataclass
class PlanReport:
    """Per reason, the tensors synchronized densely; and the words derived from it."""

    scheme: str
    compressed: list[str] = field(default_factory=list)
    compressed_bytes: int = 0
    dense: dict[str, list[tuple[str, int]]] = field(default_factory=dict)  # reason text -> (name, bytes)
    summary: str = ""
    warnings: list[str] = field(default_factory=list)

    @property
    def dense_bytes(self) -> int:
        return sum(b for items in self.dense.values() for _, b in items)


def explain_plan(
    plan: Plan,
    slots: list[Slot],
    classes: list[int],
    scheme: Scheme,
    config: SyncConfig,
    codecs: list[Compressor],
    nodes: int,
    rejects: Callable[[int, list[int], int], str | None],
    schemes: Sequence[Scheme] | None = None,
    world: int = 2,
) -> PlanReport:
    """The report of ``plan`` over ``slots`` (``classes``: each slot's codec class, -1 for never
    compressed; ``rejects`` and ``schemes`` as in :func:`gradsync.planner.decide.make_plan`;
    ``nodes`` of ``world`` ranks in all)."""
    report = PlanReport(scheme.name)
    if scheme.kind == "dense":
        report.summary = f"dense scheme {scheme.name}: nothing is compressed"
        return report
    kinds: dict[str, str] = {}  # reason text -> hint key

    def dense(slot: Slot, key: str, text: str) -> None:
        report.dense.setdefault(text, []).append((slot.name, slot.nbytes))
        kinds[text] = key

    used: dict[int, int] = {}  # tensors compressed per codec id
    # local aggregation on one node of several ranks is dense (a world of one rank, which only
    # a rehearsal synchronizes, runs the strategy itself: compressed_program)
    one_node = bool(scheme.local) and nodes == 1 and world > 1
    for b in plan.buckets:
        why = ""
        if not b.compress and b.dense_reason == "codec":
            why = rejects(b.codec_id, b.slots, 1) or "the codec cannot take these sizes"
        for i in b.slots:
            s = slots[i]
            if classes[i] < 0:
                if not s.param.is_floating_point():
                    dense(s, "dtype", f"not floating point ({s.param.dtype})")
                else:
                    dense(s, "small", f"smaller than min_compress_bytes={config.min_compress_bytes}")
            elif one_node:
                dense(s, "one node", "one node: nothing crosses a node, so it is reduced densely inside it")
            elif not b.compress:
                if b.dense_reason == "plan":
                    dense(s, "plan", "plan='dense'")
                elif b.dense_reason == "codec":
                    dense(s, "codec", why)
                else:
                    dense(s, "cost", "the cost model predicts dense synchronization faster")
            elif _factored_dense(codecs[b.codec_id], s.param.shape):
                dense(s, "lowrank", codecs[b.codec_id].why_dense(s.param.shape))
            else:
                report.compressed.append(s.name)
                report.compressed_bytes += s.nbytes
                used[b.codec_id] = used.get(b.codec_id, 0) + 1
    total = report.compressed_bytes + report.dense_bytes
    if len(used) > 1 or (schemes is not None and len(set(schemes)) > 1):
        how = ", ".join(
            f"{scheme_for(scheme, schemes, c).own_name} ({n} tensors)"
            for c, n in sorted(used.items())
        )  # fmt: skip
        codec_text = f"with {how or 'none of the candidates'}"
    else:
        specs = ", ".join(c.spec() for c in codecs)
        codec_text = f"with {scheme.strategy}{'+local' if scheme.local else ''}/{specs}"
    parts = [
        f"compressing {len(report.compressed)} of {len(slots)} tensors "
        f"({report.compressed_bytes / 1e6:.3f} of {total / 1e6:.3f} MB) {codec_text}"
    ]
    for text, items in report.dense.items():
        nbytes = sum(n for _, n in items)
        parts.append(f"dense: {len(items)} ({nbytes / 1e6:.3f} MB) {_first(items)}: {text}")
    report.summary = "; ".join(parts)
    if not report.compressed:
        hints = "; ".join(dict.fromkeys(_HINTS[kinds[t]] for t in report.dense))
        reasons = "; ".join(f"{len(v)} tensors: {t}" for t, v in report.dense.items())
        report.warnings.append(
            f"gradsync: the scheme {scheme.text!r} compresses nothing on this model ({reasons}); {hints}"
        )
    elif config.plan == "compress":
        refused = {t: v for t, v in report.dense.items() if kinds[t] in ("codec", "lowrank")}
        if refused:
            detail = "; ".join(f"{_first(v)}: {t}" for t, v in refused.items())
            report.warnings.append(
                f"gradsync: plan='compress' asked to compress every tensor, but these go dense: {detail}"
            )
    return report


def report_plan(
    plan: Plan,
    slots: list[Slot],
    codecs: CodecSet,
    config: SyncConfig,
    topo: Topology,
    seconds: float,
    table: Callable[[], str],
) -> PlanReport:
    """Say what the plan (made in ``seconds``) compresses and why the rest is not: one line on
    rank 0 (logger ``gradsync``; ``table()`` at debug level) and, on every rank, a warning where
    a compressed scheme compresses nothing or the user's ``plan="compress"`` cannot be honoured
    for some tensors. Returns the report."""
    report = explain_plan(
        plan, slots, [codecs.codec_class(s) for s in slots], codecs.scheme, config, codecs.codecs,
        topo.nodes, lambda cid, members, parts: codecs.rejects(slots, cid, members, parts), codecs.schemes,
        topo.world,
    )  # fmt: skip
    if config.log_plan and topo.rank == 0:
        log.info(
            "gradsync plan (%s on %d x %d, made in %.2f s): %s", codecs.scheme.name, topo.nodes,
            topo.per_node, seconds, report.summary,
        )  # fmt: skip
        log.debug("gradsync plan, bucket by bucket:\n%s", table())
    for text in report.warnings:
        warnings.warn(text, RuntimeWarning, stacklevel=3)
    return report


def _factored_dense(codec: Compressor, shape: torch.Size) -> bool:
    return codec.per_tensor and not codec.compresses(shape)


def _first(items: list[tuple[str, int]]) -> str:
    names = [n for n, _ in items]
    return repr(names[0]) if len(names) == 1 else f"{names[0]!r} and {len(names) - 1} more"
