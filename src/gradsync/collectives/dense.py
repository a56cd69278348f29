"""Dense all-reduce algorithms that respect the node hierarchy (the MSTopK and
ImageNet-in-four-minutes papers).

- ``flat``: one all-reduce over the world (the reference). On m nodes its ring crosses each
  node cable with 2(p-1)/p of the data.
- ``hierarchical`` (ImageNet-in-four-minutes paper): reduce inside the node onto local rank 0,
  all-reduce among those leaders across nodes, broadcast inside the node. Fewer steps on the slow
  level: 2(m-1) instead of 2(p-1); good for small tensors.
- ``torus2d`` (the MSTopK paper's 2D-torus all-reduce): reduce-scatter inside the node, all-reduce
  of every shard across nodes (the per_node inter-node groups run in parallel on their own shard),
  all-gather inside the node. Each node cable carries 2(m-1)/m of the data instead of 2(p-1)/p.
- ``hybrid`` (ImageNet-in-four-minutes paper): ``small`` below a size threshold (bytes), ``large``
  above it.

Each algorithm is a :class:`DenseAlgorithm` in one registry: its step program and its predicted
seconds (a function of :class:`~gradsync.collectives.cost.CostModel`, whose α–β terms it combines).
Scheme strings, :class:`~gradsync.sync.config.SyncConfig`, the plan, the planner's ``auto`` choice
and the what-if simulator all read the registry, so a new algorithm is one
:func:`register_dense_algorithm` call (docs/architecture.md shows one).

Any algorithm can communicate in fp16 or bf16 (``comm_dtype``): the tensor goes through the fp16 /
bf16 codec with a scale agreed from the global max and the world size, so partial sums can never
overflow; the value section is reduced and decoded back.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- ImageNet-in-four-minutes paper: Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from gradsync.codecs import EncodeContext, build_codec
from gradsync.codecs.ops import Workspace, abs_max, abs_max_on_device
from gradsync.collectives import primitives as P
from gradsync.collectives.cost import CostModel
from gradsync.collectives.program import Program, chain, last, run
from gradsync.collectives.topology import Topology, default_topology

OPS = ("sum", "mean")
COMM_DTYPES = (None, "fp16", "bf16")


@dataclass(frozen=True)
class HybridPolicy:
    """``hybrid``: use ``small`` below ``threshold`` bytes and ``large`` from there on.

    The ImageNet-in-four-minutes paper switches between its hierarchical algorithm and the ring on
    tensor size. The defaults here come from `gradsync bench collectives` on the emulated 2 x 2
    cluster at 100 Mbit/s (docs/benchmarks.md): at 64 KiB the single flat all-reduce was fastest
    (7.1 ms against 8.2 ms hierarchical and 9.2 ms torus2d: latency-bound, fewest steps), from
    256 KiB on torus2d and hierarchical were 1.7x faster than flat (the cable carries S instead
    of 1.5 S).
    """

    threshold: int = 128 * 1024
    small: str = "flat"
    large: str = "torus2d"

    def __post_init__(self) -> None:
        if self.threshold < 0:
            raise ValueError(f"hybrid threshold must be >= 0 bytes, got {self.threshold}")
        allowed = [a for a in dense_algorithm_names() if a != "hybrid"]
        for name in (self.small, self.large):
            if name not in allowed:
                raise ValueError(f"hybrid algorithms must be one of {', '.join(allowed)}, got {name!r}")

    def pick(self, nbytes: int) -> str:
        return self.small if nbytes < self.threshold else self.large


def allreduce(
    tensor: torch.Tensor,
    topology: Topology | None = None,
    algorithm: str = "flat",
    op: str = "mean",
    comm_dtype: str | None = None,
    hybrid: HybridPolicy | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place (``op``: ``sum`` or ``mean``) and return it.

    ``topology`` is needed for every algorithm but ``flat``. With ``check`` (default) the ranks
    first agree on size, dtype and arguments (one tiny all-gather), so a mismatch raises
    :class:`~gradsync.collectives.primitives.MismatchError` on every rank instead of hanging.
    """
    check_arguments(tensor, algorithm, op, comm_dtype)
    if algorithm != "flat" and topology is None:
        raise ValueError(f"algorithm {algorithm!r} needs a topology (gradsync.Topology)")
    topo = topology.bind() if topology is not None else default_topology()
    if check:
        P.check_same(
            topo.world_group, "allreduce", numel=tensor.numel(), dtype=str(tensor.dtype),
            algorithm=algorithm, op=op, comm_dtype=str(comm_dtype),
        )  # fmt: skip
    if topo.world == 1:
        return tensor
    buf = tensor.view(-1) if tensor.is_contiguous() else tensor.contiguous().view(-1)
    run(allreduce_program(buf, topo, algorithm, op, comm_dtype, hybrid, topo.workspace))
    if buf.data_ptr() != tensor.data_ptr():
        tensor.copy_(buf.view(tensor.shape))
    return tensor


def check_arguments(tensor: torch.Tensor, algorithm: str, op: str, comm_dtype: str | None) -> None:
    """Raise for arguments :func:`allreduce` cannot take (before any communication)."""
    dense_algorithm(algorithm)  # ValueError naming the registered ones
    if op not in OPS:
        raise ValueError(f"op must be 'sum' or 'mean', got {op!r}")
    if comm_dtype not in COMM_DTYPES:
        raise ValueError(f"comm_dtype must be None, 'fp16' or 'bf16', got {comm_dtype!r}")
    if not tensor.is_floating_point() and (op == "mean" or comm_dtype is not None):
        raise TypeError(f"op='mean' and comm_dtype need a floating tensor, got {tensor.dtype}")


def allreduce_program(
    buf: torch.Tensor,
    topo: Topology,
    algorithm: str = "flat",
    op: str = "mean",
    comm_dtype: str | None = None,
    hybrid: HybridPolicy | None = None,
    ws: Workspace | None = None,
    resident: bool | None = None,
    rehearse: bool = False,
) -> Program:
    """:func:`allreduce` of the flat, contiguous ``buf`` as a step program (arguments checked
    by the caller); ``ws`` holds the scratch space of this program. ``resident``: with a
    ``comm_dtype``, the agreed scale never reaches the host (None: where ``buf`` is on a GPU).
    A world of one does nothing, unless ``rehearse`` (as in
    :func:`~gradsync.collectives.compressed.compressed_program`: the collectives over one rank
    are the identity, a ``comm_dtype`` still casts there and back)."""
    ws = ws if ws is not None else topo.workspace
    if topo.world == 1 and not rehearse:
        return None
    if algorithm == "hybrid":
        algorithm = (hybrid or HybridPolicy()).pick(buf.numel() * buf.element_size())
    scale = 1.0 / topo.world if op == "mean" else 1.0
    if comm_dtype is None:
        tail = yield from dense_steps(buf, topo, algorithm, ws)
        return chain(tail, (lambda: buf.div_(topo.world)) if op == "mean" else None)
    codec = build_codec(comm_dtype, resident=resident if resident is not None else buf.device.type != "cpu")
    # the scale must be the same everywhere: agree on the global max first
    if codec.resident:  # the agreed max stays on the device
        amax = abs_max_on_device(buf)
    else:
        amax = torch.tensor([abs_max(buf)[0]], dtype=torch.float32, device=buf.device)
    yield partial(P.all_reduce, amax, topo.world_group, "world", op=dist.ReduceOp.MAX)
    agreed = amax if codec.resident else float(amax)
    payload = codec.encode(buf, EncodeContext(summands=topo.world, amax=agreed))
    values = codec.values(payload)
    assert values is not None  # fp16 / bf16 payloads have a value section
    tail = yield from dense_steps(values, topo, algorithm, ws)
    return chain(tail, lambda: codec.decode(payload, out=buf, scale=scale))


def dense_steps(buf: torch.Tensor, topo: Topology, algorithm: str, ws: Workspace) -> Program:
    """Sum the flat ``buf`` over all ranks with a registered dense ``algorithm`` (not ``hybrid``,
    which its caller resolves by size)."""
    return (yield from dense_algorithm(algorithm).steps(buf, topo, ws))


def flat(buf: torch.Tensor, topo: Topology, ws: Workspace) -> Program:
    """One all-reduce over the world."""
    yield last(partial(P.all_reduce, buf, topo.world_group, "world"))
    return None


def across_nodes(buf: torch.Tensor, topo: Topology) -> Program:
    """One all-reduce across the nodes: what a hierarchical algorithm becomes with one rank per
    node (no node-internal phase, no copies)."""
    yield last(partial(P.all_reduce, buf, topo.inter_group, "inter"))
    return None


def hierarchical(buf: torch.Tensor, topo: Topology, ws: Workspace | None = None) -> Program:
    """The ImageNet-in-four-minutes paper's three phases on a flat buffer (sum). The inter-node
    phase is left out on a single node (every step is a hand-over between the engine's threads);
    the last step is marked last."""
    if topo.per_node == 1:
        return (yield from across_nodes(buf, topo))
    yield partial(P.reduce, buf, topo.leader, topo.intra_group, "intra")
    if topo.local_rank == 0 and topo.nodes > 1:  # the leaders' group is the one of local index 0
        yield partial(P.all_reduce, buf, topo.inter_group, "inter")
    yield last(partial(P.broadcast, buf, topo.leader, topo.intra_group, "intra"))
    return None


def torus2d(buf: torch.Tensor, topo: Topology, ws: Workspace) -> Program:
    """The MSTopK paper's 2D-torus all-reduce on a flat buffer (sum); a single node skips the
    inter-node phase."""
    if topo.per_node == 1:
        return (yield from across_nodes(buf, topo))
    padded, shard = shard_buffers(buf, topo, ws)
    scratch = ws.get("rs", padded.numel(), buf.dtype, buf.device)
    yield partial(P.reduce_scatter, shard, padded, topo.intra_group, "intra", scratch)
    if topo.nodes > 1:
        yield partial(P.all_reduce, shard, topo.inter_group, "inter")
    yield last(partial(P.all_gather, padded, shard, topo.intra_group, "intra"))
    if padded.data_ptr() != buf.data_ptr():
        return lambda: buf.copy_(padded[: buf.numel()])
    return None


def shard_buffers(buf: torch.Tensor, topo: Topology, ws: Workspace) -> tuple[torch.Tensor, torch.Tensor]:
    """``buf`` padded to a multiple of per_node (a workspace copy only when padding is needed)
    and a workspace tensor for this rank's shard."""
    n = topo.per_node
    shard_len = -(-buf.numel() // n)
    if shard_len * n == buf.numel():
        padded = buf
    else:
        padded = ws.get("padded", shard_len * n, buf.dtype, buf.device)
        padded[: buf.numel()].copy_(buf)
        padded[buf.numel() :].zero_()
    return padded, ws.get("shard", shard_len, buf.dtype, buf.device)


# -------------------------------------------------------------------------------- the registry
DenseSteps = Callable[[torch.Tensor, Topology, Workspace], Program]
"""An algorithm's program: sums the flat buffer over the world in place (world size > 1)."""
DenseCost = Callable[[CostModel, float], float]
"""An algorithm's predicted seconds for a buffer of so many bytes, from the cost model."""


@dataclass(frozen=True)
class DenseAlgorithm:
    """A dense all-reduce algorithm. ``auto``: the planner's ``dense_algorithm="auto"`` weighs it
    against the others (``hybrid``, a choice between two of them, is not weighed)."""

    name: str
    steps: DenseSteps
    cost: DenseCost
    auto: bool = True


_DENSE: dict[str, DenseAlgorithm] = {}


def register_dense_algorithm(algorithm: DenseAlgorithm) -> DenseAlgorithm:
    """Add ``algorithm`` to the registry (a name can be registered once) and return it. Register
    on every rank, in the same order, before any scheme names it: the plan that rank 0 broadcasts
    names algorithms by their place in the registry."""
    name = algorithm.name
    if not name.isidentifier() or name in ("none", "auto") or name in _DENSE:
        raise ValueError(
            f"dense algorithm name must be a new identifier other than none and auto, got {name!r} "
            f"(registered: {', '.join(_DENSE)})"
        )
    _DENSE[name] = algorithm
    return algorithm


def dense_algorithm(name: str) -> DenseAlgorithm:
    """The registered algorithm ``name``; ``ValueError`` naming the registered ones."""
    try:
        return _DENSE[name]
    except (KeyError, TypeError):
        raise ValueError(f"algorithm must be one of {', '.join(_DENSE)}, got {name!r}") from None


def dense_algorithm_names() -> tuple[str, ...]:
    """Every registered dense algorithm, in registration order."""
    return tuple(_DENSE)


def _hybrid_steps(buf: torch.Tensor, topo: Topology, ws: Workspace) -> Program:
    return (yield from dense_steps(buf, topo, HybridPolicy().pick(buf.numel() * buf.element_size()), ws))


register_dense_algorithm(DenseAlgorithm("flat", flat, CostModel.flat))
register_dense_algorithm(DenseAlgorithm("hierarchical", hierarchical, CostModel.hierarchical))
register_dense_algorithm(DenseAlgorithm("torus2d", torus2d, CostModel.torus2d))
register_dense_algorithm(
    DenseAlgorithm(
        "hybrid",
        _hybrid_steps,
        lambda model, nbytes: dense_algorithm(HybridPolicy().pick(int(nbytes))).cost(model, nbytes),
        auto=False,
    )
)
