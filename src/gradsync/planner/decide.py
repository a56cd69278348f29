"""The planner: per bucket, compress or not and in how many parts (the HiPress paper's selective
compression and partitioning), from the alpha-beta cost model of :mod:`gradsync.collectives.cost`.

Inputs are measured on the running job: alpha and beta of each link level (calibrated after the
first step) and the encode / decode times of the actual codec at the actual sizes (timed on
rank 0). For each bucket of S bytes the planner predicts

- dense: the cheapest of flat, hierarchical and torus2d (or the configured algorithm);
- compressed in K parts (K = 1, 2, 4, or the configured count): one part costs t(S/K) by the
  scheme's formula, split into compute c (encode + decode) and communication x = t - c; parts
  pipeline on the task manager's two threads, so K parts take ``t + (K - 1) max(c, x)``;

and picks the cheapest (``plan="auto"``), or forces compression (``compress``) or dense
(``dense``). :func:`plan_after_first_step` is the whole procedure the sync engine runs after its
first step: calibrate the links, time the codecs, decide on rank 0, broadcast the plan (an int64
tensor, :mod:`gradsync.planner.plan`) so every rank runs the same one.

References:

- HiPress paper: Wu et al., "A Generic, High-Performance, Compression-Aware Framework for Data
  Parallel DNN Training", IEEE TPDS (HiPress, CaSync, CompLL).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from gradsync.codecs import Compressor
from gradsync.collectives.cost import CodecCost, CostModel, CostParams, Linear, Link, calibrate, measure_codec
from gradsync.collectives.dense import dense_algorithm, dense_algorithm_names
from gradsync.collectives.hitopk_pipeline import pipeline_chunks
from gradsync.collectives.strategies import DEFAULT_STRATEGY, compressed_strategy
from gradsync.collectives.topology import Topology
from gradsync.planner.plan import BucketPlan, Plan
from gradsync.planner.recut import merge_compressed, rechoose_candidates
from gradsync.sync.buckets import Slot, build_groups
from gradsync.sync.config import SyncConfig
from gradsync.sync.scheme import Scheme

# compress a bucket only when the model predicts at least a 2x win: at about 1 MiB the
# compressed schemes took up to 2.0x their predicted time in the collectives benchmark (several
# small collectives whose latency the calibrated alpha underestimates), dense all-reduces 1.0-1.1x
COMPRESS_MARGIN = 0.5


# ---------------------------------------------------------------------------------- predictions
def predict(scheme: Scheme, model: CostModel, nbytes: float, codec: CodecCost | None) -> float:
    """Predicted seconds of one synchronization of ``nbytes`` (float32 bytes) with ``scheme``: the
    formula, its communication (the formula without the codec's compute) times the efficiency
    measured for the kind and size of each collective it runs, weighed by its share of the
    communication (:func:`collective_phases`, :attr:`CostParams.efficiency`; 1 until measured)."""
    t = formula(scheme, model, nbytes, codec)
    if not model.params.efficiency or model.p <= 1:
        return t
    phases = collective_phases(scheme, nbytes, codec, model.m, model.n)
    factor = sum(share * model.params.efficiency_of(kind, moved) for kind, moved, share in phases)
    if factor == 1.0:
        return t
    comm = t if codec is None else formula(scheme, model, nbytes, no_compute(codec))
    return t + (factor - 1.0) * comm


def no_compute(c: CodecCost) -> CodecCost:
    """``c`` with free encode and decode: what the formulas give for its collectives alone."""
    zero = Linear(0.0, 0.0)
    return replace(c, encode=zero, decode=zero)


def collective_of(
    scheme: Scheme, nbytes: float, codec: CodecCost | None, nodes: int, per_node: int
) -> tuple[str, float]:
    """The first collective a synchronization sends across nodes and the bytes its efficiency
    class reads (:func:`collective_phases`): the class a measured bucket refits."""
    kind, moved, _ = collective_phases(scheme, nbytes, codec, nodes, per_node)[0]
    return kind, moved


def collective_phases(
    scheme: Scheme, nbytes: float, codec: CodecCost | None, nodes: int, per_node: int
) -> tuple[tuple[str, float, float], ...]:
    """The collectives a synchronization of ``nbytes`` sends across nodes, each as (kind, bytes
    that set its efficiency class, its share of the synchronization's communication time).

    The bytes are what one call moves per rank, the way :func:`~gradsync.collectives.cost.measure_efficiency`
    classes its probes: an all-gather's contribution of each rank, a point-to-point step's piece
    for one peer (CaSync's strategies cut the payload in one piece per rank of their group: the
    world, or the nodes with local aggregation, on a node's shard). CaSync-PS runs two
    collectives of equal steps (2 (N - 1) sends in all, :meth:`CostModel.casync`): the pieces to
    their owners (an all-to-all, ``sendrecv``) and the owners' aggregates back (an all-gather of
    one piece per rank); each is charged its own measured efficiency for half the time."""
    if scheme.kind == "dense" or codec is None:
        return (("allreduce", nbytes / 2 if scheme.comm_dtype else nbytes, 1.0),)
    if codec.lowrank:
        return (("allreduce", codec.payload(nbytes), 1.0),)
    strategy = compressed_strategy(scheme.strategy or DEFAULT_STRATEGY)
    local = bool(scheme.local) and per_node > 1
    group = nodes if local else nodes * per_node
    piece = codec.payload(nbytes / per_node if local else nbytes) / max(group, 1)
    return strategy.sends(codec.payload(nbytes), piece)


def formula(scheme: Scheme, model: CostModel, nbytes: float, codec: CodecCost | None) -> float:
    """The cost model's formula for one synchronization of ``nbytes`` with ``scheme``."""
    if scheme.kind == "dense":
        return dense_algorithm(scheme.algorithm).cost(model, nbytes // 2 if scheme.comm_dtype else nbytes)
    if codec is None:
        raise ValueError("a compressed scheme needs the codec's measured cost")
    # local aggregation needs ranks to aggregate: with one rank per node the engine runs the plain
    # strategy over the world (compressed_program), one encode and one all-gather, no chunks
    local = bool(scheme.local) and model.n > 1
    if codec.lowrank:  # PowerSGD's rounds, around an intra-node reduction with local aggregation
        return model.lowrank_locally_aggregated(nbytes, codec) if local else model.lowrank(nbytes, codec)
    if local and model.m == 1:  # nothing crosses a node: a dense reduce-scatter and all-gather
        return 2 * model.intra_shard_step(nbytes)
    # (a scheme not resolved for a topology: allgather with local aggregation, else the ring)
    strategy = compressed_strategy(scheme.strategy or ("allgather" if local else "ring"))
    if local and strategy.pipelined:  # hitopk, pipelined in chunks (as the engine runs a resolved one)
        if scheme.strategy is None:
            return model.hitopk(nbytes, codec)
        return model.hitopk(nbytes, codec, pipeline_chunks(int(nbytes), 4))
    if local:
        return model.locally_aggregated(
            nbytes, codec, lambda s, n, link: strategy.cost(model, s, codec, n, link)
        )
    return strategy.cost(model, nbytes, codec, model.p, model.world_link)


def codec_work(c: CodecCost, encode: bool, decode: bool) -> CodecCost:
    """``c`` with only its encode and/or decode cost (the other zero)."""
    zero = Linear(0.0, 0.0)
    return replace(c, encode=c.encode if encode else zero, decode=c.decode if decode else zero)


def split_prediction(
    scheme: Scheme, model: CostModel, nbytes: float, codec: CodecCost
) -> tuple[float, float, float]:
    """(encode, communication, decode) seconds of one compressed synchronization of ``nbytes``,
    read off the scheme's formula: the encode (decode) is the formula on free links with only the
    codec's encode (decode) cost, the communication what is left of the whole prediction (where
    the formula overlaps compute with transfers, as hitopk's chunk pipeline does, the overlap is
    credited to the communication)."""
    total = predict(scheme, model, nbytes, codec)
    free = CostModel(CostParams(Link(0.0, 0.0), Link(0.0, 0.0), 0.0), model.m, model.n)
    enc = predict(scheme, free, nbytes, codec_work(codec, True, False))
    dec = predict(scheme, free, nbytes, codec_work(codec, False, True))
    return enc, max(total - enc - dec, 0.0), dec


def lowrank_steps(
    scheme: Scheme, model: CostModel, nbytes: float, codec: CodecCost
) -> list[tuple[str, float]]:
    """A low-rank bucket of ``nbytes`` as the engine runs it (:mod:`gradsync.collectives.lowrank_rounds`):
    (label, seconds) of its steps, the compute thread's and the communication thread's in turn
    (even places compute, odd ones communicate). The projection P = M Q, the all-reduce of P, the
    orthonormalization and Q = M^T P, the all-reduce of Q, the decode; with local aggregation on
    more than one rank per node a reduce onto the node's leader before them (the pack, a step of
    no time here, ahead of it) and the leader's broadcast after (the unpack after it), the steps
    between them the leader's alone. The codec's encode covers both projections, half each (the
    same products' sizes); the communication is the scheme's prediction (:func:`split_prediction`)
    cut in the proportions of its pieces' formulas. On one node with local aggregation the engine
    reduces and broadcasts and encodes nothing."""
    enc, comm, dec = split_prediction(scheme, model, nbytes, codec)
    local = bool(scheme.local) and model.n > 1
    tree = model.tree(nbytes) if local else 0.0
    rnd = (
        model.lowrank_round(nbytes, codec, model.m, model.params.inter)
        if local
        else model.lowrank_round(nbytes, codec)
    )
    whole = 2 * tree + 2 * rnd
    tree, rnd = (comm * tree / whole, comm * rnd / whole) if whole > 0 else (0.0, comm / 2)
    rounds = [
        ("encode P", enc / 2),
        ("allreduce P", rnd),
        ("encode Q", enc / 2),
        ("allreduce Q", rnd),
        ("decode", dec),
    ]
    if not local:
        return rounds
    if model.m <= 1:  # one node: nothing crosses, nothing is encoded
        rounds = [("", 0.0)]
    return [("pack", 0.0), ("reduce", tree), *rounds, ("broadcast", tree), ("unpack", 0.0)]


def stage_times(scheme: Scheme, model: CostModel, nbytes: float, codec: CodecCost) -> tuple[float, ...]:
    """One compressed synchronization of ``nbytes`` as the engine's two threads run it: seconds on
    the compute thread and on the communication thread in turn, from the compute thread's first
    (even places compute, odd ones communicate; :func:`gradsync.planner.recut.span` runs them).
    A codec that sends payloads encodes, communicates and decodes (:func:`split_prediction`); a
    low-rank codec computes between its collectives (:func:`lowrank_steps`)."""
    if codec.lowrank:
        return tuple(seconds for _, seconds in lowrank_steps(scheme, model, nbytes, codec))
    return split_prediction(scheme, model, nbytes, codec)


def encode_sizes(scheme: Scheme, nbytes: float, nodes: int, per_node: int) -> float:
    """Bytes one encode call of the scheme sees for a bucket of ``nbytes``."""
    if scheme.local and per_node > 1 and nodes > 1:
        nbytes /= per_node
    if compressed_strategy(scheme.strategy or DEFAULT_STRATEGY).pieces:
        nbytes /= nodes if scheme.local else nodes * per_node
    return nbytes


def scheme_for(scheme: Scheme, schemes: Sequence[Scheme] | None, codec_id: int) -> Scheme:
    """The scheme codec ``codec_id`` runs under: its own where ``schemes`` lists one per codec
    (the candidates of ``auto:candidates=...``), else ``scheme``."""
    return schemes[codec_id] if schemes is not None and 0 <= codec_id < len(schemes) else scheme


def best_dense(model: CostModel, nbytes: float, algorithm: str) -> tuple[str, float]:
    """The dense algorithm to use (``auto``: the cheapest) and its predicted seconds."""
    if algorithm != "auto":
        return algorithm, predict(Scheme("", "dense", algorithm), model, nbytes, None)
    costs = {a.name: a.cost(model, nbytes) for a in map(dense_algorithm, dense_algorithm_names()) if a.auto}
    best = min(costs, key=costs.__getitem__)
    return best, costs[best]


def best_partitions(
    scheme: Scheme, model: CostModel, nbytes: float, codec: CodecCost, nodes: int, per_node: int, fixed: int
) -> tuple[int, float]:
    """The number of pipelined parts (``fixed`` if nonzero) and the predicted seconds. A low-rank
    codec factors whole tensors, so its buckets are never cut (``fixed`` does not apply)."""
    choices = [1] if codec.lowrank else ([fixed] if fixed else [1, 2, 4])
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
    margin: float = COMPRESS_MARGIN,
    dense_overhead: Callable[[float], float] | None = None,
    schemes: Sequence[Scheme] | None = None,
    candidates: Sequence[int] = (),
    ready: Sequence[float] | None = None,
    allowed: Collection[int] | None = None,
) -> Plan:
    """Decide every bucket. ``groups`` are (slot indices, codec id) in launch order.

    ``candidates``: codec ids any compressible bucket may use besides its own group's codec
    (``auto:candidates=...``), each run under its own scheme from ``schemes`` (one per codec id);
    a bucket takes the cheapest codec its sizes allow, and dense when that is not cheap enough.

    In ``auto`` mode a bucket is compressed when its predicted time is below ``margin`` times the
    dense one (the first plan asks for a 2x win; a re-plan from measured costs asks for less).
    ``dense_overhead(S)``: seconds a dense bucket of S bytes spends besides its collective
    (packing and unpacking, as measured by the closed loop; a compressed bucket's measured
    encode already includes its packing).

    With ``fuse_bytes``, neighbouring buckets that both stay dense are fused again (up to that
    many bytes, only slots of one ``kinds`` entry together: same dtype and device), as DDP fuses
    by size alone: the buckets were cut apart by codec class and by the fusion timeout for the
    sake of compression, and a dense bucket gains little from the cut but pays one more
    collective's latency (measured: 11 dense buckets of a 0.7 MB ResNet took 1.24x DDP's step at
    1 Gbit/s).

    ``rejects(codec_id, slots, partitions)`` says why the codec cannot compress a bucket (None
    when it can); such a bucket stays dense with ``dense_reason="codec"``, in every mode.

    With ``ready`` (each slot's ready time, seconds after the step's first gradient) and
    ``fuse_bytes``, compressed buckets of one codec class (their chosen candidates may differ) are
    merged where the saved fixed costs
    outweigh the later launch (:func:`gradsync.planner.recut.merge_compressed`), before the dense
    buckets are fused. With ``ready`` and ``candidates``, a compressed bucket takes another of its
    candidates where that shortens the step in the engine's order of work, before and after the
    merges (:func:`gradsync.planner.recut.rechoose_candidates`): the cheapest total is not the
    shortest step when it holds the communication thread longer.

    ``allowed``: the codec ids a bucket may take (the closed loop's trial of one codec,
    :mod:`gradsync.planner.trials`); a bucket whose class and candidates hold none of them keeps
    its own."""

    def options_of(codec_id: int) -> tuple[int, ...]:
        """The codec ids a bucket of class ``codec_id`` may take."""
        ids = tuple(dict.fromkeys((codec_id, *candidates)))
        if allowed is None:
            return ids
        return tuple(i for i in ids if i in allowed) or ids

    def decide(slots: list[int], codec_id: int, only: int | None = None) -> BucketPlan:
        """The bucket of ``slots`` in codec class ``codec_id``, with the cheapest of its candidates
        (``only``: with that one)."""
        size = float(sum(nbytes[s] for s in slots))
        if scheme.kind == "dense":
            return BucketPlan(slots, -1, False, 1, scheme.algorithm, predict(scheme, model, size, None) * 1e3)
        algo, t_dense = best_dense(model, size, dense_algorithm)
        if dense_overhead is not None:
            t_dense += dense_overhead(size)
        b = BucketPlan(slots, codec_id, False, 1, algo, t_dense * 1e3)
        if codec_id >= 0 and mode == "dense":
            b.dense_reason = "plan"
        elif codec_id >= 0:
            options = []  # (seconds, parts, codec id, refused)
            for cid in options_of(codec_id) if only is None else (only,):
                mine = scheme_for(scheme, schemes, cid)
                k, t = best_partitions(mine, model, size, codec_costs[cid], model.m, model.n, partitions)
                refused = rejects is not None and rejects(cid, slots, k) is not None
                options.append((t, k, cid, refused))
            usable = [o for o in options if not o[3]]
            t_comp, k, cid, _ = min(usable or options)
            b.partitions, b.compressed_ms = k, t_comp * 1e3
            b.compress = mode == "compress" or t_comp < margin * t_dense
            b.dense_reason = "" if b.compress else "cost"
            if b.compress and not usable:
                b.compress, b.partitions, b.dense_reason = False, 1, "codec"
            elif b.compress:
                b.codec_id = cid
                stages = stage_times(scheme_for(scheme, schemes, cid), model, size / k, codec_costs[cid])
                b.stages_ms = tuple(x * 1e3 for x in stages)
        return b

    plan = Plan([decide(slots, codec_id) for slots, codec_id in groups])
    class_of = {s: codec_id for slots, codec_id in groups for s in slots}
    choices = tuple(dict.fromkeys(candidates))

    def alternatives(b: BucketPlan) -> list[BucketPlan]:
        cls = class_of[b.slots[0]]
        return [decide(b.slots, cls, cid) for cid in options_of(cls) if cid != b.codec_id]

    if ready is not None and choices:
        plan = Plan(rechoose_candidates(plan.buckets, ready, alternatives))
    if ready is not None and fuse_bytes is not None:
        classes, each_kind = [class_of[b.slots[0]] for b in plan.buckets], kinds or [None] * len(nbytes)
        merged = merge_compressed(plan.buckets, classes, ready, decide, nbytes, each_kind, fuse_bytes)
        if choices and len(merged) < len(plan.buckets):  # a merged bucket took the cheapest total
            merged = rechoose_candidates(merged, ready, alternatives)
        plan = Plan(merged)
    if fuse_bytes is not None:

        def dense_cost(size: float) -> tuple[str, float]:
            extra = dense_overhead(size) if dense_overhead is not None else 0.0
            if scheme.kind == "dense":
                return scheme.algorithm, predict(scheme, model, size, None) + extra
            algo, t = best_dense(model, size, dense_algorithm)
            return algo, t + extra

        plan = _fuse_dense(plan, nbytes, dense_cost, fuse_bytes, kinds or [None] * len(nbytes))
        plan = _gather_latency_bound(plan, nbytes, dense_cost, fuse_bytes, kinds or [None] * len(nbytes))
    return plan


def _gather_latency_bound(
    plan: Plan,
    nbytes: list[int],
    dense_cost: Callable[[float], tuple[str, float]],
    fuse_bytes: int,
    kinds: list[object],
) -> Plan:
    """Move each dense bucket whose predicted time is mostly fixed costs (more start-up than
    transfer: the biases and norms between the large compressed weights) into the next dense
    bucket of its kind, across compressed buckets. Each such bucket cost a set of collectives of
    its own (three for torus2d) and held the communication thread in order; in the later bucket
    it adds a few bytes. It launches later, with that bucket, which costs little: it was mostly
    start-up."""
    fixed = dense_cost(0.0)[1]
    buckets = list(plan.buckets)
    for i in range(len(buckets) - 2, -1, -1):
        b = buckets[i]
        size = float(sum(nbytes[s] for s in b.slots))
        if b.compress or dense_cost(size)[1] - fixed > fixed:
            continue
        j = next(
            (j for j in range(i + 1, len(buckets)) if not buckets[j].compress
             and kinds[buckets[j].slots[0]] == kinds[b.slots[0]]),
            None,
        )  # fmt: skip
        if j is None or j == i + 1:  # none, or a neighbour (already fused by size where it fits)
            continue
        later = buckets[j]
        slots = b.slots + later.slots
        total = float(sum(nbytes[s] for s in slots))
        reasons = {r for r in (b.dense_reason, later.dense_reason) if r}
        if total > fuse_bytes or len(reasons) > 1:  # one reason per bucket, for the plan's report
            continue
        algo, t = dense_cost(total)
        codec_id = max(b.codec_id, later.codec_id)
        buckets[j] = BucketPlan(
            slots, codec_id, False, 1, algo, t * 1e3, dense_reason=reasons.pop() if reasons else ""
        )
        del buckets[i]
    return Plan(buckets)


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


# ---------------------------------------------------------------------------- after the first step
DEFAULT_PARAMS = CostParams(Link(50e-6, 1 / 10e9), Link(50e-6, 8 / 10e9), 1e-10)
"""The links assumed when calibration is off (``SyncConfig.calibrate=False``): 50 us start-up,
10 GB/s inside a node and 10 Gbit/s across nodes."""


@dataclass
class FirstStep:
    """What the engine saw in its first (dense) step: the order in which the gradients became
    ready, and when (``None``: never, e.g. a parameter the forward pass did not use)."""

    order: list[int]
    ready_at: list[float | None]


def first_step_groups(
    slots: list[Slot], first: FirstStep, classes: list[int], bucket_bytes: int, timeout_s: float
) -> list[tuple[list[int], int]]:
    """Buckets in the order the first step produced the gradients (those never ready last), cut
    by size, codec class and the fusion timeout."""
    order = list(first.order)
    seen = set(order)
    order += [s.index for s in reversed(slots) if s.index not in seen]
    rel = [1e9 if t is None else t for t in relative_ready(first)]
    return build_groups(slots, order, rel, classes, bucket_bytes, timeout_s)


def relative_ready(first: FirstStep) -> list[float | None]:
    """Each gradient's ready time in seconds after the first one (None: never ready)."""
    t0 = min((t for t in first.ready_at if t is not None), default=0.0)
    return [None if t is None else t - t0 for t in first.ready_at]


def launch_ready(first: FirstStep) -> list[float]:
    """The ready times the planner's re-cut weighs (:func:`gradsync.planner.recut.merge_compressed`):
    :func:`relative_ready`, with a gradient never ready taken as ready with the last one."""
    rel = relative_ready(first)
    last = max((t for t in rel if t is not None), default=0.0)
    return [last if t is None else t for t in rel]


def decide_plan(
    topo: Topology,
    config: SyncConfig,
    scheme: Scheme,
    slots: list[Slot],
    codecs: list[Compressor],
    params: CostParams,
    first: FirstStep,
    classes: list[int],
    rejects: Callable[[int, list[int], int], str | None],
    schemes: Sequence[Scheme] | None = None,
    candidates: Sequence[int] = (),
) -> tuple[Plan, dict[int, CodecCost]]:
    """The plan for this job, from the calibrated ``params`` and the codecs' timings at the sizes
    their encode calls will see (timed on fresh copies of the codecs, on the device and in the
    dtype of the gradients they compress); and those timings. ``schemes`` and ``candidates`` as
    in :func:`make_plan`."""
    model = CostModel(params, topo.nodes, topo.per_node)
    groups = first_step_groups(slots, first, classes, config.bucket_bytes, config.bucket_timeout_ms / 1e3)
    costs = time_codecs(topo, scheme, slots, codecs, groups, schemes, candidates)
    plan = first_plan_of(model, config, scheme, slots, first, groups, costs, rejects, schemes, candidates)
    return plan, costs


def first_plan_of(
    model: CostModel,
    config: SyncConfig,
    scheme: Scheme,
    slots: list[Slot],
    first: FirstStep,
    groups: list[tuple[list[int], int]],
    costs: dict[int, CodecCost],
    rejects: Callable[[int, list[int], int], str | None],
    schemes: Sequence[Scheme] | None = None,
    candidates: Sequence[int] = (),
) -> Plan:
    """The first plan on the cluster ``model`` describes, from the first step (``first``, cut
    into ``groups``) and the codecs' timings ``costs``: the decision :func:`decide_plan` makes."""
    return make_plan(
        groups, [s.nbytes for s in slots], scheme, model, costs, config.plan, config.dense_algorithm,
        config.partitions, fuse_bytes=config.bucket_bytes, kinds=[s.group for s in slots], rejects=rejects,
        schemes=schemes, candidates=candidates, ready=launch_ready(first),
    )  # fmt: skip


def time_codecs(
    topo: Topology,
    scheme: Scheme,
    slots: list[Slot],
    codecs: list[Compressor],
    groups: list[tuple[list[int], int]],
    schemes: Sequence[Scheme] | None = None,
    candidates: Sequence[int] = (),
) -> dict[int, CodecCost]:
    """Each codec's encode and decode, timed at the smallest and the largest size its encode
    calls will see in ``groups`` (a candidate codec: in every compressible group), on a fresh
    copy, on the device and in the dtype of most of the gradients it compresses."""
    nbytes = [s.nbytes for s in slots]
    costs = {}
    timed: dict[tuple[str, tuple[int, ...], torch.dtype, torch.device], CodecCost] = {}
    for cid, codec in enumerate(codecs):
        members = [m for m, c in groups if c == cid or (c >= 0 and cid in candidates)]
        if not members:
            continue
        totals = [sum(nbytes[i] for i in m) for m in members]
        mine = scheme_for(scheme, schemes, cid)
        sizes = sorted({max(int(encode_sizes(mine, b, topo.nodes, topo.per_node)), 4) for b in totals})
        held: dict[tuple[torch.dtype, torch.device], int] = {}  # bytes per (dtype, device)
        for m in members:
            for i in m:
                held[slots[i].group] = held.get(slots[i].group, 0) + nbytes[i]
        dtype, device = max(held, key=held.__getitem__)
        ends = [sizes[0], sizes[-1]] if len(sizes) > 1 else sizes
        key = (codec.spec(), tuple(ends), dtype, device)  # candidates of one codec on other strategies
        if key not in timed:
            timed[key] = measure_codec(codec, ends, reps=3, device=device, dtype=dtype)
        costs[cid] = timed[key]
    return costs


def plan_after_first_step(
    topo: Topology,
    config: SyncConfig,
    scheme: Scheme,
    slots: list[Slot],
    codecs: list[Compressor],
    first: FirstStep,
    classes: list[int],
    rejects: Callable[[int, list[int], int], str | None],
    schemes: Sequence[Scheme] | None = None,
    candidates: Sequence[int] = (),
) -> tuple[Plan, CostParams, dict[int, CodecCost]]:
    """Calibrate the links (every rank), decide on rank 0, and give every rank rank 0's plan
    (:func:`share_plan`); also return the calibrated links (every rank has the same) and the
    codec timings (rank 0's; empty on the other ranks)."""
    params = calibrate(topo, reps=3) if config.calibrate else DEFAULT_PARAMS
    costs: dict[int, CodecCost] = {}

    def decide() -> Plan:
        plan, measured = decide_plan(
            topo, config, scheme, slots, codecs, params, first, classes, rejects, schemes, candidates
        )
        costs.update(measured)
        return plan

    plan = share_plan(topo, decide)
    assert plan is not None  # decide always makes one
    return plan, params, costs


def share_plan(topo: Topology, decide: Callable[[], Plan | None]) -> Plan | None:
    """Run ``decide`` on rank 0 and give every rank its result (None: no new plan).

    Rank 0 decides alone, so a failure there is sent to every rank in place of the plan (the
    others would otherwise wait in the broadcast): every rank raises it."""
    if topo.world == 1:  # nobody to tell (and perhaps no process group to tell it on)
        return decide()
    dev, group = topo.comm_device, topo.control_group
    error: Exception | None = None
    wire = torch.zeros(0, dtype=torch.int64, device=dev)
    status = 0  # 0: a plan, 1: a failure, 2: no plan
    if topo.rank == 0:
        try:
            plan = decide()
            if plan is None:
                status = 2
            else:
                wire = plan.to_tensor().to(dev)
        except Exception as e:
            error, status = e, 1
            wire = torch.tensor(list(f"{type(e).__name__}: {e}".encode()), dtype=torch.int64, device=dev)
    head = torch.tensor([wire.numel(), status], dtype=torch.int64, device=dev)
    dist.broadcast(head, topo.global_rank(0), group=group)  # the control group holds every rank
    size, status = head.tolist()
    if topo.rank != 0:
        wire = torch.zeros(size, dtype=torch.int64, device=dev)
    if size:
        dist.broadcast(wire, topo.global_rank(0), group=group)
    if status == 1:
        if error is not None:
            raise error
        raise RuntimeError(f"gradsync: making the plan failed on rank 0: {bytes(wire.tolist()).decode()}")
    return None if status == 2 else Plan.from_tensor(wire.cpu())
