"""gradsync's compression inside FSDP2: ``fully_shard``, HSDP's replicate dimension, ``replicate``.

FSDP2 has no communication hook like DDP's. It has two narrower ones, per FSDP module (one
parameter group each): a custom reduce-scatter (``set_custom_reduce_scatter``), called with the
module's flat gradient laid out as one contiguous shard per rank of the shard group, and an
all-reduce hook (``set_all_reduce_hook``), called with this rank's reduced shard. This module
puts a gradsync codec with error feedback behind either or both:

- ``where="shard"``: the reduce-scatter over the shard group is compressed. It is CaSync-PS's
  first phase (:func:`gradsync.collectives.strategies.reduce_scatter_pieces`): every rank
  encodes each rank's shard of its gradient (error feedback keeps what it did not send, for
  the whole unsharded gradient) and sends it to that rank in one all-to-all; the owner decodes
  and sums.
- ``where="replicate"``: HSDP's all-reduce across the replicate group, where the slow links
  between nodes usually are, is compressed with the scheme's strategy (``allgather``, ``ring``
  or ``ps``) on the reduced shard. PyTorch's own HSDP (``fully_shard`` on a 2-D mesh) and its
  ``replicate()`` all-reduce densely *before* any hook runs, so compressing this dimension means
  sharding on the 1-D shard mesh and letting the hook do the replicate all-reduce:
  ``fully_shard(m, mesh=mesh["shard"])`` then ``compress_fsdp(model, scheme,
  replicate_group=mesh["replicate"].get_group())``. :func:`replicate` builds data parallelism
  that way with shard groups of one rank (every rank keeps whole parameters, as ``replicate()``).

The scheme ``"none"`` installs the same plumbing with PyTorch's own collectives and reduce ops,
so its gradients are bit for bit those of plain FSDP2 (the tests check it). Compressed schemes:
any codec of :mod:`gradsync.codecs` except low-rank ones (PowerSGD factors matrices; a shard is
a flat slice of several parameters), with error feedback added where the codec is biased (as
everywhere in gradsync). Hierarchical schemes (``hitopk``, ``+local``) and ``auto`` are refused:
under FSDP the hierarchy is the mesh.

What error feedback owes is kept per FSDP module and role (``<module>/rs``, ``<module>/ar``); the
layout of a module's flat gradient is fixed by making FSDP reduce zero gradients for parameters
that got none (``set_reduce_scatter_unused_params``): with error feedback a parameter unused in
one step still has gradient owed to it. Memory: the reduce-scatter's residual is as large as the
module's *unsharded* gradient (each rank compresses its whole local gradient), the all-reduce's
as large as the shard.

Dense warm-up (``dense_warmup_steps``), small modules (``min_compress_bytes``) and sizes the
codec refuses go through the dense collective; the same decision is made on every rank (it
depends on sizes and call counts only). float16 reduction is refused for compressed schemes
(the residuals would carry a GradScaler's loss scale); use bfloat16 (``MixedPrecisionPolicy``).
:meth:`FsdpCompression.state_dict` saves the residuals and call counts of this rank.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from gradsync.codecs import Compressor
from gradsync.collectives import primitives as P
from gradsync.collectives.pieces import apply_pieces
from gradsync.collectives.program import Program, run
from gradsync.collectives.strategies import Coder, reduce_scatter_pieces, run_strategy
from gradsync.sync.scheme import Scheme

log = logging.getLogger("gradsync")

WHERE = ("shard", "replicate", "both")
STATE_FORMAT = "gradsync.fsdp/1"


def _mesh_kind(group: Any) -> str:
    """``fsdp`` (sharded, no replicate all-reduce by FSDP), ``native-replicate`` (PyTorch's HSDP
    or replicate(): FSDP all-reduces the replicate dimension itself)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

    return "native-replicate" if isinstance(group.mesh_info, DDPMeshInfo) else "fsdp"


def _fsdp_modules(module: nn.Module) -> list[tuple[str, FSDPModule]]:
    return [(name or "<root>", m) for name, m in module.named_modules() if isinstance(m, FSDPModule)]


def _groups(m: FSDPModule) -> list[Any]:
    return list(m._get_fsdp_state()._fsdp_param_groups)


def _reduce_dtype(group: Any) -> torch.dtype:
    mp: MixedPrecisionPolicy = group.mp_policy
    first = group.fsdp_params[0].sharded_param
    return mp.reduce_dtype or mp.param_dtype or first.dtype


class _CompressedReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter for one module, through :meth:`FsdpCompression.reduce_scatter`."""

    def __init__(self, owner: FsdpCompression, key: str, module: FSDPModule) -> None:
        self.owner, self.key, self.module = owner, key, module

    def allocate(
        self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> None:
        factors = {g.gradient_divide_factor for g in _groups(self.module)}
        self.owner.reduce_scatter(self.key, output_tensor, input_tensor, group, op, factors.pop())


class FsdpCompression:
    """The compression :func:`compress_fsdp` installed: its codec state, call counts and traffic.

    ``traffic`` counts the bytes this rank sent in the collectives it ran (levels ``shard`` and
    ``replicate``), dense ones included."""

    def __init__(
        self,
        scheme: str,
        *,
        where: str,
        replicate_group: dist.ProcessGroup | None,
        error_feedback: bool | None,
        dense_warmup_steps: int,
        min_compress_bytes: int,
    ) -> None:
        self.scheme = _parse_scheme(scheme)
        self.where = where
        self.replicate_group = replicate_group
        self.codec: Compressor | None = self.scheme.build(error_feedback)
        self.dense_warmup_steps = dense_warmup_steps
        self.min_compress_bytes = min_compress_bytes
        self.calls: dict[str, int] = {}
        """Collective calls so far per stream (``<module>/rs``, ``<module>/ar``)."""
        self.traffic = P.Traffic()
        self.decided: dict[str, str | None] = {}
        """Per stream, after its first call past the warm-up: why it goes dense (None: compressed)."""
        self.streams: set[str] = set()
        """The streams :func:`compress_fsdp` installed (``<module>/rs``, ``<module>/ar``)."""
        self._warned = False

    # ------------------------------------------------------------------ decisions
    def _dense_reason(self, key: str, numel: int, parts: int, itemsize: int) -> str | None:
        """Why this call goes dense (the same on every rank), or None to compress."""
        if self.codec is None:
            return "the scheme is dense"
        if self.calls.get(key, 0) < self.dense_warmup_steps:
            return "dense warm-up"
        if numel * itemsize < self.min_compress_bytes:
            return f"{numel * itemsize} bytes < min_compress_bytes={self.min_compress_bytes}"
        try:
            for n in {numel // parts, numel - (parts - 1) * (numel // parts)}:
                self.codec.check_numel(n)
        except ValueError as e:
            return str(e)
        return None

    def _note(self, key: str, why: str | None) -> None:
        """Keep a stream's first decision past the warm-up; once every stream has one and a
        compressed scheme compresses none of them, warn (on every rank: they decide alike)."""
        if why == "dense warm-up" or key in self.decided:
            return
        self.decided[key] = why
        if why is not None:
            log.info("gradsync fsdp: %s is synchronized densely (%s)", key, why)
        if (
            not self._warned
            and self.codec is not None
            and self.streams <= set(self.decided)
            and all(w is not None for w in self.decided.values())
        ):
            self._warned = True
            warnings.warn(
                f"gradsync fsdp: the scheme {self.scheme.text!r} compresses none of the "
                f"{len(self.decided)} FSDP reductions: "
                + "; ".join(f"{k}: {w}" for k, w in sorted(self.decided.items())),
                stacklevel=2,
            )

    def summary(self) -> list[dict[str, Any]]:
        """One row per stream: its key, calls so far, and how it is synchronized (``compressed``
        or the reason it goes dense; ``undecided`` before its first call past the warm-up)."""
        return [
            {
                "stream": key,
                "calls": self.calls.get(key, 0),
                "sync": ("undecided" if key not in self.decided else self.decided[key] or "compressed"),
            }
            for key in sorted(self.streams)
        ]

    def _count(self, before: P.Traffic) -> None:
        for level, n in before.sent.items():
            self.traffic.add(level, n)

    @staticmethod
    def _check_dtype(key: str, dtype: torch.dtype) -> None:
        if dtype == torch.float16:
            raise ValueError(
                f"compress_fsdp: {key} reduces in float16; compressed schemes take float32 or bfloat16 "
                "reduction (MixedPrecisionPolicy(reduce_dtype=torch.bfloat16 or torch.float32))"
            )

    # ------------------------------------------------------------------ the two collectives
    def reduce_scatter(
        self,
        module_key: str,
        out: torch.Tensor,
        inp: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        divide_factor: float | None,
    ) -> None:
        """FSDP's reduce-scatter of one module's flat gradient ``inp`` into ``out`` (this rank's
        shard), honouring FSDP's reduce op (sum, mean, or a sum pre-scaled by its divide factor)."""
        key = f"{module_key}/rs"
        p = group.size()
        why = self._dense_reason(key, inp.numel(), p, inp.element_size())
        self._note(key, why)
        self.calls[key] = self.calls.get(key, 0) + 1
        if why is not None:
            dist.reduce_scatter_tensor(out, inp, op=op, group=group)
            self.traffic.add("shard", (p - 1) / p * inp.numel() * inp.element_size(), "reduce_scatter")
            return
        self._check_dtype(module_key, inp.dtype)
        assert self.codec is not None
        if op == dist.ReduceOp.SUM:
            scale = 1.0
        elif op == dist.ReduceOp.AVG:
            scale = 1.0 / p
        elif divide_factor is not None:  # PREMUL_SUM(1 / factor)
            scale = 1.0 / divide_factor
        else:
            raise ValueError(
                f"compress_fsdp: {module_key}: FSDP asked for reduce op {op!r}, which gradsync cannot apply"
            )
        coder = Coder(self.codec, key, 1.0)

        def program() -> Program:
            pieces = yield from reduce_scatter_pieces(inp.view(-1), group, "shard", coder)
            return partial(apply_pieces, pieces, out.view(-1), coder.plain, scale)

        with P.record_traffic() as t:
            run(program())
        self._count(t)

    def all_reduce(self, module_key: str, shard: torch.Tensor) -> None:
        """The replicate dimension's all-reduce (mean) of one module's reduced shard, in place."""
        group = self.replicate_group
        assert group is not None
        key = f"{module_key}/ar"
        r = group.size()
        if r == 1:
            return
        strategy = self.scheme.strategy or "allgather"
        why = self._dense_reason(
            key, shard.numel(), r if strategy != "allgather" else 1, shard.element_size()
        )
        self._note(key, why)
        self.calls[key] = self.calls.get(key, 0) + 1
        if why is not None:
            dist.all_reduce(shard, op=dist.ReduceOp.AVG, group=group)
            self.traffic.add(
                "replicate", 2 * (r - 1) / r * shard.numel() * shard.element_size(), "all_reduce"
            )
            return
        self._check_dtype(module_key, shard.dtype)
        assert self.codec is not None
        coder = Coder(self.codec, key, 1.0)
        rank = dist.get_rank()
        flat = shard.view(-1)

        def program() -> Program:
            pieces = yield from run_strategy(flat, group, "replicate", coder, strategy, rank, final=True)
            return partial(apply_pieces, pieces, flat, coder.plain, 1.0 / r)

        with P.record_traffic() as t:
            run(program())
        self._count(t)

    # ------------------------------------------------------------------ state
    def residual_norm(self) -> float:
        """The L2 norm of everything error feedback still owes on this rank (0 without it)."""
        norm = self.codec.residual_norm() if self.codec is not None else None
        return float(norm or 0.0)

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals, codec streams and call counts (save one per rank)."""
        return {
            "format": STATE_FORMAT,
            "scheme": self.scheme.text,
            "where": self.where,
            "calls": dict(self.calls),
            "codec": self.codec.state_dict() if self.codec is not None else {},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"FsdpCompression.load_state_dict: not a {STATE_FORMAT} state")
        for field in ("scheme", "where"):
            mine = self.scheme.text if field == "scheme" else self.where
            if state[field] != mine:
                raise ValueError(
                    f"FsdpCompression.load_state_dict: the state was saved with {field}={state[field]!r}, "
                    f"this compression has {field}={mine!r}"
                )
        self.calls = {str(k): int(v) for k, v in state["calls"].items()}
        if self.codec is not None:
            self.codec.load_state_dict(state["codec"])


def _parse_scheme(scheme: str) -> Scheme:
    parsed = Scheme.parse(scheme)
    if parsed.kind == "dense":
        if parsed.algorithm != "flat" or parsed.comm_dtype is not None:
            raise ValueError(
                f"compress_fsdp: scheme {scheme!r}: the dense schemes FSDP takes are 'none' (PyTorch's own "
                "collectives); for half-precision communication use the codec fp16 or bf16"
            )
        return parsed
    if parsed.candidates or parsed.text.strip().startswith("auto"):
        raise ValueError(
            f"compress_fsdp: scheme {scheme!r}: 'auto' plans DDP buckets; give one compressed scheme"
        )
    if parsed.local:
        raise ValueError(
            f"compress_fsdp: scheme {scheme!r}: hierarchical schemes (hitopk, STRATEGY+local) are not for "
            "FSDP, whose hierarchy is the mesh; use a codec such as topk:density=0.01 or onebit"
        )
    codec = parsed.build()
    assert codec is not None
    if codec.lowrank:
        raise ValueError(
            f"compress_fsdp: scheme {scheme!r}: low-rank codecs (powersgd) need whole matrices; FSDP "
            "reduces flat shards of several parameters. Use a sparsifying or quantizing codec"
        )
    return parsed.resolve(1, 1)


def _check_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"compress_fsdp: {name} must be an integer >= 0, got {value!r}")
    return value


def compress_fsdp(
    module: nn.Module,
    scheme: str = "topk:density=0.01",
    *,
    replicate_group: dist.ProcessGroup | None = None,
    where: str | None = None,
    error_feedback: bool | None = None,
    dense_warmup_steps: int = 0,
    min_compress_bytes: int = 16384,
) -> FsdpCompression:
    """Compress the gradient synchronization of every FSDP module in ``module`` (after
    ``fully_shard``, before the first backward pass).

    ``where``: ``"shard"`` (the reduce-scatter; the default without ``replicate_group``),
    ``"replicate"`` (the all-reduce across ``replicate_group``, done by the hook; the default
    with it) or ``"both"``. ``error_feedback``: None adds it to biased codecs, True always, False
    never. The first ``dense_warmup_steps`` synchronizations of each module are dense, and so
    is every module gradient under ``min_compress_bytes``.

    Every argument is checked, on every rank, before any collective runs; then the ranks of
    ``replicate_group`` check that they hold the same parameters (one small all-gather).
    """
    if where is None:
        where = "replicate" if replicate_group is not None else "shard"
    if where not in WHERE:
        raise ValueError(f"compress_fsdp: where must be one of {', '.join(WHERE)}, got {where!r}")
    _check_int("dense_warmup_steps", dense_warmup_steps)
    _check_int("min_compress_bytes", min_compress_bytes)
    if error_feedback not in (None, True, False):
        raise ValueError(f"compress_fsdp: error_feedback must be None, True or False, got {error_feedback!r}")
    replicating = where in ("replicate", "both")
    if replicating and replicate_group is None:
        raise ValueError(
            f"compress_fsdp: where={where!r} needs replicate_group= (the process group across replicas, "
            "e.g. mesh['replicate'].get_group())"
        )
    if replicate_group is not None and not isinstance(replicate_group, dist.ProcessGroup):
        raise ValueError(
            f"compress_fsdp: replicate_group must be a torch.distributed ProcessGroup, got "
            f"{type(replicate_group).__name__} (a DeviceMesh gives one with mesh['replicate'].get_group())"
        )
    if replicate_group is not None and not replicating:
        raise ValueError(
            f"compress_fsdp: replicate_group is given but where={where!r}: the hook would not all-reduce "
            "across it, so replicas would drift apart; use where='replicate' or 'both'"
        )
    modules = _fsdp_modules(module)
    if not modules:
        raise ValueError(
            "compress_fsdp: module has no FSDP module in it; call torch.distributed.fsdp.fully_shard on "
            "it (and its blocks) first"
        )
    comp = FsdpCompression(
        scheme,
        where=where,
        replicate_group=replicate_group,
        error_feedback=error_feedback,
        dense_warmup_steps=dense_warmup_steps,
        min_compress_bytes=min_compress_bytes,
    )
    compressing = comp.codec is not None
    for name, m in modules:
        groups = _groups(m)
        if len(groups) > 1:
            raise ValueError(
                f"compress_fsdp: FSDP module {name} has {len(groups)} parameter groups (a per-parameter "
                "mesh); FSDP's reduce-scatter and all-reduce hooks take one"
            )
        for g in groups:
            if replicating and _mesh_kind(g) == "native-replicate":
                raise ValueError(
                    f"compress_fsdp: FSDP module {name} is on a mesh with a replicate dimension (PyTorch's "
                    "HSDP or replicate()), which FSDP all-reduces densely before any hook runs. Shard on "
                    "the 1-D mesh, fully_shard(m, mesh=mesh['shard']), and pass "
                    "replicate_group=mesh['replicate'].get_group(); for replicate() use "
                    "gradsync.fsdp.replicate"
                )
            if compressing:
                comp._check_dtype(name, _reduce_dtype(g))
    if replicating:
        _check_replicas(modules, replicate_group)
    for name, m in modules:
        if not _groups(m):
            continue
        if where in ("shard", "both"):
            m.set_custom_reduce_scatter(_CompressedReduceScatter(comp, name, m))
            comp.streams.add(f"{name}/rs")
        if replicating:
            m.set_all_reduce_hook(partial(comp.all_reduce, name))
            comp.streams.add(f"{name}/ar")
        if compressing:
            m.set_reduce_scatter_unused_params(True, recurse=False)
    return comp


def _check_replicas(modules: list[tuple[str, FSDPModule]], group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if the ranks of ``group`` hold different parameters (a checksum per
    FSDP module, all-gathered): FSDP does not broadcast, and replicas that start apart stay apart."""
    assert group is not None
    sums = []
    for _, m in modules:
        for g in _groups(m):
            for fp in g.fsdp_params:
                local = (
                    fp.sharded_param.to_local() if hasattr(fp.sharded_param, "to_local") else fp.sharded_param
                )
                sums.append(local.detach().double().sum())
    device = P.comm_device(group)
    mine = torch.stack(sums).to(device) if sums else torch.zeros(1, dtype=torch.float64, device=device)
    every = [torch.empty_like(mine) for _ in range(group.size())]
    dist.all_gather(every, mine, group=group)
    if any(not torch.equal(e, every[0]) for e in every):
        raise ValueError(
            "compress_fsdp: the ranks of replicate_group hold different parameters; seed every rank the "
            "same before building the model (FSDP does not broadcast them)"
        )


__all__ = ["WHERE", "FsdpCompression", "compress_fsdp"]
