"""FSDP2, HSDP and ``replicate``, with and without gradsync's compression, as the simulator predicts
them (the contenders ``bench fsdp`` and ``bench whatif`` measure, named the same).

Contenders: ``fsdp`` (``fully_shard`` over the whole world), ``hsdp`` (sharded inside each node,
replicated across nodes), ``replicate`` (every rank keeps whole parameters, FSDP2's data
parallelism); ``KIND/SCHEME`` compresses with gradsync (:mod:`gradsync.integrate.fsdp`): the
reduce-scatter for ``fsdp`` (each rank encodes every rank's shard of its gradient, one
all-to-all, the owner decodes and sums), the all-reduce across nodes for ``hsdp`` and
``replicate`` (the scheme's strategy on the reduced shard).

The model is cut into units as FSDP2's tutorial shards it (:func:`shard_units`): each element of
a numbered container (``blocks.3``, ``features.10``) is a unit, the rest of the parameters the
root unit. A step, per unit, in the forward order:

- forward: the unit's parameters all-gathered over the shard group (not for ``replicate``), then
  its forward compute;
- backward, in reverse: all-gathered again (FSDP2 frees them after the forward, except the
  root's), the unit's backward compute, then its gradient reduce-scattered over the shard group
  and, across nodes, all-reduced over the replicate group;
- the optimizer on the rank's shard only (1 / the shard group's size of the parameters);
- FSDP2's own work (its hooks, its copies into and out of flat buffers), where measured
  (``bench whatif`` times the sharded model's step on a world of one rank against the plain
  model's), stretches every unit's compute in proportion.

The unit's compute is cut from the profile: its backward share is the time between its last
gradient's ready offset and the previous unit's; its forward share is the forward pass in the
same proportion. Collectives run one after another on one channel (the node's links). Where
the compute is on a GPU, FSDP2 overlaps them: the next unit's all-gather is issued when a
unit's compute starts, and the reductions run while the backward pass goes on. On a CPU (the
emulated cluster, gloo) the training thread waits for every collective: nothing overlaps, and
gloo's reduce-scatter is an all-reduce of which each rank keeps its shard (measured on the
emulated 2 x 2 cluster: 37.5 MB per step left each node under ``fsdp`` where a ring
reduce-scatter would send 28.8 MB and an all-reduce 38.7 MB). The
simulator takes the compute to be on GPUs unless the host's cores are given (a finite
:class:`~gradsync.whatif.simulate.Cpu`, as ``bench whatif`` measures on the emulated cluster).

Each collective is a :class:`~gradsync.collectives.cost.CostModel` formula on the group's link
(a ring all-gather / reduce-scatter over the shard group; across nodes the per-node ranks'
streams share the cable); a compressed exchange is the planner's own prediction
(:func:`~gradsync.planner.decide.predict`) for the scheme on that group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gradsync.collectives.cost import CodecCost, CostModel, CostParams, Link
from gradsync.planner.closed_loop import scaled_codec
from gradsync.planner.decide import no_compute, predict
from gradsync.sync.fsdp_scheme import parse_fsdp_scheme
from gradsync.sync.scheme import Scheme
from gradsync.whatif.workload import Workload

SHARDED_KINDS = ("fsdp", "hsdp", "replicate")
BACKENDS = ("nccl", "gloo")

COPY_PASSES = 2
"""FSDP2's copies around each all-gather and reduce-scatter (into the flat buffer, out of it),
in passes over the unit's bytes."""


def is_sharded(name: str) -> bool:
    """``fsdp``, ``hsdp``, ``replicate``, each optionally ``/SCHEME``."""
    return name.split("/")[0].strip() in SHARDED_KINDS


def sharded_contender(name: str) -> tuple[str, str | None]:
    """``hsdp/topk:density=0.01`` -> ("hsdp", "topk:density=0.01"), checked as gradsync's FSDP2
    compression checks it (``ValueError`` naming the contender otherwise)."""
    kind, slash, scheme = name.strip().partition("/")
    if kind not in SHARDED_KINDS:
        raise ValueError(f"contender {name!r}: the kind must be one of {', '.join(SHARDED_KINDS)}")
    if not slash:
        return kind, None
    if not scheme.strip():
        raise ValueError(f"contender {name!r}: give a scheme after the slash, e.g. {kind}/topk:density=0.01")
    try:
        parse_fsdp_scheme(scheme.strip())
    except ValueError as e:
        raise ValueError(f"contender {name!r}: {e}") from None
    return kind, scheme.strip()


def unit_of(name: str) -> str:
    """The unit a parameter belongs to: ``blocks.3.attn.weight`` -> ``blocks.3``; a parameter
    outside numbered containers -> ``""`` (the root)."""
    parts = name.split(".")
    for i in range(1, len(parts) - 1):
        if parts[i].isdigit():
            return ".".join(parts[: i + 1])
    return ""


def shard_units(names: list[str]) -> list[str]:
    """The units FSDP2 shards a model with parameters ``names`` into, in registration order; the
    root (``""``) first. Each element of a numbered container (``nn.ModuleList``,
    ``nn.Sequential``) that holds parameters is a unit."""
    out = [""]
    for n in names:
        u = unit_of(n)
        if u not in out:
            out.append(u)
    return out


@dataclass
class ShardedStep:
    step_s: float
    cable_bytes: float
    comm_s: float  # collectives' time (channel busy)
    exposed_s: float  # the step beyond its compute
    notes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class _Unit:
    name: str
    nbytes: float
    forward_s: float
    backward_s: float
    root: bool


def _units(workload: Workload) -> tuple[list[_Unit], float]:
    """The units in forward order, with their bytes and compute; and the backward's time after
    the last gradient (no unit's)."""
    names = [t.name for t in workload.tensors]
    order = shard_units(names)
    size = dict.fromkeys(order, 0.0)
    last = dict.fromkeys(order, -math.inf)
    for t in workload.tensors:
        if t.ready is None:
            continue
        u = unit_of(t.name)
        size[u] += t.nbytes
        last[u] = max(last[u], t.ready)
    have = [u for u in order if size[u] > 0]
    by_ready = sorted(have, key=lambda u: last[u])
    share: dict[str, float] = {}
    at = 0.0
    for u in by_ready:
        share[u] = max(last[u] - at, 0.0)
        at = max(at, last[u])
    tail = max(workload.backward - at, 0.0)
    total = sum(share.values())
    if total > 0:
        units = [_Unit(u, size[u], workload.forward * share[u] / total, share[u], u == "") for u in have]
        return units, tail
    nb = sum(size[u] for u in have) or 1.0  # no ready offsets to cut at: by size
    units = [
        _Unit(u, size[u], workload.forward * size[u] / nb, workload.backward * size[u] / nb, u == "")
        for u in have
    ]
    return units, 0.0


def _all_to_all(model: CostModel, piece_bytes: float) -> float:
    """Every rank sends a ``piece_bytes`` piece to every other rank (the world): p - 1 start-ups;
    across nodes each cable carries its ranks' pieces to the other nodes' ranks."""
    p, n = model.p, model.n
    if p <= 1:
        return 0.0
    if model.m <= 1:
        i = model.params.intra
        return (p - 1) * (i.alpha + piece_bytes * i.beta) + model.calls(1)
    o = model.params.inter
    return (p - 1) * o.alpha + n * (p - n) * piece_bytes * o.beta + model.calls(1)


def _across(model: CostModel) -> CostModel:
    """The replicate group across nodes as a cluster of its own: one rank per node, the node's
    per-node ranks' streams sharing the cable."""
    o = model.params.inter
    shared = replace(model.params, inter=Link(o.alpha, o.beta * model.n))
    return CostModel(shared, model.m, 1)


@dataclass
class _Collectives:
    """One unit's collectives: seconds (on the channel) and cable bytes (one direction)."""

    gather_s: float = 0.0
    reduce_s: float = 0.0
    gather_cable: float = 0.0
    reduce_cable: float = 0.0


def _unit_collectives(
    kind: str, scheme: Scheme | None, codec: CodecCost | None, u: _Unit, model: CostModel,
    bytes_model: CostModel, gamma: float, backend: str,
) -> _Collectives:  # fmt: skip
    m, n, p = model.m, model.n, model.p
    s = u.nbytes
    c = _Collectives()
    if kind == "replicate":
        if p > 1:
            if scheme is None:
                c.reduce_s = model.flat(s)
                c.reduce_cable = bytes_model.flat(s)
            else:
                assert codec is not None
                c.reduce_s = predict(scheme, model, s, codec)
                c.reduce_cable = predict(scheme, bytes_model, s, no_compute(codec))
        return c
    g = p if kind == "fsdp" else n  # the shard group
    link = model.world_link if kind == "fsdp" else model.params.intra
    blink = bytes_model.world_link if kind == "fsdp" else bytes_model.params.intra
    if g > 1:
        c.gather_s = model.shard_step(s, g, link) + COPY_PASSES * gamma * s
        c.gather_cable = bytes_model.shard_step(s, g, blink)
        if kind == "fsdp" and scheme is not None:
            assert codec is not None
            piece = codec.payload(s / p)
            c.reduce_s = (
                codec.encode(s) + _all_to_all(model, piece) + (p - 1) * codec.decode(s / p)
                + gamma * s + COPY_PASSES * gamma * s
            )  # fmt: skip
            c.reduce_cable = _all_to_all(bytes_model, piece)
        elif backend == "gloo":  # gloo's reduce-scatter: an all-reduce, each rank keeping its shard
            c.reduce_s = model.ring_allreduce(s, g, link) + COPY_PASSES * gamma * s
            c.reduce_cable = bytes_model.ring_allreduce(s, g, blink)
        else:
            rs = model.shard_step(s, g, link) + (g - 1) / g * s * gamma
            c.reduce_s = rs + COPY_PASSES * gamma * s
            c.reduce_cable = bytes_model.shard_step(s, g, blink)
    if kind == "hsdp" and m > 1:
        shard = s / n
        across, across_bytes = _across(model), _across(bytes_model)
        if scheme is None:
            c.reduce_s += across.flat(shard)
            c.reduce_cable += across_bytes.flat(shard)
        else:
            assert codec is not None
            mine = scheme.resolve(m, 1)
            c.reduce_s += predict(mine, across, shard, codec)
            c.reduce_cable += predict(mine, across_bytes, shard, no_compute(codec))
    return c


def sharded_codec_spec(name: str) -> str | None:
    """The codec spec a sharded contender runs (error feedback added where biased), None if dense."""
    _, scheme = sharded_contender(name)
    if scheme is None:
        return None
    built = parse_fsdp_scheme(scheme).build()
    return built.spec() if built is not None else None


def sharded_step(
    name: str, workload: Workload, params: CostParams, nodes: int, per_node: int,
    costs: Callable[[str, list[float]], CodecCost], slowdown: float = 1.0, backend: str = "nccl",
    own_work_s: float = 0.0,
) -> ShardedStep:  # fmt: skip
    """One step of the sharded contender ``name`` (see the module docstring). ``slowdown``: the
    compute's contention factor (every rank of a host busy at once); ``backend``: ``nccl``
    (GPUs: FSDP2 overlaps collectives with compute) or ``gloo`` (CPUs: nothing overlaps, and the
    reduce-scatter is an all-reduce); ``own_work_s``: FSDP2's own work
    per step on the training thread (its hooks and copies, as measured on a world of one rank by
    ``bench whatif``), spread over the units' compute in proportion."""
    kind, scheme_text = sharded_contender(name)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    overlap = backend == "nccl"
    model = CostModel(params, nodes, per_node)
    bytes_model = CostModel(CostParams(Link(0.0, 0.0), Link(0.0, 1.0), 0.0), nodes, per_node)
    scheme = parse_fsdp_scheme(scheme_text).resolve(nodes, per_node) if scheme_text else None
    spec = sharded_codec_spec(name)
    units, tail = _units(workload)
    sizes = [u.nbytes / (per_node if kind == "hsdp" else 1) for u in units]
    codec = costs(spec, sizes) if spec is not None else None
    if codec is not None:
        codec = scaled_codec(codec, slowdown, slowdown)
    gamma = params.gamma * slowdown
    coll = [_unit_collectives(kind, scheme, codec, u, model, bytes_model, gamma, backend) for u in units]
    # FSDP2's own work (hooks, copies) stretches every unit's compute in proportion
    stretch = 1.0 + own_work_s / max(workload.forward + workload.backward, 1e-12)
    channel = 0.0  # when the links are next free
    comm_busy = 0.0

    def run_collective(issue: float, seconds: float) -> float:
        nonlocal channel, comm_busy
        start = max(channel, issue)
        channel = start + seconds
        comm_busy += seconds
        return channel

    t = workload.data * slowdown
    # forward: all-gather, compute; prefetching the next unit's all-gather where it overlaps
    issued: dict[int, float] = {}
    if units:
        issued[0] = run_collective(t, coll[0].gather_s)
    for i, u in enumerate(units):
        ready = issued[i] if i in issued else run_collective(t, coll[i].gather_s)
        t = max(t, ready)
        if overlap and i + 1 < len(units):
            issued[i + 1] = run_collective(t, coll[i + 1].gather_s)
        t += u.forward_s * stretch * slowdown
    # backward, in reverse; the root's parameters stay gathered after the forward
    back = list(reversed(range(len(units))))
    gathered: dict[int, float] = {}

    def gather(j: int, issue: float) -> float:
        return t if units[j].root else run_collective(issue, coll[j].gather_s)

    if back:
        gathered[back[0]] = gather(back[0], t)
    reductions_done = t
    for k, i in enumerate(back):
        ready = gathered[i] if i in gathered else gather(i, t)
        t = max(t, ready)
        if overlap and k + 1 < len(back):
            gathered[back[k + 1]] = gather(back[k + 1], t)
        t += units[i].backward_s * stretch * slowdown
        done = run_collective(t, coll[i].reduce_s)
        reductions_done = max(reductions_done, done)
        if not overlap:
            t = done
    t += tail * slowdown
    t = max(t, reductions_done)
    shard_group = {"fsdp": nodes * per_node, "hsdp": per_node, "replicate": 1}[kind]
    t += workload.optimizer * slowdown / shard_group
    compute = (workload.step + own_work_s - workload.optimizer * (1 - 1 / shard_group)) * slowdown
    gather_cable = sum(c.gather_cable for c in coll)
    gather_cable += sum(c.gather_cable for c, u in zip(coll, units, strict=True) if not u.root)
    cable = gather_cable + sum(c.reduce_cable for c in coll)
    notes = [
        f"{len(units)} units ({'overlapped' if overlap else 'serial'}); collectives {comm_busy * 1e3:.1f} ms"
    ]
    return ShardedStep(t, cable if nodes > 1 else 0.0, comm_busy, max(t - compute, 0.0), notes)
