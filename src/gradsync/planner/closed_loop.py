"""The closed-loop planner: re-plan from what each bucket actually cost in the running engine.

The first plan (:mod:`gradsync.planner.decide`) rests on links calibrated with barrier-synchronized
all-reduces and on codecs timed alone. Inside the running engine both cost more: each collective
call pays for Python, the task threads and the size exchanges around it, and each encode runs
next to the backward pass, sharing its cores. So, after a plan is installed, the engine
measures every bucket for a few steps: the time inside its collectives, on the compute thread
(packing, error feedback, encoding) and decoding. Then:

1. **Agree.** Every rank contributes its per-bucket medians, and one all-reduce takes the
   maximum. A step waits for its slowest rank, so every rank holds the same numbers.
2. **Refit** (rank 0, :func:`refit`):
   - alpha and beta of each link level, by least squares on the buckets' communication times
     through the same formulas the planner uses (:mod:`gradsync.collectives.cost`), with a weak
     pull towards the calibrated values where the measurements do not pin a parameter down;
   - each codec's encode and decode, scaled to what its buckets measured;
   - the dense buckets' packing and unpacking time, which the first plan ignores.
3. **Re-plan.** :func:`~gradsync.planner.decide.make_plan` runs over the same buckets with the
   refitted model. It asks a compressed bucket for a win of only ``replan_gain`` (the first plan
   asks for 2x, because its model is the uncorrected one).
4. **Switch or settle.** The new plan replaces the old one only when the refitted model predicts
   it at least ``replan_gain`` faster in total (hysteresis: no oscillation between near-equal
   plans). Rank 0 sends the decision (:func:`~gradsync.planner.decide.share_plan`), so every rank
   switches at the same step. A round that keeps the plan settles the loop.
5. **Guard.** Every switch is measured once more: the median time from a step's first ready
   gradient to the end of its synchronization (agreed as the maximum over the ranks). If the new
   plan measured more than ``1 + replan_gain`` times the old one, the model was wrong, and every
   rank goes back to the old plan. After ``replan`` switches the round after the last one only
   runs this guard.
6. **Trials** (``auto`` with candidates of more than one codec, :mod:`gradsync.planner.trials`):
   up to ``replan_trials`` plans that run one codec alone, each measured like any plan; the loop
   settles on whichever plan measured the shortest span.

A switch keeps the compression state of every bucket it leaves as it was: same tensors,
compressed, same codec, same number of parts (PowerSGD's per-tensor streams stay while their
tensor stays under PowerSGD). A bucket the switch changes starts its streams afresh, but what
their error feedback still owed is not dropped: it is traced back to the parameters and carried
into the new plan (:mod:`gradsync.sync.carry`), and so is a revert's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives.cost import (
    CALIBRATED_KINDS,
    COLLECTIVE_KINDS,
    CodecCost,
    CostModel,
    CostParams,
    Linear,
    Link,
    efficiency_key,
)
from gradsync.collectives.topology import Topology
from gradsync.planner.decide import (
    FirstStep,
    best_partitions,
    collective_of,
    encode_sizes,
    no_compute,
    predict,
    scheme_for,
    stage_times,
)
from gradsync.planner.plan import Plan
from gradsync.planner.recut import bucket_seconds, span
from gradsync.planner.trials import Duel, duel_block_steps
from gradsync.sync.scheme import Scheme
from gradsync.sync.stats import StepStats

MISSING = -1.0


@dataclass(frozen=True)
class Sample:
    """One bucket's measured costs (seconds per step, the maximum over the ranks)."""

    nbytes: float
    compressed: bool
    parts: int
    algorithm: str  # a dense bucket's algorithm
    codec_id: int
    comm_s: float
    compute_s: float
    decode_s: float


@dataclass(frozen=True)
class Refit:
    """The cost model refitted on measured buckets."""

    params: CostParams
    codecs: dict[int, CodecCost]
    pack: Linear | None  # a dense bucket's packing + unpacking, seconds against bytes
    comm_error_before: float  # the fitted error (refit_links), calibrated links
    comm_error_after: float  # ... refitted links
    encode_scale: dict[int, float] = field(default_factory=dict)
    unmeasured: tuple[str, ...] = ()
    """Efficiency classes no bucket measured, given the measured classes' factor
    (:func:`with_unmeasured_classes`)."""

    def dense_overhead(self, nbytes: float) -> float:
        return self.pack(nbytes) if self.pack is not None else 0.0

    def describe(self) -> str:
        def level(name: str, link: Link) -> str:
            rate = f"{1 / link.beta / 1e9:.2f} GB/s" if link.beta > 0 else "unbounded"
            return f"{name} alpha {link.alpha * 1e6:.0f} us, {rate}"

        p = self.params
        parts = [level("intra", p.intra), level("inter", p.inter), f"{p.call * 1e3:.2f} ms per call"]
        parts += [f"codec {c} encode x{k:.2f}" for c, k in sorted(self.encode_scale.items())]
        parts += [f"{key} x{f:.2f}" for key, f in p.efficiency if key not in self.unmeasured]
        if self.unmeasured:
            given = sorted({f"x{f:.2f}" for key, f in p.efficiency if key in self.unmeasured})
            parts.append(f"unmeasured classes as the measured ({', '.join(given)})")
        before, after = 100 * self.comm_error_before, 100 * self.comm_error_after
        parts.append(f"communication error {before:.0f} % -> {after:.0f} %")
        return "; ".join(parts)


# --------------------------------------------------------------------------------- the formulas
def comm_seconds(
    scheme: Scheme,
    model: CostModel,
    s: Sample,
    codec: CodecCost | None,
    schemes: Sequence[Scheme] | None = None,
) -> float:
    """The model's communication time of a measured bucket: its collectives without the codec's
    compute (which the compute thread's measurement covers). ``schemes``: one per codec id, as
    in :func:`~gradsync.planner.decide.make_plan`."""
    if not s.compressed:
        dense = scheme if scheme.kind == "dense" else Scheme("", "dense", s.algorithm)
        return predict(dense, model, s.nbytes, None)
    assert codec is not None
    mine = scheme_for(scheme, schemes, s.codec_id)
    return s.parts * predict(mine, model, s.nbytes / s.parts, no_compute(codec))


CALL_UNIT = 1e-4
CALL_INDEX = 4
"""The per-call cost's unknown counts in these seconds (it may be calibrated as zero, so it is
not a multiplier of the calibrated value like the links' unknowns)."""


def _params(base: CostParams, u: list[float], classes: Sequence[str] = ()) -> CostParams:
    """The links of unknowns ``u``; with ``classes``, ``u[5:]`` are their efficiencies."""
    return replace(
        base,
        intra=Link(base.intra.alpha * u[0], base.intra.beta * u[1]),
        inter=Link(base.inter.alpha * u[2], base.inter.beta * u[3]),
        call=u[4] * CALL_UNIT,
        efficiency=base.efficiency + tuple(zip(classes, u[5:], strict=True)),
    )


def sample_class(
    s: Sample, scheme: Scheme, codec: CodecCost | None, nodes: int, per_node: int,
    schemes: Sequence[Scheme] | None = None,
) -> str:  # fmt: skip
    """The efficiency class (:func:`~gradsync.collectives.cost.efficiency_key`) of a bucket."""
    mine = scheme_for(scheme, schemes, s.codec_id) if s.compressed else Scheme("", "dense", s.algorithm)
    kind, moved = collective_of(mine, s.nbytes / s.parts, codec if s.compressed else None, nodes, per_node)
    return efficiency_key(kind, moved)


def refit_links(
    samples: list[Sample],
    scheme: Scheme,
    params: CostParams,
    nodes: int,
    per_node: int,
    codecs: dict[int, CodecCost],
    prior: float = 1e-3,
    iterations: int = 8,
    schemes: Sequence[Scheme] | None = None,
    efficiency: bool = False,
) -> tuple[CostParams, float, float]:
    """alpha and beta of both levels and the cost of one collective call that best explain the
    measured communication times, and the model's error before and after: sqrt(sum (predicted -
    measured)^2 / measured / sum measured), the root of the fitted objective as a share of the
    measured communication time.

    Unknowns u are the calibrated links' multipliers and the call cost in units of
    :data:`CALL_UNIT`. A call is paid once per collective, a link's alpha once per step of its
    algorithm (2(p-1) in a ring), which is what tells them apart. The objective weighs each
    bucket's squared error by 1 / its time (large buckets count more than tiny ones, whose times
    are mostly the wait for the slowest rank, but not in proportion to their size), plus
    ``prior`` (u - u0)^2 per unknown times the total measured time (u0: the calibrated values),
    so an unknown no measurement depends on stays as calibrated and a few noisy buckets cannot
    move the links by orders of magnitude (the default was chosen after loopback runs with 3-4
    buckets fitted an intra-node alpha of 28 ms). Each Gauss-Newton round linearizes every
    bucket's formula around the current u (the formulas are piecewise linear in the unknowns);
    a round is taken only as far as it lowers the objective.

    ``efficiency``: also fit, as unknowns of the same objective with the same prior towards 1,
    a factor per efficiency class the buckets fall in (:func:`sample_class`: the kind of
    collective crossing the nodes and its size), multiplying that class's communication: one
    set of links cannot describe both a ring's large transfers and many small all-gathers."""
    data = [s for s in samples if s.comm_s > 0 and (not s.compressed or s.codec_id in codecs)]
    if not data:
        return params, 0.0, 0.0
    classes: list[str] = []
    if efficiency and nodes * per_node > 1:
        # what calibrate measured directly stays; the kinds the buckets show are fitted afresh
        kept = tuple(e for e in params.efficiency if e[0].split("/")[0] in CALIBRATED_KINDS)
        params = replace(params, efficiency=kept)
        classes = sorted(
            {sample_class(s, scheme, codecs.get(s.codec_id), nodes, per_node, schemes) for s in data}
        )
    base = [params.intra.alpha, params.intra.beta, params.inter.alpha, params.inter.beta, CALL_UNIT]
    base += [1.0] * len(classes)
    start = [1.0, 1.0, 1.0, 1.0, params.call / CALL_UNIT] + [1.0] * len(classes)
    low = [1e-2, 1e-2, 1e-2, 1e-2, 0.0] + [EFFICIENCY_BOUNDS[0]] * len(classes)
    unknowns = len(start)
    total = sum(s.comm_s for s in data)

    def predictions(u: list[float]) -> list[float]:
        model = CostModel(_params(params, u, classes), nodes, per_node)
        return [comm_seconds(scheme, model, s, codecs.get(s.codec_id), schemes) for s in data]

    def objective(u: list[float]) -> float:
        fit = sum((p - s.comm_s) ** 2 / s.comm_s for p, s in zip(predictions(u), data, strict=True))
        return fit + prior * total * sum((x - x0) ** 2 for x, x0 in zip(u, start, strict=True))

    def mispredicted(u: list[float]) -> float:  # the fitted error, as a share of the time
        return math.sqrt(
            sum((p - s.comm_s) ** 2 / s.comm_s for p, s in zip(predictions(u), data, strict=True)) / total
        )

    u = list(start)
    best = objective(u)
    for _ in range(iterations):
        f0 = predictions(u)
        cols = []
        for k in range(unknowns):
            if base[k] <= 0:
                cols.append([0.0] * len(data))
                continue
            h = 1e-3 * max(u[k], 1.0 if k == CALL_INDEX else 0.0)  # the call cost may be 0
            bumped = list(u)
            bumped[k] += h
            cols.append([(fb - fa) / h for fa, fb in zip(f0, predictions(bumped), strict=True)])
        # rows (m - f0 - J (v - u)) / sqrt(m) for the new v; prior rows sqrt(prior * total) (v - u0)
        a = torch.zeros(len(data) + unknowns, unknowns, dtype=torch.float64)
        b = torch.zeros(len(data) + unknowns, dtype=torch.float64)
        for j, s in enumerate(data):
            w = 1.0 / math.sqrt(s.comm_s)
            for k in range(unknowns):
                a[j, k] = cols[k][j] * w
            b[j] = (s.comm_s - f0[j] + sum(cols[k][j] * u[k] for k in range(unknowns))) * w
        w = math.sqrt(prior * total)
        for k in range(unknowns):
            a[len(data) + k, k] = w
            b[len(data) + k] = w * start[k]
        solved = torch.linalg.lstsq(a, b.unsqueeze(1)).solution.squeeze(1).tolist()
        high = [1e3] * 5 + [EFFICIENCY_BOUNDS[1]] * len(classes)
        v = [min(max(x, lo), hi) for x, lo, hi in zip(solved, low, high, strict=True)]
        step = 1.0
        while step > 1e-3:  # backtrack until the objective goes down
            trial = [x + step * (y - x) for x, y in zip(u, v, strict=True)]
            value = objective(trial)
            if value < best:
                break
            step /= 2
        else:
            break
        moved = max(abs(x - y) / max(y, 1.0) for x, y in zip(trial, u, strict=True))
        u, best = trial, value
        if moved < 1e-9:
            break
    return _params(params, u, classes), mispredicted(start), mispredicted(u)


def refit(
    samples: list[Sample],
    scheme: Scheme,
    params: CostParams,
    nodes: int,
    per_node: int,
    codecs: dict[int, CodecCost],
    schemes: Sequence[Scheme] | None = None,
) -> Refit:
    """The links with their efficiencies per class of collective (:func:`refit_links`), the
    codecs and the dense buckets' packing, refitted on ``samples``.

    A codec no bucket ran in these samples (a candidate not chosen) keeps its timed cost,
    scaled as the measured codecs were on average: both ran next to the same backward pass."""
    fitted, before, after = refit_links(
        samples, scheme, params, nodes, per_node, codecs, schemes=schemes, efficiency=True
    )
    fitted, unmeasured = with_unmeasured_classes(fitted)
    scaled: dict[int, CodecCost] = dict(codecs)
    enc_scale: dict[int, float] = {}
    for cid, c in codecs.items():
        mine = [s for s in samples if s.compressed and s.codec_id == cid]
        if not mine:
            continue
        mine_scheme = scheme_for(scheme, schemes, cid)
        enc = [encode_sizes(mine_scheme, s.nbytes / s.parts, nodes, per_node) for s in mine]
        pred_e = sum(s.parts * c.encode(e) for s, e in zip(mine, enc, strict=True))
        pred_d = sum(s.parts * c.decode(e) for s, e in zip(mine, enc, strict=True))
        ke = _ratio(sum(s.compute_s for s in mine), pred_e)
        kd = _ratio(sum(s.decode_s for s in mine), pred_d)
        enc_scale[cid] = ke
        scaled[cid] = scaled_codec(c, ke, kd)
    if enc_scale:
        k = math.exp(statistics.fmean(math.log(v) for v in enc_scale.values()))
        for cid, c in codecs.items():
            if cid not in enc_scale:
                scaled[cid] = scaled_codec(c, k, k)
    dense = [s for s in samples if not s.compressed]
    pack = None
    if dense:
        xs = [s.nbytes for s in dense]
        ys = [s.compute_s + s.decode_s for s in dense]
        pack = Linear.fit(xs, ys) if len(set(xs)) > 1 else Linear(0.0, sum(ys) / max(sum(xs), 1.0))
    return Refit(fitted, scaled, pack, before, after, enc_scale, unmeasured)


def with_unmeasured_classes(params: CostParams) -> tuple[CostParams, tuple[str, ...]]:
    """``params`` with a factor for every efficiency class the refit did not measure (a kind of
    collective no bucket of the plan ran, such as a candidate's strategy): the geometric mean of
    the measured classes of the same size, or of all of them where none is of that size; and
    those classes. The measured factors say how this cluster runs collectives beside its
    training steps; a kind nobody ran is more likely to do as they do than as the formula says,
    and left at 1 it would look cheaper than every measured one to the next plan (the same rule
    as the codecs that did not run, :func:`refit`). The calibrated kinds
    (:data:`~gradsync.collectives.cost.CALIBRATED_KINDS`) are left as they are."""
    measured = {k: v for k, v in params.efficiency if k.split("/")[0] not in CALIBRATED_KINDS}
    if not measured:
        return params, ()
    added = []
    for kind in COLLECTIVE_KINDS:
        if kind in CALIBRATED_KINDS:
            continue
        for size in ("small", "large"):
            key = f"{kind}/{size}"
            if key in measured:
                continue
            alike = [v for k, v in measured.items() if k.endswith(f"/{size}")] or list(measured.values())
            added.append((key, math.exp(statistics.fmean(math.log(v) for v in alike))))
    return replace(params, efficiency=params.efficiency + tuple(added)), tuple(k for k, _ in added)


EFFICIENCY_BOUNDS = (0.25, 4.0)
"""The range of a refitted efficiency (measured over modelled communication of a class)."""


def scaled_codec(c: CodecCost, encode: float, decode: float) -> CodecCost:
    """``c`` with its encode ``encode`` times and its decode ``decode`` times as slow."""
    return replace(
        c,
        encode=Linear(c.encode.a * encode, c.encode.b * encode),
        decode=Linear(c.decode.a * decode, c.decode.b * decode),
    )


def _ratio(measured: float, predicted: float) -> float:
    if predicted <= 0 or measured <= 0:
        return 1.0
    return min(max(measured / predicted, 0.1), 100.0)


# ---------------------------------------------------------------------------- plans under a model
def plan_seconds(
    plan: Plan, nbytes: list[int], scheme: Scheme, model: CostModel, codecs: dict[int, CodecCost],
    dense_overhead: Callable[[float], float] | None = None, schemes: Sequence[Scheme] | None = None,
    ready: Sequence[float] | None = None,
) -> float:  # fmt: skip
    """The plan's buckets, each as the model predicts it with the plan's own choices: summed, or
    with ``ready`` (each slot's ready time) the span of the engine's order of work
    (:func:`gradsync.planner.recut.span`, what the planner minimizes): the comparison of two plans
    for the same gradients."""
    priced = []
    for b in plan.buckets:
        size = float(sum(nbytes[i] for i in b.slots))
        if b.compress:
            mine = scheme_for(scheme, schemes, b.codec_id)
            k, t = best_partitions(mine, model, size, codecs[b.codec_id], model.m, model.n, b.partitions)
            stages = tuple(x * 1e3 for x in stage_times(mine, model, size / k, codecs[b.codec_id]))
            priced.append(replace(b, partitions=k, compressed_ms=t * 1e3, stages_ms=stages))
        else:
            dense = scheme if scheme.kind == "dense" else Scheme("", "dense", b.dense_algorithm)
            t = predict(dense, model, size, None) + (dense_overhead(size) if dense_overhead else 0.0)
            priced.append(replace(b, dense_ms=t * 1e3))
    if ready is not None:
        return span(priced, ready)
    return sum(bucket_seconds(b) for b in priced)


def kept_streams(
    old: Plan,
    old_keys: Sequence[str],
    new: Plan,
    new_keys: Sequence[str],
    names: Sequence[str],
    per_tensor_codecs: set[int],
) -> tuple[dict[int, Callable[[str], bool]], list[int]]:
    """Which compression streams a switch from ``old`` to ``new`` keeps (a filter of stream
    keys per codec id), and the slots whose streams it ends (sorted; the same on every rank).

    A bucket's streams (``key/role``, ``key#part/role``) stay when the new plan compresses a
    bucket of the same key, slots, codec and number of parts; anything else gives its elements
    other offsets or another codec. A ``per_tensor`` codec keys its streams by parameter name
    (``names``: the slots' names), so they stay while the parameter stays under that codec."""

    def compressed(plan: Plan, keys: Sequence[str]) -> dict[str, tuple[tuple[int, ...], int, int]]:
        return {
            keys[b]: (tuple(bp.slots), bp.codec_id, bp.partitions)
            for b, bp in enumerate(plan.buckets)
            if bp.compress
        }

    before, after = compressed(old, old_keys), compressed(new, new_keys)
    prefixes: dict[int, set[str]] = {}
    per_tensor: dict[int, set[str]] = {}
    ended: set[int] = set()
    for key, (slots, cid, parts) in before.items():
        if cid in per_tensor_codecs:
            now = {i for k, (s, c, _) in after.items() if c == cid for i in s}
            per_tensor.setdefault(cid, set()).update(names[i] for i in slots if i in now)
            ended.update(i for i in slots if i not in now)
        elif after.get(key) == (slots, cid, parts):
            prefixes.setdefault(cid, set()).update(
                [key] if parts == 1 else [f"{key}#{p}" for p in range(parts)]
            )
        else:
            ended.update(slots)

    def keep(cid: int) -> Callable[[str], bool]:
        buckets, tensors = prefixes.get(cid, set()), per_tensor.get(cid, set())
        return lambda key: key.split("/", 1)[0] in buckets or key in tensors

    return {cid: keep(cid) for cid in {c for _, c, _ in before.values()}}, sorted(ended)


# ------------------------------------------------------------------------------- the measurements
@dataclass
class ClosedLoop:
    """The engine's side of the loop: which steps to measure, their per-bucket costs, how many
    re-plans happened, and whether the loop has settled."""

    replan: int  # re-plans allowed
    steps: int  # measured steps per round
    gain: float
    replans: int = 0
    settled: bool = False
    counted: int = 0  # steps with the current plan (every rank counts the same ones)
    history: list[dict[str, Any]] = field(default_factory=list)  # what each round decided (rank 0)
    revert_above: float = 1.05
    """A switch is undone when the new plan measured more than this many times the old one."""
    before: tuple[Plan, float] | None = None
    """The plan before the last switch and its measured seconds per step (see :meth:`span`)."""
    trials: int = 0
    """Plans of one codec alone measured after the re-plans (:mod:`gradsync.planner.trials`)."""
    trials_done: int = 0
    duel: Duel | None = None
    """The trial in progress, measured in turns against the plan it must beat (None: none)."""
    best: tuple[Plan, float] | None = None
    """The plan that measured the shortest span so far in the trials' phase (the winner of the
    last duel), and that span."""
    tried: list[str] = field(default_factory=list)
    """The families tried (rank 0 decides the trials; the other ranks' list stays empty)."""
    queue: list[tuple[str, Plan]] | None = None
    """Rank 0: the trials still to run (family, plan), chosen all at once when the re-plans end
    (None before)."""
    measure_steps: int = 0
    """Steps each side of a duel is measured for (:func:`gradsync.planner.trials.trial_steps`;
    0 before the trials)."""
    spread: float = 0.0
    """The agreed spread of the measured steps' spans (:func:`pooled_spread` of every measured
    step so far, each against its round's median; the maximum over the ranks)."""
    _rows: list[list[tuple[float, float, float]]] = field(default_factory=list)
    _spans: list[float] = field(default_factory=list)
    _ready: list[list[float | None]] = field(default_factory=list)  # per measured step: per slot
    _deviations: list[float] = field(default_factory=list)  # every round's relative_deviations

    @property
    def active(self) -> bool:
        return self.replan > 0 and not self.settled

    def restart(self) -> None:
        """A new plan is in place: measure it from its second step on (the first allocates)."""
        self.counted = 0
        self._rows = []
        self._spans = []
        self._ready = []

    def observe(self, stats: StepStats, valid: bool, ready_at: Sequence[float | None] | None = None) -> bool:
        """Count a step that ran with the current plan; keep its buckets' costs (and, given
        ``ready_at``, when each gradient became ready) when ``valid`` (no overflow, not a joined
        rank's shadow step). True when a re-plan is due (the same step on every rank)."""
        self.counted += 1
        if self.counted == 1:
            return False
        if valid:
            self._rows.append([(b.comm_s, b.compute_s, b.decode_s) for b in stats.bucket_stats])
            self._spans.append(stats.backward_s + stats.exposed_s)
            if ready_at is not None:
                self._ready.append(list(ready_at))
        return self.counted >= self.round_steps() + 1

    def round_steps(self) -> int:
        """Measured steps in the current round: ``steps``, or the duel's block in progress."""
        if self.duel is None:
            return self.steps
        return self.duel.steps(duel_block_steps(self.measure_steps or self.steps))

    def ready_profile(self) -> FirstStep | None:
        """When each gradient became ready in the measured steps, as the first step's order and
        times are kept: per parameter the median over the steps of its time after the step's
        first ready gradient (None: never ready), the order by that median. None before any
        measured step. This rank's: the plan is decided on rank 0."""
        if not self._ready:
            return None
        firsts = [min((t for t in row if t is not None), default=0.0) for row in self._ready]
        times: list[float | None] = []
        for i in range(len(self._ready[0])):
            seen = [
                t - first for row, first in zip(self._ready, firsts, strict=True) if (t := row[i]) is not None
            ]
            times.append(statistics.median(seen) if seen else None)
        order = sorted((i for i, t in enumerate(times) if t is not None), key=lambda i: (times[i], i))
        return FirstStep(order, times)

    def agreed(self, topo: Topology, buckets: int) -> tuple[list[tuple[float, float, float] | None], float]:
        """Per bucket, the medians of this rank's measured steps, maximum over the ranks (None for
        a bucket no rank measured); and the plan's measured span, the median of the steps' time
        from their first ready gradient to the end of synchronization, maximum over the ranks
        (the part of a step the plan changes; -1 when nothing was measured). One collective on
        the control group, so every rank holds the same numbers; it also agrees the spans'
        spread, :attr:`spread` (this rank's steps of every round so far, each against its round's
        median: :func:`relative_deviations`, :func:`pooled_spread`; the maximum over the ranks)."""
        t = torch.full((buckets + 1, 3), MISSING, dtype=torch.float64)
        rows = [r for r in self._rows if len(r) == buckets]
        for b in range(buckets):
            if rows:
                t[b] = torch.tensor([statistics.median(r[b][k] for r in rows) for k in range(3)])
        if self._spans:
            t[buckets, 0] = statistics.median(self._spans)
            self._deviations += relative_deviations(self._spans)
        t[buckets, 1] = pooled_spread(self._deviations)
        t = t.to(topo.comm_device)
        if topo.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=topo.control_group)
        out: list[tuple[float, float, float] | None] = []
        rows_out = t.cpu().tolist()
        for row in rows_out[:buckets]:
            out.append(None if row[0] < 0 else (row[0], row[1], row[2]))
        self.spread = rows_out[buckets][1]
        return out, rows_out[buckets][0]

    def worse_than_before(self, span: float) -> bool:
        """The measured guard: did the last switch make the measured span slower than the plan it
        replaced, by more than ``revert_above``? (The same answer on every rank: the spans are
        agreed.)"""
        return (
            self.before is not None
            and span > 0
            and self.before[1] > 0
            and span > self.revert_above * self.before[1]
        )

    def state_dict(self) -> dict[str, Any]:
        """The count, whether the loop settled, and the revert guard: the plan before the last
        switch with its measured span (a run resumed between a switch and its check still
        reverts a switch that measures slower); the trials done, the duel in progress, and
        the fastest plan measured in them (a run resumed during the trials still ends on it)."""
        state: dict[str, Any] = {"replans": self.replans, "settled": self.settled}
        if self.before is not None:
            state["before_plan"] = self.before[0].to_state()
            state["before_span"] = float(self.before[1])
        state.update(
            trials_done=self.trials_done, tried=list(self.tried), measure_steps=self.measure_steps,
        )  # fmt: skip
        if self.duel is not None:
            state["duel"] = self.duel.to_state()
        if self.queue is not None:
            state["queue"] = [{"family": f, "plan": p.to_state()} for f, p in self.queue]
        if self.best is not None:
            state["best_plan"] = self.best[0].to_state()
            state["best_span"] = float(self.best[1])
        return state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore :meth:`state_dict`; a resumed run measures the current plan afresh (a duel:
        its block in progress). A state saved by a version that measured trials one after the
        other goes on with the trials left."""
        state = state or {}
        self.replans = int(state.get("replans", 0))
        self.settled = bool(state.get("settled", False))
        plan, span = state.get("before_plan"), state.get("before_span")
        self.before = None if plan is None or span is None else (Plan.from_state(plan), float(span))
        self.trials_done = int(state.get("trials_done", 0))
        self.tried = [str(f) for f in state.get("tried", [])]
        self.measure_steps = int(state.get("measure_steps", 0))
        duel = state.get("duel")
        self.duel = None if duel is None else Duel.from_state(duel)
        queue = state.get("queue")
        self.queue = (
            None if queue is None else [(str(q["family"]), Plan.from_state(q["plan"])) for q in queue]
        )
        plan, span = state.get("best_plan"), state.get("best_span")
        self.best = None if plan is None or span is None else (Plan.from_state(plan), float(span))
        self.restart()


def relative_deviations(values: Sequence[float]) -> list[float]:
    """How far each of ``values`` lies from their median, relative to it; for an odd count
    without the value that is the median (its deviation is 0 by construction, and with three
    values it would make a third of them 0)."""
    if not values:
        return []
    mid = statistics.median(values)
    if mid <= 0:
        return []
    out = sorted(abs(v / mid - 1.0) for v in values)
    return out[1:] if len(out) % 2 else out


def pooled_spread(deviations: Sequence[float]) -> float:
    """A robust relative spread from :func:`relative_deviations` pooled over rounds: 1.4826 x
    their median (the standard deviation over the mean, for normal values; 0 for fewer than
    two). The loop measures a few steps per round, and the median absolute deviation of three
    values alone says little; pooled over the rounds it settles."""
    if len(deviations) < 2:
        return 0.0
    return 1.4826 * statistics.median(deviations)


def samples_of(
    plan: Plan, nbytes: list[int], measured: list[tuple[float, float, float] | None]
) -> list[Sample]:
    """The plan's buckets with their agreed measurements."""
    out = []
    for b, m in zip(plan.buckets, measured, strict=True):
        if m is None:
            continue
        size = float(sum(nbytes[i] for i in b.slots))
        out.append(Sample(size, b.compress, b.partitions, b.dense_algorithm, b.codec_id, *m))
    return out
