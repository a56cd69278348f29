"""Each contender's step, as the simulator runs it: its buckets and the tasks each bucket submits.

Contenders (the names ``gradsync whatif --scheme`` and ``bench train --contenders`` share):

- ``local``: no synchronization (the compute alone, under the same contention);
- ``ddp``, ``ddp-fp16``, ``ddp-powersgd[:rank=R]``: PyTorch DDP with its default buckets
  (rebuilt in the first step's ready order: a first bucket of 1 MiB, then 25 MiB; every bucket
  all-reduced by one flat ring, in order) and its own communication hooks. The hooks compress on
  the training thread (the autograd engine calls them), their callbacks decode after the
  collective;
- ``horovod``: the network-bottleneck paper's setting, Horovod's tensor fusion (a fused buffer
  closes at 64 MB or 5 ms after its first gradient, whichever is first; then one flat ring
  all-reduce, alpha included);
- ``paper02[:ratio=R]``: the network-bottleneck paper's own simulator: Horovod's fusion and its
  latency-free ring formula, the transfer divided by a compression ratio R that costs nothing (its
  Figure 8);
- any gradsync scheme (``hierarchical``, ``hitopk:density=0.01``, ``powersgd:rank=4``, ``auto``,
  with ``--sync-option`` settings): gradsync's engine, with its own bucketing
  (:func:`gradsync.planner.decide.first_step_groups`) and its planner's decisions
  (:func:`gradsync.planner.decide.make_plan`) made from the simulated cluster's cost model and the
  codec's measured cost. Each bucket (or each of its parts) is a task: pack and encode on the
  compute thread, the scheme's collectives on the communication thread, decode and unpack on the
  compute thread. How a part's predicted time splits into encode, communication and decode is
  read off the same formula (:func:`gradsync.planner.decide.split_prediction`, from which the
  planner's order of work takes its stages too).

Every collective's time is a :class:`gradsync.collectives.cost.CostModel` formula: the planner,
``bench collectives`` and this simulator share them.

References:

- network-bottleneck paper: Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gradsync.collectives.cost import CodecCost, CostModel, CostParams, Link, powersgd_hook_split
from gradsync.collectives.dense import dense_algorithm_names
from gradsync.planner.closed_loop import plan_seconds
from gradsync.planner.decide import (
    FirstStep,
    codec_work,
    first_step_groups,
    launch_ready,
    lowrank_steps,
    make_plan,
    no_compute,
    predict,
    split_prediction,
)
from gradsync.planner.plan import Plan
from gradsync.planner.trials import codec_families, trial_plans
from gradsync.sync.buckets import Slot, build_groups, codec_class_for
from gradsync.sync.codec_set import scheme_codecs
from gradsync.sync.config import SyncConfig
from gradsync.sync.scheme import Scheme
from gradsync.whatif.modes import (
    is_outer,
    is_self_syncing,
    outer_codec_spec,
    outer_options,
    self_syncing_exchange,
    self_syncing_options,
)
from gradsync.whatif.sharded import is_sharded, sharded_codec_spec, sharded_contender
from gradsync.whatif.simulate import COMM, COMPUTE, MAIN, Stage, StepProgram, Task
from gradsync.whatif.workload import Workload

DDP_BUCKET_BYTES = 25 << 20
DDP_FIRST_BUCKET_BYTES = 1 << 20
HOROVOD_FUSION_BYTES = 64 << 20
HOROVOD_CYCLE_S = 5e-3
STEP_CHECK_BYTES = 5 * 8  # the engine's per-step agreement check: five int64 words
BASELINES = ("local", "ddp", "ddp-fp16", "horovod")

CodecCosts = Callable[[str, list[float]], CodecCost]
"""``costs(codec spec, sizes in bytes) -> CodecCost`` at the target device's speed."""


@dataclass(frozen=True)
class Cluster:
    nodes: int
    per_node: int
    params: CostParams

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def model(self) -> CostModel:
        return CostModel(self.params, self.nodes, self.per_node)

    def host_model(self) -> CostModel:
        """The same formulas with the node cable free: what the host itself spends, the links
        inside the node and the reductions (on the emulated cluster both are CPU work of this
        machine, slowed by contention like any compute)."""
        p = self.params
        inside = tuple(e for e in p.efficiency if e[0].startswith("tree/"))  # the node-internal trees
        host = CostParams(p.intra, Link(0.0, 0.0), p.gamma, call=p.call, efficiency=inside)
        return CostModel(host, self.nodes, self.per_node)

    def bytes_model(self) -> CostModel:
        """The same formulas with the node cable at 1 s per byte and everything else free: their
        value is the bytes one node's cable carries (in each direction)."""
        return CostModel(CostParams(Link(0.0, 0.0), Link(0.0, 1.0), 0.0), self.nodes, self.per_node)


MODE_FAMILIES = (
    "local, ddp, ddp-fp16, ddp-powersgd[:rank=N], horovod, paper02[:ratio=R], a dense algorithm "
    "(hierarchical, torus2d, ... with /fp16 or /bf16), auto[:candidates=...], a compressed scheme "
    "(hitopk:density=D, powersgd:rank=R, STRATEGY[+local]/CODEC or a codec), onebit-adam, "
    "zeroone-adam, onebit-lamb (@KEY=VALUE options), outer@every=H[@codec=SPEC@fragments=F@delay=D], "
    "fsdp, hsdp, replicate[/SCHEME]"
)
"""The contender families ``--scheme`` takes (docs/whatif.md), named when a name is none of them."""


def check_contender(name: str) -> str:
    """The contender's name if it is one (``ValueError`` naming ``--scheme`` otherwise; a name
    that is no family at all is told every family)."""
    try:
        kind(name)
    except ValueError as e:
        text = str(e)
        if text.startswith("unknown codec"):
            head = name.split(":")[0].split("/")[0].strip()
            hint = (
                f" ({head} is a dense algorithm: {head}/fp16 or {head}/bf16 sends half precision)"
                if (head in dense_algorithm_names())
                else ""
            )
            text = f"not a contender{hint}; the families: {MODE_FAMILIES}; or a codec: {text}"
        raise ValueError(f"--scheme {name!r}: {text}") from None
    return name


def kind(name: str) -> str:
    """``local``, ``ddp``, ``horovod``, ``paper02``, ``outer``, ``self-syncing``, ``sharded`` or
    ``gradsync``; validates the options."""
    if name in ("local", "horovod"):
        return name
    if is_outer(name):
        outer_options(name)
        return "outer"
    if is_self_syncing(name):
        self_syncing_options(name)
        return "self-syncing"
    if is_sharded(name):
        sharded_contender(name)
        return "sharded"
    if name in ("ddp", "ddp-fp16"):
        return "ddp"
    if name.startswith("ddp-powersgd"):
        powersgd_rank(name)
        return "ddp"
    if name.startswith("paper02"):
        paper02_ratio(name)
        return "paper02"
    Scheme.parse(name)
    return "gradsync"


def _option(name: str, prefix: str, key: str, default: float, parse: Callable[[str], float]) -> float:
    rest = name[len(prefix) :]
    if rest == "":
        return default
    k, eq, value = rest.lstrip(":").partition("=")
    try:
        v = parse(value)
    except ValueError:
        v = math.nan
    if not rest.startswith(":") or k != key or not eq or not (v >= 1):
        raise ValueError(f"expected {prefix} or {prefix}:{key}=N with N >= 1")
    return v


def powersgd_rank(name: str) -> int:
    return int(_option(name, "ddp-powersgd", "rank", 1, int))


def paper02_ratio(name: str) -> float:
    return _option(name, "paper02", "ratio", 1.0, float)


def ddp_buckets(workload: Workload, order: list[int], cap: int, first: int) -> list[list[int]]:
    """DDP's rebuilt buckets: tensors in ready order, one bucket per dtype open at a time, closed
    once it holds its size limit (``first`` bytes for the first bucket of a dtype, ``cap`` after)."""
    open_: dict[int, list[int]] = {}
    size: dict[int, int] = {}
    count: dict[int, int] = {}
    out: list[tuple[int, list[int]]] = []
    for pos, i in enumerate(order):
        k = workload.tensors[i].itemsize
        open_.setdefault(k, []).append(i)
        size[k] = size.get(k, 0) + workload.tensors[i].nbytes
        limit = first if count.get(k, 0) == 0 else cap
        if size[k] >= limit:
            out.append((pos, open_.pop(k)))
            size[k], count[k] = 0, count.get(k, 0) + 1
    out += [(order.index(m[-1]), m) for m in open_.values()]
    return [m for _, m in sorted(out, key=lambda x: x[0])]


HOST_COMM_CONTENDS = True
"""Whether the node-internal part of a collective (loopback transfers, reductions) is slowed by CPU
contention like compute (only where the host's cores are bounded: CPU training, the emulated
cluster). On such a host every byte a node moves inside itself is a copy on the cores its
workers compute on. :func:`~gradsync.collectives.cost.calibrate` times the node's links on one
node alone, as the profile times one worker alone, and the simulator adds the contention. (Until
issue 44 the links were timed with every node at once, which already held the other node's
contention, and this was False: contended on top of that, PowerSGD's intra-node reduce and
broadcast came out 2x too slow; uncontended, the outer loops' inner all-reduce inside the node
came out 19-23 % fast. docs/whatif.md has both.)"""


def comm_stages(label: str, total: float, host: float, nbytes: float) -> list[Stage]:
    """A collective of ``total`` seconds, of which ``host`` (at most) are the node's own links and
    reductions (CPU work when :data:`HOST_COMM_CONTENDS`), the rest is the cable's time."""
    host = min(max(host, 0.0), total)
    out = []
    if host > 0:
        args = {"bytes": nbytes, "in_node": True}  # (Cpu.transfer_weight)
        out.append(Stage(COMM, host, f"{label} (in node)", HOST_COMM_CONTENDS, args))
    if total - host > 0 or not out:
        out.append(Stage(COMM, total - host, label, False, {"bytes": nbytes}))
    out[0].args["call"] = True  # the collective's start (see Cpu.busy_call)
    return out


FLAT = Scheme("", "dense", "flat")


def ring(model: CostModel, nbytes: float) -> float:
    """One flat ring all-reduce of ``nbytes`` over the world, with the efficiency the engine
    measured for all-reduces of that size (:attr:`CostParams.efficiency`)."""
    return predict(FLAT, model, nbytes, None)


def _meta_slots(workload: Workload) -> list[Slot]:
    dtypes = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
    slots = []
    for i, t in enumerate(workload.tensors):
        dtype = dtypes.get(t.itemsize, torch.float32) if t.floating else torch.int64
        slots.append(Slot(i, t.name, torch.empty(t.numel, dtype=dtype, device="meta")))
    return slots


def _bytes_of(workload: Workload, members: list[int]) -> float:
    return float(sum(workload.tensors[i].nbytes for i in members))


def build_program(
    name: str,
    workload: Workload,
    cluster: Cluster,
    costs: CodecCosts,
    sync_options: dict[str, str] | None = None,
    ddp_bucket_bytes: int = DDP_BUCKET_BYTES,
    hook_rate: float | None = None,
    exchange: bool = True,
    allowed: tuple[int, ...] | None = None,
) -> StepProgram:
    """The simulated step of contender ``name`` (see the module docstring). ``hook_rate``: for
    PyTorch's PowerSGD hook, its work as measured running (seconds per byte of a bucket,
    :func:`gradsync.observe.hook_costs.powersgd_hook_rate`) instead of gradsync's codec's timing;
    for a self-syncing optimizer, its own step's work beyond the profiled optimizer's (seconds per
    gradient byte). ``exchange`` False: a self-syncing optimizer's step without its exchange (0/1
    Adam's local step). ``allowed``: a gradsync contender's plan with only those codec ids (a
    trial of the closed loop, :func:`trial_families`)."""
    k = kind(name)
    order = workload.ready_order()
    model, bytes_model, host = cluster.model(), cluster.bytes_model(), cluster.host_model()
    gamma = cluster.params.gamma
    prog = StepProgram(name, per_node=cluster.per_node)
    if k == "local" or cluster.world == 1:
        return prog
    if k in ("horovod", "paper02"):
        slots = _meta_slots(workload)
        ready = [t.ready if t.ready is not None else 0.0 for t in workload.tensors]
        groups = build_groups(slots, order, ready, [-1] * len(slots), HOROVOD_FUSION_BYTES, HOROVOD_CYCLE_S)
        prog.hold_s = HOROVOD_CYCLE_S
        ratio = paper02_ratio(name) if k == "paper02" else 1.0
        for b, (members, _) in enumerate(groups):
            s = _bytes_of(workload, members)
            prog.buckets.append(members)
            prog.full.append(s >= HOROVOD_FUSION_BYTES)
            if k == "paper02":
                t, own, cable = (
                    model.paper02_ring(s, ratio),
                    host.paper02_ring(s),
                    bytes_model.flat(s) / ratio,
                )
            else:  # Horovod copies into and out of its fusion buffer around the ring
                t, own, cable = (
                    ring(model, s) + 2 * gamma * s,
                    host.flat(s) + 2 * gamma * s,
                    bytes_model.flat(s),
                )
            prog.bucket_tasks.append([Task(f"fused {b}", b, comm_stages("allreduce", t, own, s))])
            prog.cable_bytes += cable
        return prog
    if k in ("outer", "sharded"):
        raise ValueError(f"contender {name!r}: predicted by predict.simulate_contender, not as buckets")
    if k == "self-syncing":
        return _self_syncing_program(name, workload, model, host, bytes_model, costs, hook_rate, exchange)
    if k == "ddp":
        return _ddp_program(
            name, workload, order, model, bytes_model, host, costs, ddp_bucket_bytes, gamma, hook_rate
        )
    return _gradsync_program(
        name, workload, order, cluster, model, bytes_model, host, costs, sync_options or {}, allowed
    )


FLAG_BYTES = 4
"""Per parameter tensor, the self-syncing optimizers' "had a gradient" flag (float32), all-reduced
every step before the exchange."""


def _self_syncing_program(
    name: str, workload: Workload, model: CostModel, host: CostModel, bytes_model: CostModel,
    costs: CodecCosts, work_rate: float | None = None, exchange: bool = True,
) -> StepProgram:  # fmt: skip
    """A self-syncing optimizer's compressed step (see :mod:`gradsync.whatif.modes`): nothing during
    the backward pass; after it, the flags' all-reduce, then the momentum's encode, exchange and
    decode on the training thread (the optimizer's step runs them). ``work_rate``: the optimizer's
    own step beyond the profiled optimizer's, measured running alone (seconds per gradient byte:
    its moments, its flat buffers' copies), charged on the training thread before the exchange.
    ``exchange`` False: 0/1 Adam's local step, its own work alone."""
    scheme, spec = self_syncing_exchange(name)
    scheme = scheme.resolve(model.m, model.n)
    prog = StepProgram(name, per_node=model.n)
    s = float(workload.nbytes)
    own_work = [Stage(MAIN, work_rate * s, "optimizer's own step")] if work_rate else []
    if not exchange:
        if own_work:
            prog.end_tasks.append(Task("local step", -1, own_work))
        prog.notes.append("a local step: no exchange")
        return prog
    c = costs(spec, [s])
    enc, comm, dec = split_prediction(scheme, model, s, c)
    own = predict(scheme, host, s, no_compute(c))
    flags = FLAG_BYTES * sum(1 for t in workload.tensors if t.ready is not None)
    stages = [
        *own_work,
        *comm_stages("flags", ring(model, flags), host.flat(flags), flags),
        Stage(MAIN, enc, "momentum encode"),
        *comm_stages(f"momentum {scheme.name}", comm, own, s),
        Stage(MAIN, dec, "momentum decode"),
    ]
    prog.end_tasks.append(Task("momentum exchange", -1, stages))
    prog.cable_bytes = bytes_model.flat(flags) + predict(scheme, bytes_model, s, no_compute(c))
    prog.notes.append(f"momentum as {spec} over {scheme.name}, after the backward pass")
    return prog


def _ddp_program(
    name: str, workload: Workload, order: list[int], model: CostModel, bytes_model: CostModel,
    host: CostModel, costs: CodecCosts, cap: int, gamma: float, hook_rate: float | None = None,
) -> StepProgram:  # fmt: skip
    prog = StepProgram(name, per_node=model.n)
    prog.buckets = ddp_buckets(workload, order, cap, min(DDP_FIRST_BUCKET_BYTES, cap))
    prog.full = [True] * len(prog.buckets)
    total = 0.0
    for b, members in enumerate(prog.buckets):
        s = _bytes_of(workload, members)
        total += s
        copy_in = Stage(MAIN, gamma * s, "copy into bucket")  # gradient_as_bucket_view=False
        if name == "ddp":
            stages = [copy_in, *comm_stages("allreduce", ring(model, s), host.flat(s), s)]
            prog.cable_bytes += bytes_model.flat(s)
        elif name == "ddp-fp16":
            stages = [
                copy_in, Stage(MAIN, gamma * s, "fp16 compress"),
                *comm_stages("allreduce", ring(model, s / 2), host.flat(s / 2), s / 2),
                Stage(COMM, gamma * s, "fp16 decompress"),
            ]  # fmt: skip
            prog.cable_bytes += bytes_model.flat(s / 2)
        else:
            stages = _powersgd_hook(name, workload, members, model, bytes_model, host, costs, prog, hook_rate)
            stages.insert(0, copy_in)
        prog.bucket_tasks.append([Task(f"bucket {b}", b, stages)])
    prog.after_sync = gamma * total  # the bucket copied back into the gradients
    return prog


def _powersgd_hook(
    name: str, workload: Workload, members: list[int], model: CostModel, bytes_model: CostModel,
    host: CostModel, costs: CodecCosts, prog: StepProgram, hook_rate: float | None = None,
) -> list[Stage]:  # fmt: skip
    """PyTorch's PowerSGD hook on one bucket: the tensors it leaves uncompressed all-reduced as they
    are; the matrices' P = M Q computed in the hook and all-reduced, then (in the callback)
    orthogonalized, Q = M^T P computed and all-reduced, and M = P Q^T decoded. Which tensors are
    matrices and how large P and Q are follow the hook's own rule, tensor by tensor
    (:func:`gradsync.collectives.cost.powersgd_hook_split`: by shape, with its minimum compression
    rate of 2).

    The compute is gradsync's PowerSGD codec's measured cost at the matrices' size, half of its
    encode before each factor's all-reduce, its decode at the end; with ``hook_rate`` (the hook's
    own work measured as it runs, seconds per bucket byte: error feedback, copies, the per-tensor
    products and orthogonalization) that total, split in the same proportions."""
    rank = powersgd_rank(name)
    tensors = [workload.tensors[i] for i in members]
    split = powersgd_hook_split([t.dims for t in tensors], rank, tensors[0].itemsize if tensors else 4)
    c = costs(f"powersgd:rank={rank}", [split.matrices])
    encode, decode = c.encode(split.matrices), c.decode(split.matrices)
    if hook_rate is not None:
        total = hook_rate * _bytes_of(workload, members)
        share = encode / (encode + decode) if encode + decode > 0 else 0.5
        encode, decode = total * share, total * (1 - share)

    def allreduce(label: str, nbytes: float) -> list[Stage]:  # the hook makes all three calls, empty or not
        prog.cable_bytes += bytes_model.flat(nbytes)
        return comm_stages(label, ring(model, nbytes), host.flat(nbytes), nbytes)

    return [
        Stage(MAIN, encode / 2, "compute P"),
        *allreduce("allreduce uncompressed", split.dense),
        *allreduce("allreduce P", split.p),
        Stage(COMM, encode / 2, "orthogonalize, compute Q"),
        *allreduce("allreduce Q", split.q),
        Stage(COMM, decode, "decompress"),
    ]


def lowrank_stages(
    scheme: Scheme, model: CostModel, host: CostModel, nbytes: float, c: CodecCost, gamma: float
) -> list[Stage]:
    """A PowerSGD bucket as the engine runs it: the planner's steps
    (:func:`gradsync.planner.decide.lowrank_steps`: two projections and two all-reduces, the
    decode, with local aggregation a reduce before and a broadcast after), each collective's node
    part read off the same steps on the node's own links, the pack and the unpack at the host's
    copy rate. With local aggregation the steps between the reduce and the broadcast are marked as
    the node's leader's: the others wait for its broadcast."""
    steps = lowrank_steps(scheme, model, nbytes, c)
    own = lowrank_steps(scheme, host, nbytes, codec_work(c, False, False))
    local = bool(scheme.local) and model.n > 1
    out = []
    for i, ((label, seconds), (_, mine)) in enumerate(zip(steps, own, strict=True)):
        if label in ("pack", "unpack"):
            out.append(Stage(COMPUTE, gamma * nbytes, label))
        elif i % 2 == 0:
            if label:  # (not the empty step between a reduce and a broadcast on one node)
                out.append(Stage(COMPUTE, seconds, label))
        else:
            moved = nbytes if label in ("reduce", "broadcast") else c.payload(nbytes) / 2
            out += comm_stages(label, seconds, mine, moved)
    if not local:
        return [Stage(COMPUTE, gamma * nbytes, "pack"), *out, Stage(COMPUTE, gamma * nbytes, "unpack")]
    for st in out[1:-1]:  # the node's leader alone, on the node's sum; the others wait for its broadcast
        if not st.label.startswith(("reduce", "broadcast")):
            st.args["leaders"] = True
    return out


@dataclass
class _Planning:
    """What gradsync's planner sees of a contender on the simulated cluster, and how it plans."""

    config: SyncConfig
    scheme: Scheme
    schemes: list[Scheme]  # per codec id
    codecs: list[str]  # each codec id's spec, as the engine runs it (+ef)
    codec_costs: dict[int, CodecCost]
    make: Callable[[tuple[int, ...] | None], Plan]  # a plan, with only those codec ids (None: any)
    price: Callable[[Plan], float]  # the planner's predicted span of a plan
    candidates: list[int]


def _planning(
    name: str, workload: Workload, order: list[int], cluster: Cluster, model: CostModel, costs: CodecCosts,
    options: dict[str, str],
) -> _Planning:  # fmt: skip
    config = SyncConfig.from_options({"scheme": name, **options})
    scheme = Scheme.parse(config.scheme).resolve(cluster.nodes, cluster.per_node)
    slots = _meta_slots(workload)
    built = scheme_codecs(config, scheme, (cluster.nodes, cluster.per_node))
    codecs = [c.spec() for c in built.classes]  # as the engine runs them (+ef)
    classes = [
        codec_class_for(s.nbytes, workload.tensors[s.index].floating, len(codecs), config.min_compress_bytes,
                        config.large_bytes)
        for s in slots
    ]  # fmt: skip
    schemes = [scheme] * len(codecs)  # the scheme of each codec id, then the other candidates'
    candidates = []
    for alt, codec in built.candidates:
        candidates.append(len(codecs))
        schemes.append(alt)
        codecs.append(codec.spec())
    ready = [t.ready for t in workload.tensors]
    groups = first_step_groups(
        slots, FirstStep(order, ready), classes, config.bucket_bytes, config.bucket_timeout_ms / 1e3
    )
    sizes: dict[int, list[float]] = {}
    for members, cid in groups:
        for held in [cid, *candidates] if cid >= 0 else []:
            sizes.setdefault(held, []).append(_bytes_of(workload, members))
    codec_costs = {cid: costs(codecs[cid], sizes[cid]) for cid in sizes}
    nbytes = [s.nbytes for s in slots]
    launch = launch_ready(FirstStep(order, ready))

    def make(allowed: tuple[int, ...] | None) -> Plan:
        return make_plan(
            groups, nbytes, scheme, model, codec_costs, config.plan, config.dense_algorithm,
            config.partitions, fuse_bytes=config.bucket_bytes, kinds=[s.group for s in slots],
            schemes=schemes, candidates=candidates, ready=launch, allowed=allowed,
        )  # fmt: skip

    def price(plan: Plan) -> float:
        return plan_seconds(plan, nbytes, scheme, model, codec_costs, None, schemes, launch)

    return _Planning(config, scheme, schemes, codecs, codec_costs, make, price, candidates)


def trial_families(
    name: str,
    workload: Workload,
    cluster: Cluster,
    costs: CodecCosts,
    sync_options: dict[str, str] | None = None,
) -> list[tuple[str, tuple[int, ...]]]:
    """The codec families whose plans gradsync's closed loop would measure after its first plan
    (:mod:`gradsync.planner.trials`, ``replan_trials``; none without candidates, or with the loop
    off), fastest predicted first, each as (codec spec, its codec ids for ``build_program``'s
    ``allowed``)."""
    if kind(name) != "gradsync" or cluster.world == 1:
        return []
    pl = _planning(
        name, workload, workload.ready_order(), cluster, cluster.model(), costs, sync_options or {}
    )
    cfg = pl.config
    families = codec_families(pl.codecs, pl.candidates)
    if not families or cfg.plan != "auto" or cfg.replan <= 0 or cfg.replan_trials <= 0:
        return []
    found = trial_plans(families, pl.make, pl.price, [pl.make(None)], count=cfg.replan_trials)
    return [(family, families[family]) for family, _, _ in found]


def _gradsync_program(
    name: str, workload: Workload, order: list[int], cluster: Cluster, model: CostModel,
    bytes_model: CostModel, host: CostModel, costs: CodecCosts, options: dict[str, str],
    allowed: tuple[int, ...] | None = None,
) -> StepProgram:  # fmt: skip
    pl = _planning(name, workload, order, cluster, model, costs, options)
    config, scheme, schemes, codec_costs = pl.config, pl.scheme, pl.schemes, pl.codec_costs
    prog = StepProgram(name, per_node=cluster.per_node)
    slots = _meta_slots(workload)
    gamma = cluster.params.gamma
    plan = pl.make(allowed)
    for b, bp in enumerate(plan.buckets):
        members = [m for m in bp.slots if workload.tensors[m].ready is not None]
        if not members:
            continue
        s = _bytes_of(workload, members)
        prog.buckets.append(members)
        prog.full.append(True)
        tasks: list[Task] = []
        if not bp.compress:
            dense = (
                Scheme("", "dense", scheme.algorithm, scheme.comm_dtype)
                if scheme.kind == "dense"
                else Scheme("", "dense", bp.dense_algorithm)
            )
            t = predict(dense, model, s, None)
            stages = [
                Stage(COMPUTE, gamma * s, "pack"),
                *comm_stages(dense.algorithm, t, predict(dense, host, s, None), s),
                Stage(COMPUTE, gamma * s, "unpack"),
            ]
            prog.cable_bytes += predict(dense, bytes_model, s, None)
            tasks.append(Task(f"bucket {b}", b, stages))
        elif codec_costs[bp.codec_id].lowrank:
            c, mine = codec_costs[bp.codec_id], schemes[bp.codec_id]
            prog.cable_bytes += predict(mine, bytes_model, s, codec_work(c, False, False))
            tasks.append(Task(f"bucket {b}", b, lowrank_stages(mine, model, host, s, c, gamma)))
        else:
            c, mine = codec_costs[bp.codec_id], schemes[bp.codec_id]
            part = s / bp.partitions
            enc, comm, dec = split_prediction(mine, model, part, c)
            own = predict(mine, host, part, codec_work(c, False, False))
            for j in range(bp.partitions):
                first, last = j == 0, j == bp.partitions - 1
                stages = [
                    Stage(
                        COMPUTE, enc + (gamma * s if first else 0.0), "pack, encode" if first else "encode"
                    ),
                    *comm_stages(mine.name, comm, own, part),
                    Stage(
                        COMPUTE, dec + (gamma * s if last else 0.0), "decode, unpack" if last else "decode"
                    ),
                ]
                prog.cable_bytes += predict(mine, bytes_model, part, codec_work(c, False, False))
                label = f"bucket {b}" + (f" part {j + 1}/{bp.partitions}" if bp.partitions > 1 else "")
                tasks.append(Task(label, b, stages))
        prog.bucket_tasks.append(tasks)
    if config.check_steps:
        t = model.flat(STEP_CHECK_BYTES)
        prog.start_tasks.append(
            Task("step check", -1, comm_stages("step check", t, host.flat(STEP_CHECK_BYTES), 40))
        )
    if config.check_overflow or config.find_unused_parameters:
        flags = 4 * (1 + (len(slots) if config.find_unused_parameters else 0))
        prog.end_tasks.append(
            Task("step flags", -1, [Stage(COMM, model.flat(flags), "step flags", False, {"call": True})])
        )
    compressed = sum(1 for b in plan.buckets if b.compress)
    prog.notes.append(f"{len(plan.buckets)} buckets, {compressed} compressed")
    return prog


def codec_spec_of(name: str, sync_options: dict[str, str] | None = None) -> list[str]:
    """The codec specs whose costs contender ``name`` needs (none for dense ones)."""
    k = kind(name)
    if k == "ddp" and name.startswith("ddp-powersgd"):
        return [f"powersgd:rank={powersgd_rank(name)}"]
    if k == "outer":
        spec = outer_codec_spec(outer_options(name).get("codec"))
        return [spec] if spec is not None else []
    if k == "self-syncing":
        return [self_syncing_exchange(name)[1]]
    if k == "sharded":
        spec = sharded_codec_spec(name)
        return [spec] if spec is not None else []
    if k != "gradsync":
        return []
    config = SyncConfig.from_options({"scheme": name, **(sync_options or {})})
    scheme = Scheme.parse(config.scheme)
    return [c.spec() for c in scheme_codecs(config, scheme, (2, 2)).all]
