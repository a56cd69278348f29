"""Alpha-beta cost of every aggregation scheme, as the papers write it, and their calibration.

A link level has a start-up time alpha (s) and a transfer time beta (s per byte); ``intra`` is the
link between ranks of one node, ``inter`` the node's cable. Sizes are bytes of the dense float
tensor (S) or of a payload (B). gamma is the time to add one byte of data into another.

Formulas (p ranks, m nodes of n ranks), one method of :class:`CostModel` each:

- ``flat``, ``hierarchical``, ``torus2d``: ring all-reduce
  ``2(p-1) alpha + 2(p-1)/p S beta + (p-1)/p S gamma`` over the world, or composed per level;
- ``paper02_ring``: the network-bottleneck paper's simulator, the flat ring without alpha
  (optionally with a free compression ratio dividing the transfer);
- ``allgather``: the MSTopK paper's Eq. 3, all-gather of B-byte payloads
  ``alpha log2 p + (p-1) B beta``; ``naive`` adds one encode and p decodes (the RedSync paper's
  packed sparse all-gather, its T_sparse with the selection time measured as the codec's encode);
- ``hitopk``: the MSTopK paper's Eq. 7-10, HiTopKComm: intra reduce-scatter
  ``(n-1) alpha_i + (n-1)/n S beta_i``, top-k of S/n, inter all-gather
  ``alpha_o log2 m + (m-1) B beta_o`` for each of the n local indices (their n streams share the
  node cable), intra all-gather of the payloads;
- ``casync``: the HiPress paper's Eq. 2 with Table 3,
  ``T_cpr = a T_send(r m/K) + b T_enc(m/K) + c T_dec(r m/K)`` with (a, b, c) = (2(N-1), N, N) for
  CaSync-Ring on sparsifiers and quantizers, (2(N-1), 1, 1) for low rank, and (2(N-1), K, N) for
  CaSync-PS with co-located aggregators;
- ``lowrank``: PowerSGD's two factor all-reduces; ``locally_aggregated``: the HiPress paper's
  local aggregation around any of them; :func:`powersgd_hook_split`: what PyTorch's PowerSGD
  communication hook sends of a bucket (its tensors too small to gain left dense, one factor
  pair per matrix), the sizes of its three all-reduces;
- ``parallel_tensor_op``: the MSTopK paper's Eq. 13-14, a per-layer computation split over the
  ranks (the largest share's work) plus the all-gather of its results.

:func:`calibrate` measures alpha and beta of each level on the running cluster with all-reduce
sweeps and least squares; :func:`measure_codec` times a codec's encode and decode.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- network-bottleneck paper: Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
- ImageNet-in-four-minutes paper: Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
- HiPress paper: Wu et al., "A Generic, High-Performance, Compression-Aware Framework for Data
  Parallel DNN Training", IEEE TPDS (HiPress, CaSync, CompLL).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsync.codecs import Compressor
from gradsync.collectives import primitives as P
from gradsync.collectives.pieces import fixed_capacity
from gradsync.collectives.topology import Topology


@dataclass(frozen=True)
class Link:
    """Start-up time ``alpha`` (s) and time per byte ``beta`` (s/B) of one link level."""

    alpha: float
    beta: float

    def send(self, nbytes: float) -> float:
        return self.alpha + nbytes * self.beta


@dataclass(frozen=True)
class CostParams:
    intra: Link
    inter: Link
    gamma: float = 0.0  # s per byte summed
    # seconds of an all-gather of one value per rank over the world, measured (None: not
    # measured, and alpha log2 p of the world link stands in). A small all-gather on gloo is a
    # ring of p - 1 steps, each with its software start-up, which the all-reduce fits understate.
    gather_start: float | None = None
    # seconds each collective call costs besides its links' start-ups: the calling software (the
    # engine's threads handing steps over, Python, staging) and the peers' scheduling on a busy
    # host. A step of many small collectives pays it once per call (see :func:`calibrate`).
    call: float = 0.0
    efficiency: tuple[tuple[str, float], ...] = ()
    """Measured over modelled communication time of a synchronization, by the kind of its
    collective across nodes and its size class (``"allgather/small"``: see
    :func:`efficiency_key`), as the closed loop refits them from the running engine's buckets; a
    kind and class not listed is 1. The planner's :func:`~gradsync.planner.decide.predict`
    multiplies a synchronization's communication (not its codec's compute) by it."""

    def efficiency_of(self, kind: str, nbytes: float) -> float:
        key = efficiency_key(kind, nbytes)
        return next((v for k, v in self.efficiency if k == key), 1.0)


COLLECTIVE_KINDS = ("allreduce", "allgather", "sendrecv", "tree")
"""What crosses the nodes in a synchronization: a ring all-reduce (dense algorithms, PowerSGD's
factor rounds), an all-gather of payloads, or CaSync's point-to-point steps (ring and PS); and
``tree``, the node-internal reduce and broadcast around the leaders (the hierarchical all-reduce,
PowerSGD with local aggregation), which :func:`calibrate` measures (the closed loop keeps it)."""

CALIBRATED_KINDS = ("tree",)
"""Efficiency kinds :func:`calibrate` measures and the closed loop's refit leaves as they are."""

SMALL_COLLECTIVE_BYTES = 1 << 20
"""Below this many bytes a collective is ``small`` (start-ups weigh), at or above ``large``."""


def efficiency_key(kind: str, nbytes: float) -> str:
    """``allgather/small``: the efficiency class of a ``kind`` collective moving ``nbytes``."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"collective kind must be one of {', '.join(COLLECTIVE_KINDS)}, got {kind!r}")
    return f"{kind}/{'small' if nbytes < SMALL_COLLECTIVE_BYTES else 'large'}"


def parse_efficiency(v: Any, where: str) -> tuple[tuple[str, float], ...]:
    """``{"allgather/small": 1.3, ...}`` as :attr:`CostParams.efficiency` (``ValueError`` naming
    ``where`` and the allowed classes)."""
    if not isinstance(v, dict):
        raise ValueError(f"{where} must be an object of KIND/CLASS -> factor, got {v!r}")
    kinds = [f"{k}/{c}" for k in COLLECTIVE_KINDS for c in ("small", "large")]
    out = []
    for key, factor in sorted(v.items()):
        if key not in kinds:
            raise ValueError(f"{where}: unknown class {key!r}; allowed: {', '.join(kinds)}")
        number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
        if not number or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"{where}[{key!r}] must be positive, got {factor!r}")
        out.append((key, float(factor)))
    return tuple(out)


@dataclass(frozen=True)
class Linear:
    """``a + b * x``, fitted by least squares."""

    a: float
    b: float

    def __call__(self, x: float) -> float:
        return self.a + self.b * x

    @classmethod
    def fit(cls, xs: list[float], ys: list[float]) -> Linear:
        if len(xs) < 2:
            return cls(ys[0] if ys else 0.0, 0.0)
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        var = sum((x - mx) ** 2 for x in xs)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
        return cls(max(my - b * mx, 0.0), max(b, 0.0))


@dataclass(frozen=True)
class CodecCost:
    """A codec's measured encode / decode time and payload size as functions of dense bytes."""

    encode: Linear
    decode: Linear
    payload: Linear
    summable: bool = False
    lowrank: bool = False
    bounded: bool = True
    """Its payloads fit a bound known in advance (:func:`~gradsync.collectives.pieces.fixed_capacity`):
    they are gathered in fixed slots, one collective, instead of a size exchange and a gather."""

    @property
    def messages(self) -> int:
        """Collectives per all-gather of its payloads: 1 in fixed slots, else 2 (sizes first)."""
        return 1 if self.bounded else 2

    def to_dict(self) -> dict[str, Any]:
        """Plain values: each line as ``[a, b]``, and the traits."""
        return {
            "encode": [self.encode.a, self.encode.b],
            "decode": [self.decode.a, self.decode.b],
            "payload": [self.payload.a, self.payload.b],
            "summable": self.summable,
            "lowrank": self.lowrank,
            "bounded": self.bounded,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str) -> CodecCost:
        """:meth:`to_dict`'s values (``bounded`` may be missing: tables written before it have
        none, and every codec they hold is bounded); ``ValueError`` naming ``where``."""
        try:
            enc, dec, pay = (Linear(float(d[k][0]), float(d[k][1])) for k in ("encode", "decode", "payload"))
            summable, lowrank, bounded = d["summable"], d["lowrank"], d.get("bounded", True)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError):
            raise ValueError(
                f"{where} needs encode, decode, payload as [a, b] and summable, lowrank (true or false)"
            ) from None
        numbers = [x for line in (enc, dec, pay) for x in (line.a, line.b)]
        if not all(math.isfinite(x) and x >= 0 for x in numbers):
            raise ValueError(f"{where}: encode, decode and payload must be non-negative numbers")
        if not (isinstance(summable, bool) and isinstance(lowrank, bool) and isinstance(bounded, bool)):
            raise ValueError(f"{where}: summable, lowrank and bounded must be true or false")
        return cls(enc, dec, pay, summable=summable, lowrank=lowrank, bounded=bounded)


HOOK_MIN_COMPRESSION_RATE = 2.0
"""PyTorch's ``PowerSGDState.min_compression_rate`` default (``torch.distributed.algorithms.
ddp_comm_hooks.powerSGD_hook``): the hook sends a matrix as factors only where they are less than
half its size."""


@dataclass(frozen=True)
class HookSplit:
    """What PyTorch's PowerSGD hook sends of one bucket, in bytes: ``dense``, the tensors it leaves
    uncompressed (one all-reduce, issued first); ``p`` and ``q``, the factors of the others (one
    all-reduce each); ``matrices``, the bytes of the tensors sent as factors."""

    dense: float
    p: float
    q: float
    matrices: float


def powersgd_hook_split(
    shapes: Iterable[tuple[int, ...]],
    rank: int,
    itemsize: int = 4,
    min_compression_rate: float = HOOK_MIN_COMPRESSION_RATE,
) -> HookSplit:
    """PyTorch's PowerSGD hook's choice over a bucket's tensors, as the hook makes it (``powerSGD_hook``,
    step I): each tensor is viewed as ``shape[0]`` rows by the rest; with ``r = min(rows, cols,
    rank)`` it is compressed iff ``(rows + cols) r min_compression_rate < rows cols``, and then
    sends ``rows r`` values in P and ``cols r`` in Q. A vector (one column) never passes, nor does a
    small matrix: a small ResNet's 3 x 3 convolutions of 16 channels (16 x 144) pass at rank 1, its
    biases and batch-norm weights do not."""
    dense = p = q = matrices = 0.0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if shape else 1
        cols = numel // rows if rows else 0
        r = min(rows, cols, rank)
        if len(shape) >= 1 and r > 0 and (rows + cols) * r * min_compression_rate < rows * cols:
            p, q, matrices = p + rows * r * itemsize, q + cols * r * itemsize, matrices + numel * itemsize
        else:
            dense += numel * itemsize
    return HookSplit(dense, p, q, matrices)


def log2(p: int) -> float:
    return math.log2(p) if p > 1 else 0.0


class CostModel:
    """Predicted seconds of each scheme for ``nodes`` x ``per_node`` ranks with ``params``."""

    def __init__(self, params: CostParams, nodes: int, per_node: int) -> None:
        self.params, self.m, self.n = params, nodes, per_node
        self.p = nodes * per_node

    @property
    def world_link(self) -> Link:
        """The link a collective over the whole world is limited by: inter-node on several nodes."""
        return self.params.inter if self.m > 1 else self.params.intra

    # ------------------------------------------------------------------ dense
    def calls(self, count: float) -> float:
        """What ``count`` collective calls cost besides their links (:attr:`CostParams.call`)."""
        return count * self.params.call

    def ring_allreduce(self, nbytes: float, p: int, link: Link) -> float:
        """One ring all-reduce call over ``p`` ranks."""
        if p <= 1:
            return 0.0
        ring = 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * nbytes * (link.beta + self.params.gamma / 2)
        return ring + self.calls(1)

    def flat(self, nbytes: float) -> float:
        """One ring over the world; on several nodes each node cable carries 2(p-1)/p S."""
        return self.ring_allreduce(nbytes, self.p, self.world_link)

    def paper02_ring(self, nbytes: float, ratio: float = 1.0) -> float:
        """The network-bottleneck paper's what-if ring: ``2S(N-1)/N / bw + (N-1) AddEst(S/N)`` with
        AddEst(x) = gamma x, no start-up term, and the transfer divided by a compression ``ratio``
        that costs nothing (the paper's Figure 8). It is :meth:`ring_allreduce` with alpha = 0 and
        beta / ratio."""
        link = Link(0.0, self.world_link.beta / ratio)
        return self.ring_allreduce(nbytes, self.p, link)

    def hierarchical(self, nbytes: float) -> float:
        """The ImageNet-in-four-minutes paper's algorithm: intra reduce and broadcast (binomial
        trees), ring all-reduce among leaders."""
        return 2 * self.tree(nbytes) + self.ring_allreduce(nbytes, self.m, self.params.inter)

    def tree(self, nbytes: float) -> float:
        """One intra-node binomial tree (a reduce, or a broadcast) of S bytes: one call, its
        transfers times the ``tree`` efficiency :func:`calibrate` measured (1 where it did not)."""
        i = self.params.intra
        if self.n <= 1:
            return 0.0
        transfer = math.ceil(log2(self.n)) * (i.alpha + nbytes * i.beta)
        return transfer * self.params.efficiency_of("tree", nbytes) + self.calls(1)

    def torus2d(self, nbytes: float) -> float:
        """The MSTopK paper's 2DTAR: intra RS, n parallel inter all-reduces of S/n sharing the
        cable, intra AG."""
        o = self.params.inter
        rs = self.intra_shard_step(nbytes)
        inter = 0.0
        if self.m > 1:
            inter = 2 * (self.m - 1) * o.alpha + 2 * (self.m - 1) / self.m * nbytes * o.beta + self.calls(1)
        return 2 * rs + inter

    def intra_shard_step(self, nbytes: float) -> float:
        """One intra-node reduce-scatter (or all-gather) of S bytes: one call."""
        return self.shard_step(nbytes, self.n, self.params.intra)

    def shard_step(self, nbytes: float, p: int, link: Link) -> float:
        """One ring reduce-scatter (without its sums) or all-gather of S bytes in all over ``p``
        ranks on ``link``: p - 1 steps of an S/p piece, one call."""
        if p <= 1:
            return 0.0
        return (p - 1) * link.alpha + (p - 1) / p * nbytes * link.beta + self.calls(1)

    # ------------------------------------------------------------------ sparse (MSTopK, RedSync papers)
    def allgather(
        self, payload_bytes: float, p: int, link: Link, streams: int = 1, messages: int = 1
    ) -> float:
        """The MSTopK paper's Eq. 3 for B-byte payloads; ``streams`` concurrent all-gathers share
        the link. ``messages``: collectives per step, each with its start-up and call (a codec whose
        payloads are not bounded in advance sends their sizes first: 2)."""
        if p <= 1:
            return 0.0
        start = messages * (link.alpha * log2(p) + self.params.call)
        return start + (p - 1) * payload_bytes * link.beta * streams

    def naive(self, nbytes: float, c: CodecCost) -> float:
        """Every rank's payload all-gathered over the world (sizes first), decoded p times."""
        return self.gathered(nbytes, c, self.p, self.world_link)

    def gathered(self, nbytes: float, c: CodecCost, ranks: int, link: Link) -> float:
        """The ``allgather`` strategy over ``ranks``: one encode, the payloads all-gathered (their
        sizes first unless bounded), ``ranks`` decodes."""
        gather = self.allgather(c.payload(nbytes), ranks, link, messages=c.messages)
        return c.encode(nbytes) + gather + ranks * c.decode(nbytes)

    def hitopk(self, nbytes: float, c: CodecCost, chunks: int = 1) -> float:
        """The MSTopK paper's Eq. 7-10: intra reduce-scatter, top-k of the shard, inter all-gather
        of the shard payloads (n streams share the cable), intra all-gather of the m payloads each
        rank holds (Eq. 10's sparse all-gather), decode of everything.

        With ``chunks`` > 1 the first two steps of one chunk overlap the third of the previous
        one: ``c + (K - 1) max(c, x) + x`` for per-chunk compute c and transfer x."""
        i, o = self.params.intra, self.params.inter
        part = nbytes / chunks
        shard = part / self.n
        compute = self.intra_shard_step(part) + c.encode(shard)
        transfer = self.allgather(c.payload(shard), self.m, o, streams=self.n, messages=c.messages)
        pipeline = compute + (chunks - 1) * max(compute, transfer) + transfer
        t4 = self.allgather(self.m * chunks * c.payload(shard), self.n, i, messages=c.messages)
        return pipeline + t4 + self.m * self.n * chunks * c.decode(shard)

    # ------------------------------------------------------------------ CaSync (HiPress paper)
    def casync_steps(self, reencodes: bool, c: CodecCost, n: int, k: int) -> tuple[int, int, int]:
        """Table 3's (alpha, beta, gamma): communication steps, encodes and decodes on the path.

        PS with a sparsifier or quantizer: K + 1 encodes (the K partitions, then the owner's
        aggregate) and N + 1 decodes (the owner's N, then the last piece the others' transfers do
        not hide), as Table 3 gives them. Steps: 2 (N - 1) for both strategies, since gradsync's
        aggregators are its workers and a rank sends nothing to itself (the paper's separate
        servers take 2N)."""
        if c.lowrank or c.summable:
            return 2 * (n - 1), 1, 1
        if reencodes:  # the ring: every hop decodes, merges and encodes again
            return 2 * (n - 1), n, n
        return 2 * (n - 1), k + 1, n + 1

    def casync(self, reencodes: bool, nbytes: float, c: CodecCost, n: int | None = None, k: int | None = None,
               link: Link | None = None, messages: int = 1) -> float:  # fmt: skip
        """Eq. 2 for the ring (``reencodes``) or PS over n ranks (default: the world) with K
        partitions; ``messages`` start-ups per send (gradsync's steps send a size, then the
        payload: 2)."""
        n = n or self.p
        k = k or n
        link = link or self.world_link
        a, b, g = self.casync_steps(reencodes, c, n, k)
        part = nbytes / k
        send = messages * (link.alpha + self.params.call) + c.payload(part) * link.beta
        return a * send + b * c.encode(part) + g * c.decode(part)

    def lowrank(self, nbytes: float, c: CodecCost, p: int | None = None, link: Link | None = None) -> float:
        """PowerSGD's two rounds: ring all-reduces of the P and Q factors (together the payload)
        plus one encode (both products, orthogonalization) and one decode."""
        return 2 * self.lowrank_round(nbytes, c, p, link) + c.encode(nbytes) + c.decode(nbytes)

    def lowrank_round(
        self, nbytes: float, c: CodecCost, p: int | None = None, link: Link | None = None
    ) -> float:
        """One of PowerSGD's two factor all-reduces (P, then Q: half the payload each) over ``p``
        ranks (default: the world)."""
        return self.ring_allreduce(c.payload(nbytes) / 2, p or self.p, link or self.world_link)

    # ------------------------------------------------------------------ PTO (MSTopK paper)
    def parallel_tensor_op(self, local_s: float, share: float, values: int, value_bytes: int = 4) -> float:
        """The MSTopK paper's Eq. 13-14: each rank does the largest share's fraction ``share`` of
        work that takes ``local_s`` on one rank, then one all-gather of ``values`` results per rank
        (padded to the largest share) over the world: the measured start-up of a small world
        all-gather where :func:`calibrate` took it, plus the bytes."""
        nbytes = values * value_bytes
        if self.params.gather_start is None:
            return local_s * share + self.allgather(nbytes, self.p, self.world_link)
        return local_s * share + self.params.gather_start + (self.p - 1) * nbytes * self.world_link.beta

    def lowrank_locally_aggregated(self, nbytes: float, c: CodecCost) -> float:
        """A low-rank codec with local aggregation: intra reduce and broadcast around the
        leaders' low-rank rounds across the nodes (on one node, the reduce and the broadcast
        alone: nothing is encoded, as the engine runs it)."""
        if self.m <= 1:
            return 2 * self.tree(nbytes)
        return 2 * self.tree(nbytes) + self.lowrank(nbytes, c, self.m, self.params.inter)

    def locally_aggregated(
        self, nbytes: float, c: CodecCost, across: Callable[[float, int, Link], float]
    ) -> float:
        """Intra reduce-scatter, a strategy over the m nodes on S/n (``across(shard bytes, ranks,
        link)``; the n local indices' streams share the cable), the compressed results forwarded
        inside the node, all of them decoded."""
        i, o = self.params.intra, self.params.inter
        rs = self.intra_shard_step(nbytes)
        shard = nbytes / self.n
        shared = Link(o.alpha, o.beta * self.n)
        forward = self.allgather(c.payload(shard), self.n, i, messages=c.messages)
        return rs + across(shard, self.m, shared) + forward + c.decode(nbytes)


# -------------------------------------------------------------------------------- calibration
def time_slowest(topo: Topology, fn: Callable[[], object], reps: int) -> float:
    """Median over reps of the slowest rank's time (all ranks take part in the max, on the
    topology's control group: gradsync never touches the default group)."""
    times = []
    for _ in range(reps):
        dist.barrier(group=topo.control_group)
        synchronize(topo.comm_device)
        t0 = time.perf_counter()
        fn()
        synchronize(topo.comm_device)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=topo.comm_device)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=topo.control_group)
        times.append(float(dt))
    return statistics.median(times)


LATENCY_CALLS = 10
"""Back-to-back calls per timing of a level's start-up (see :func:`_latency`)."""


def _latency(topo: Topology, group: dist.ProcessGroup | None, reps: int) -> float:
    """Seconds of one 4-byte all-reduce on ``group`` while every group of its level runs the same
    at once, :data:`LATENCY_CALLS` calls back to back: how a step's small collectives run, every
    rank busy. (One call alone after a barrier, with only one group of the level active, measured
    a quarter to a third of that on the emulated 2 x 2 cluster at 100 Mbit/s: it misses the
    other ranks' scheduling.)"""
    buf = torch.zeros(1, device=topo.comm_device)

    def burst() -> None:
        for _ in range(LATENCY_CALLS):
            P.all_reduce(buf, group, "calibrate")

    return time_slowest(topo, burst, reps) / LATENCY_CALLS


def _fit_ring(
    topo: Topology, group: dist.ProcessGroup | None, p: int, active: bool, sizes: list[int], reps: int
) -> Link:
    """alpha from small all-reduces with every rank busy (:func:`_latency`: every software and
    network start-up cost of one step), beta from the slope between the smallest and the largest
    size on the ``active`` group alone (its cable to itself; two points are robust on a noisy
    machine where a least-squares intercept is not)."""
    latency = _latency(topo, group, reps)
    times = []
    for s in sizes:
        buf = torch.zeros(max(s // 4, 1), device=topo.comm_device)

        def step(b: torch.Tensor = buf) -> None:
            if active:
                P.all_reduce(b, group, "calibrate")

        times.append(time_slowest(topo, step, reps))
    alpha = latency / (2 * (p - 1))
    span = sizes[-1] - sizes[0]
    slope = (times[-1] - times[0]) / span if span > 0 else 0.0
    if slope <= 0:  # latency-dominated even at the largest size: bound beta by that size
        slope = times[-1] / sizes[-1]
    return Link(alpha, slope * p / (2 * (p - 1)))


def measure_gather_start(topo: Topology, group: dist.ProcessGroup | None = None, reps: int = 5) -> float:
    """Seconds of an all-gather of one float32 per rank on ``group`` (default: gradsync's world
    group): its start-up, every rank's software and network latency on the way. The median over
    ``reps`` of the slowest rank's time, the same on every rank."""
    group = group if group is not None else topo.world_group
    one = torch.zeros(1, device=topo.comm_device)
    out = torch.zeros(topo.world, device=topo.comm_device)
    P.all_gather(out, one, group, "world")  # the first call sets up the group's connections
    return time_slowest(topo, lambda: P.all_gather(out, one, group, "world"), reps)


ADD_BYTES = 16 << 20
"""The tensors :func:`_add_rate` adds: larger than a core's caches, as a gradient bucket is."""


def _add_rate(topo: Topology, reps: int) -> float:
    """Seconds per byte of an add where the collectives' tensors are (the reductions run there),
    measured one rank at a time (the others wait at a barrier), the median of ``reps`` timings:
    the rate of one worker alone, as the profile's compute is (the simulator adds contention
    itself). Timed by all ranks at once, on hosts where ranks share cores, it read anywhere
    from 2e-11 to 2.3e-10 s/B between runs of one command."""
    a = torch.zeros(ADD_BYTES // 4, device=topo.comm_device)
    b = torch.ones_like(a)
    times = []
    for turn in range(topo.world if topo.world > 1 else 1):
        if topo.world > 1:
            dist.barrier(group=topo.control_group)
        if turn != topo.rank:
            continue
        a.add_(b)  # first touch, not timed
        synchronize(topo.comm_device)
        for _ in range(max(reps, 1)):
            t0 = time.perf_counter()
            a.add_(b)
            synchronize(topo.comm_device)
            times.append(time.perf_counter() - t0)
    if topo.world > 1:
        dist.barrier(group=topo.control_group)
    return statistics.median(times) / ADD_BYTES if times else 0.0


INTRA_LARGE_BYTES = 32 << 20
"""The largest all-reduce of the node-internal level's calibration (besides ``sizes``): on links
inside a host a few MiB still carry the calls' fixed costs. Timed at 4 MiB, with both nodes at
once, the loopback of the emulated 2 x 2 cluster read 1.1e-9 s/B and moved from 1.2e-10 to
1.6e-9 between runs of one command; 16 to 90 MiB read 0.87-0.97e-9 (gloo, four ranks on two
cores), and one node alone 0.36-0.6e-9 at 32 MiB (the rate :func:`calibrate` now takes)."""


def _tree_efficiency(topo: Topology, intra: Link, nbytes: int, reps: int) -> float:
    """Measured over modelled time of the node-internal reduce and broadcast of ``nbytes`` (on the
    first node alone, as the links were fitted), the links fitted from ring all-reduces: gloo's
    reduce and broadcast are not a ring's halves (on the emulated cluster's loopback, two ranks on
    two cores, the pair took 1.4-1.6 ring all-reduces of the same bytes, against the 2 of
    full-duplex links)."""
    buf = torch.zeros(nbytes // 4, device=topo.comm_device)
    leader = topo.leader

    def tree() -> None:
        if topo.node == 0:
            P.reduce(buf, leader, topo.intra_group, "calibrate")
            P.broadcast(buf, leader, topo.intra_group, "calibrate")

    tree()  # first call not timed
    measured = time_slowest(topo, tree, reps)
    modelled = 2 * CostModel(CostParams(intra, intra, 0.0), topo.nodes, topo.per_node).tree(nbytes)
    return min(max(measured / modelled, 0.1), 100.0) if modelled > 0 else 1.0


def calibrate(topo: Topology, sizes: list[int] | None = None, reps: int = 5) -> CostParams:
    """Measure alpha and beta of the intra and inter levels on the running cluster.

    Ring all-reduces of ``sizes`` (bytes) on the first node's group alone (the links of one node,
    as a worker's compute is profiled alone: where nodes share a host's cores, as on the emulated
    cluster, the simulator adds the contention) and on one inter-node group (local index 0, so its
    stream has the node cable to itself), read as ``2(p-1) alpha + 2(p-1)/p S beta``, alpha from
    small ones with every group of the level busy;
    the node-internal level also up to :data:`INTRA_LARGE_BYTES` (unless ``sizes`` are given), and
    its reduce and broadcast against their formula (the ``tree`` efficiency, :func:`_tree_efficiency`);
    gamma from timing local adds, one rank at a time (:func:`_add_rate`); the start-up of a small
    world all-gather (:func:`measure_gather_start`). The per-call cost is left at zero: the closed
    loop fits it from the running engine (:func:`gradsync.planner.closed_loop.refit_links`). Every
    rank gets the same numbers (the timings are maxima over all ranks). A level with one rank
    gets the other level's values.
    """
    explicit = sizes is not None
    sizes = sorted(sizes or [4, 1024 * 1024, 4 * 1024 * 1024])
    intra = inter = None
    efficiency: tuple[tuple[str, float], ...] = ()
    if topo.world > 1 and topo.per_node > 1:
        intra_sizes = sizes if explicit else sorted({*sizes, INTRA_LARGE_BYTES})
        intra = _fit_ring(topo, topo.intra_group, topo.per_node, topo.node == 0, intra_sizes, reps)
        if intra_sizes[-1] >= SMALL_COLLECTIVE_BYTES:
            tree = _tree_efficiency(topo, intra, intra_sizes[-1], reps)
            efficiency = ((efficiency_key("tree", intra_sizes[-1]), tree),)
    if topo.world > 1 and topo.nodes > 1:
        inter = _fit_ring(topo, topo.inter_group, topo.nodes, topo.local_rank == 0, sizes, reps)
    g = torch.tensor([_add_rate(topo, reps)], dtype=torch.float64, device=topo.comm_device)
    if topo.world > 1:
        dist.all_reduce(g, op=dist.ReduceOp.MAX, group=topo.control_group)
    fallback = Link(0.0, 0.0)
    gather = measure_gather_start(topo, reps=reps) if topo.world > 1 else None
    intra, inter = intra or inter or fallback, inter or intra or fallback
    return CostParams(intra, inter, float(g), gather, efficiency=efficiency)


EFFICIENCY_PROBES = (256 << 10, 2 << 20)
"""Per-rank payloads of the all-gathers :func:`measure_efficiency` times: one of each size class."""


def measure_efficiency(topo: Topology, params: CostParams, reps: int = 3) -> tuple[tuple[str, float], ...]:
    """Measured over modelled time of two collectives, one probe per size class
    (:data:`EFFICIENCY_PROBES`), as :attr:`CostParams.efficiency` entries:

    - ``allgather/small``, ``allgather/large``: a world all-gather of a payload per rank, against
      the all-gather formula;
    - ``sendrecv/small``, ``sendrecv/large``: a world all-to-all of one piece per peer (CaSync-PS's
      first phase, the exchange the PS strategy and the self-syncing optimizers run), against
      p - 1 sends of a piece.

    The links are fitted from ring all-reduces (:func:`calibrate`); these collectives can run at
    other rates (gloo's all-gather is a ring of its own, its all-to-all pairs of sockets, and on
    nodes of several ranks their streams share the cable, which the formulas do not charge): the
    ratios correct the compressed schemes' collectives where the simulator predicts them, before
    any of them ran. The same on every rank."""
    if topo.world <= 1:
        return ()
    model = CostModel(params, topo.nodes, topo.per_node)
    link, p = model.world_link, topo.world
    out = []
    for nbytes in EFFICIENCY_PROBES:
        mine = torch.zeros(nbytes // 4, device=topo.comm_device)
        gathered = torch.zeros(p * (nbytes // 4), device=topo.comm_device)
        pieces = [torch.zeros(nbytes, dtype=torch.uint8, device=topo.comm_device) for _ in range(p)]

        def gather(m: torch.Tensor = mine, g: torch.Tensor = gathered) -> None:
            P.all_gather(g, m, topo.world_group, "world")

        def exchange(chunks: list[torch.Tensor] = pieces, size: int = nbytes) -> None:
            P.all_to_all_fixed(chunks, [size] * p, topo.world_group, "world")

        probes = (
            ("allgather", gather, model.allgather(float(nbytes), p, link)),
            ("sendrecv", exchange, (p - 1) * (link.alpha + params.call + nbytes * link.beta)),
        )
        for kind, run, modelled in probes:
            run()  # connections set up, not timed
            measured = time_slowest(topo, run, reps)
            if modelled > 0:
                out.append((efficiency_key(kind, nbytes), min(max(measured / modelled, 0.1), 100.0)))
    return tuple(out)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a GPU runs kernels asynchronously: a timer read
    without this measures the launch, not the work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_codec(
    codec: Compressor,
    sizes: list[int],
    reps: int = 5,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> CodecCost:
    """Time encode and decode of a ``dtype`` tensor of each size (bytes) on ``device`` (default:
    the CPU; the sync engine passes its gradients' device) and fit lines.

    The timing runs on a fresh copy of the codec (same configuration, no state): the codec in
    use keeps its streams, scratch buffers and random generators untouched. The copy is the
    codec as it runs, error feedback included (it reads the residual and writes the sum: on this
    project's 2-core CPU ``mstopk:density=0.01`` encodes 16 MB in 2.4 ms, with ``+ef`` in 4.1 ms,
    ``docs/results/bench-codecs-ef.md``)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    itemsize = dtype.itemsize
    enc, dec, pay = [], [], []
    gen = torch.Generator().manual_seed(0)
    for s in sizes:
        n = max(s // itemsize, 1)
        side = 2 ** (int(math.log2(n)) // 2)
        x = torch.randn(n, generator=gen, device=gen.device).to(device=dev, dtype=dtype)
        if n % side == 0:
            x = x.view(side, n // side)
        out = torch.empty_like(x)
        plain = codec.fresh()  # per size: a stream keeps one size (its residual is that long)
        payload = plain.encode(x)  # warm-up (first-call allocations, compiled kernels)
        plain.decode(payload, out=out)
        te, td = [], []
        for _ in range(reps):
            synchronize(dev)
            t0 = time.perf_counter()
            payload = plain.encode(x)
            synchronize(dev)
            te.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            plain.decode(payload, out=out)
            synchronize(dev)
            td.append(time.perf_counter() - t0)
        enc.append(statistics.median(te))
        dec.append(statistics.median(td))
        pay.append(float(payload.nbytes))
    xs = [float(s) for s in sizes]
    bounded = all(fixed_capacity(plain, max(s // itemsize, 1), dtype) is not None for s in sizes)
    return CodecCost(
        Linear.fit(xs, enc), Linear.fit(xs, dec), Linear.fit(xs, pay), summable=plain.summable,
        lowrank=plain.lowrank, bounded=bounded,
    )  # fmt: skip
