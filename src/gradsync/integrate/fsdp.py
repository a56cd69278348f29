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
everywhere in gradsync), but without momentum correction (``ef:momentum``: the optimizer keeps
its momentum). Plain ``fp16`` / ``bf16`` are those codecs (16-bit payloads). Hierarchical
schemes (``hitopk``, ``+local``) and ``auto`` are refused: under FSDP the hierarchy is the mesh.

What error feedback owes is kept per FSDP module and role (``<module>/rs``, ``<module>/ar``); the
layout of a module's flat gradient is fixed by making FSDP reduce zero gradients for parameters
that got none (``set_reduce_scatter_unused_params``): with error feedback a parameter unused in
one step still has gradient owed to it. Each stream remembers its layout (which parameters, which
of FSDP's dim-0 chunks of each, the factor to the final gradient); when it changes (a parameter's
``requires_grad`` toggled, another dtype) the stream's residuals are traced back to parameters
through it and kept in the :class:`~gradsync.sync.ledger.Ledger`'s carry until a reduction of the module
takes them in; :meth:`FsdpCompression.owed_gradients` reports the residuals and the carry per
parameter name. Memory: the reduce-scatter's residual is as large as the module's *unsharded*
gradient (each rank compresses its whole local gradient), the all-reduce's as large as the shard.

Divide factors: FSDP divides by the world size (a mean) unless ``set_gradient_divide_factor``
gave a factor, which it then divides the sum over every rank by. The replicate all-reduce takes
the mean over the replicas in the first case and their sum in the second, as native HSDP does.

Mixed precision: with ``grad_scaler=`` the loss scale is read once per round (a backward pass)
and error feedback keeps its residuals unscaled; every reduction of the round first agrees on
inf/NaN in any rank's gradient (one tiny all-reduce over the default group), and from the first
overflow on, every rank undoes what the round did to its residuals and the carry and fills the
remaining reductions with NaN, so that every rank's GradScaler skips the step. Float16 compute
or reduction with a compressed scheme needs ``grad_scaler``; bfloat16 does not.

Dense warm-up (``dense_warmup_steps``), small modules (``min_compress_bytes``) and sizes the
codec refuses go through the dense collective; the same decision is made on every rank (it
depends on sizes and call counts only). At construction every rank checks its arguments, then
all ranks of the default group compare their configuration and model (hashes in one small
all-gather) before any other collective. :meth:`FsdpCompression.state_dict` saves the residuals,
carry, layouts and call counts of this rank; loading keeps tensors on the device they were
loaded to, and they follow the gradient's device at first use.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
from gradsync.collectives.strategies import (
    DEFAULT_STRATEGY,
    Coder,
    compressed_strategy,
    reduce_scatter_pieces,
    run_strategy,
)
from gradsync.integrate.agreement import explain_models, model_fingerprint
from gradsync.sync import host_reads
from gradsync.sync.bucket_sync import nonfinite_flag
from gradsync.sync.carry import Layouts, Piece
from gradsync.sync.checkpoint import front_state, must_reset
from gradsync.sync.codec_set import resident_on
from gradsync.sync.fsdp_scheme import parse_fsdp_scheme
from gradsync.sync.ledger import Ledger
from gradsync.sync.round import Round, RoundFlags
from gradsync.sync.scheme import Scheme

log = logging.getLogger("gradsync")

WHERE = ("shard", "replicate", "both")
STATE_FORMAT = "gradsync.fsdp/4"
_OLDER_FORMATS = ("gradsync.fsdp/3", "gradsync.fsdp/2", "gradsync.fsdp/1")
"""/3: one ``codec`` instead of the ledger's ``codecs``; /2: no signature; /1: no carry, no layouts."""
_SIGNED_FORMATS = (STATE_FORMAT, "gradsync.fsdp/3")


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


def _post_divide(group: Any) -> float:
    """The factor FSDP divides the reduced shard by after the reduce-scatter and the all-reduce
    hook (1 unless it reduces in float16, where it splits the mean's division around the sum)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    _, post, _, _ = _get_gradient_divide_factors(
        group._reduce_scatter_process_group if _mesh_kind(group) == "fsdp" else None,
        None,
        group._reduce_dtype or _reduce_dtype(group),
        group.device.type,
        group.gradient_divide_factor,
        group.force_sum_reduction_for_comms,
    )
    return float(post or 1.0)


# ---------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class _Member:
    """A parameter in an FSDP module's flat gradient: its name (relative to the module given to
    :func:`compress_fsdp`), its numel, and the numel of one rank's padded dim-0 chunk of it."""

    name: str
    numel: int
    chunk: int


def _members(group: Any, names: dict[int, str]) -> tuple[_Member, ...] | None:
    """The parameters FSDP reduces this step, in its order (those that train: with a compressed
    scheme it reduces zeros for unused ones), or None where the layout is not FSDP's plain one
    (a parameter sharded on another dim than 0, or one without a name)."""
    out = []
    for fp in group.fsdp_params:
        if not fp.sharded_param.requires_grad:
            continue
        placement = getattr(fp, "fsdp_placement", None)
        name = names.get(id(fp.sharded_param))
        if name is None or (placement is not None and placement.dim != 0):
            return None
        out.append(_Member(name, int(fp._orig_size.numel()), int(fp.padded_sharded_param_size.numel())))
    return tuple(out)


@dataclass
class _StreamLayout:
    """How one stream's flat input (``<module>/rs``: the module's whole gradient, rank j's chunk
    of every parameter in row j; ``<module>/ar``: this rank's row) maps to parameters, and the
    factor that turns its elements into the final gradient's units (``to_final``): FSDP's
    geometry, which the :class:`~gradsync.sync.ledger.Ledger` traces what is owed through."""

    members: tuple[_Member, ...]
    rows: tuple[int, ...]  # the chunk index of each row of the input
    dtype: str
    to_final: float

    @property
    def signature(self) -> tuple[Any, ...]:
        return (self.members, self.rows, self.dtype)

    def pieces(self) -> list[Piece]:
        """The input element by element: row by row, each member's chunk (the part of it past
        the parameter's end is FSDP's padding, which belongs to no parameter)."""
        out = []
        for j in self.rows:
            for m in self.members:
                lo = j * m.chunk
                n = max(0, min(m.chunk, m.numel - lo))
                if n:
                    out.append(Piece(m.name, m.numel, lo, n))
                if m.chunk - n:
                    out.append(Piece("", 0, 0, m.chunk - n))
        return out

    def numel(self) -> int:
        return len(self.rows) * sum(m.chunk for m in self.members)

    def to_state(self) -> dict[str, Any]:
        return {
            "members": [[m.name, m.numel, m.chunk] for m in self.members],
            "rows": list(self.rows),
            "dtype": self.dtype,
            "to_final": self.to_final,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> _StreamLayout:
        return cls(
            tuple(_Member(str(n), int(c), int(k)) for n, c, k in state["members"]),
            tuple(int(j) for j in state["rows"]),
            str(state["dtype"]),
            float(state["to_final"]),
        )


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
        with host_reads.watching():  # (autograd runs FSDP's hooks outside the caller's torch modes)
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
        grad_scaler: Any | None = None,
        resident: bool | None = None,
    ) -> None:
        self.scheme = parse_fsdp_scheme(scheme)
        self.where = where
        self.replicate_group = replicate_group
        self.codec: Compressor | None = self.scheme.build(error_feedback, resident=bool(resident))
        self.resident = resident
        """Resident mode for the codec (None: chosen once, by the gradients' device at the first
        compressed reduction)."""
        self.dense_warmup_steps = dense_warmup_steps
        self.min_compress_bytes = min_compress_bytes
        self.grad_scaler = grad_scaler
        self.calls: dict[str, int] = {}
        """Collective calls so far per stream (``<module>/rs``, ``<module>/ar``)."""
        self.traffic = P.Traffic()
        self.decided: dict[str, str | None] = {}
        """Per stream, after its first call past the warm-up: why it goes dense (None: compressed)."""
        self.streams: set[str] = set()
        """The streams :func:`compress_fsdp` installed (``<module>/rs``, ``<module>/ar``)."""
        self.ledger = Ledger([self.codec] if self.codec is not None else [])
        self.round = Round(self.ledger)
        """The iteration around the ledger (:mod:`gradsync.sync.round`): FSDP agrees on an overflow
        reduction by reduction, so the round ends at the first one, rolled back."""
        """What error feedback owes: the codec's streams and, per parameter, what streams whose
        layout changed still owed (its carry, in the final gradient's units, unscaled), with the
        round an overflow undoes (:mod:`gradsync.sync.ledger`: the same object ``wrap``'s engine
        and the DDP hook drive)."""
        self.layouts: dict[str, _StreamLayout] = {}
        """Each stream's layout at its last call (what its residual's elements belong to)."""
        self.loss_scale = 1.0
        """The loss scale the gradients of this round carry (read from ``grad_scaler``)."""
        self._warned = False
        self._warned_waiting: set[str] = set()
        # the streams called in this round (one backward pass: a stream called again starts the
        # next); whether some rank overflowed in it is the round's state (rolled back)
        self._called: set[str] = set()
        # set by compress_fsdp: the FSDP module of each module key, parameter names by id
        self._modules: dict[str, FSDPModule] = {}
        self._names: dict[int, str] = {}

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

    def _check_dtype(self, key: str, dtype: torch.dtype) -> None:
        if dtype == torch.float16 and self.grad_scaler is None:
            raise ValueError(
                f"compress_fsdp: {key} reduces in float16, which trains with loss scaling: pass "
                "grad_scaler= (the torch.amp.GradScaler that scales the loss; residuals are then kept "
                "unscaled and an overflowing step is skipped on every rank), or reduce in bfloat16 or "
                "float32 (MixedPrecisionPolicy(param_dtype=torch.bfloat16) or reduce_dtype=torch.float32)"
            )

    # ------------------------------------------------------------------ rounds and overflow
    def _enter(self, key: str) -> None:
        """A stream's call: the first call of a round (a stream called again starts the next
        one) opens it for rollback and reads the loss scale."""
        if self._called and key not in self._called:
            self._called.add(key)
            return
        self._called = {key}
        self.round.begin()
        scaler = self.grad_scaler
        if scaler is not None and scaler.is_enabled():
            self.loss_scale = host_reads.read_loss_scale(scaler)

    def _overflowed(self, flat: torch.Tensor) -> bool:
        """Whether some rank's gradient overflowed in this round, agreed by every rank (a tiny
        all-reduce per reduction, with ``grad_scaler`` and a compressed scheme only). The first
        time: every rank undoes what the round did to its residuals and to the carry."""
        if self.round.rolled_back:
            return True
        if self.grad_scaler is None or self.codec is None:
            return False
        flag = nonfinite_flag(flat).to(torch.float32).reshape(1)
        P.all_reduce(flag, None, "control", op=dist.ReduceOp.MAX)
        if float(flag) == 0.0:
            return False
        self.round.end(RoundFlags(overflow=True))  # (the caller poisons its own output)
        return True

    # ------------------------------------------------------------------ layouts and carry
    def _layout(
        self, module_key: str, flat: torch.Tensor, rows: tuple[int, ...], to_final: float
    ) -> _StreamLayout | None:
        m = self._modules.get(module_key)
        if m is None:
            return None
        groups = _groups(m)
        members = _members(groups[0], self._names) if groups else None
        if members is None:
            return None
        layout = _StreamLayout(members, rows, str(flat.dtype), to_final)
        return layout if layout.numel() == flat.numel() else None

    def _settle_layout(
        self, key: str, module_key: str, flat: torch.Tensor, layout: _StreamLayout | None, inject: bool
    ) -> None:
        """Before a stream encodes: if its layout changed since its last call (a parameter's
        ``requires_grad`` was toggled, another dtype), what its residuals owed goes to the
        carry; then what the carry holds for this module's parameters goes into ``flat``."""
        before = self.layouts.get(key)
        if (
            self.codec is not None
            and before is not None
            and (layout is None or before.signature != layout.signature)
        ):
            layouts = Layouts().add(key, before.pieces(), before.to_final)
            self.ledger.end_streams(lambda k: not k.startswith(f"{key}/"), layouts, strict=False)
        if layout is None:
            self.layouts.pop(key, None)
            return
        self.layouts[key] = layout
        if inject and self.ledger.carry.local:
            self.ledger.inject(flat, layout.pieces(), self.loss_scale / layout.to_final, take=True)
            here = {m.name for m in layout.members}
            waiting = sorted(
                n for n in self.ledger.carry.local if n not in here and n in self._params_of(module_key)
            )
            if waiting and module_key not in self._warned_waiting:
                self._warned_waiting.add(module_key)
                warnings.warn(
                    f"gradsync fsdp: {module_key}: gradient that error feedback owed to {len(waiting)} "
                    f"parameters ({', '.join(waiting[:3])}) waits until they train again (their "
                    "requires_grad is False); owed_gradients() shows it",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _params_of(self, module_key: str) -> set[str]:
        m = self._modules.get(module_key)
        if m is None:
            return set()
        return {
            self._names[id(fp.sharded_param)]
            for g in _groups(m)
            for fp in g.fsdp_params
            if id(fp.sharded_param) in self._names
        }

    def _replicate_sums(self, module_key: str) -> bool:
        """Whether the replicate all-reduce sums instead of averaging: FSDP then divides by the
        user's ``set_gradient_divide_factor`` factor alone, as native HSDP does."""
        m = self._modules.get(module_key)
        return m is not None and any(g.gradient_divide_factor is not None for g in _groups(m))

    def _post(self, module_key: str) -> float:
        m = self._modules.get(module_key)
        groups = _groups(m) if m is not None else []
        return _post_divide(groups[0]) if groups else 1.0

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
        self._enter(key)
        if self._overflowed(inp):
            out.fill_(float("nan"))  # every rank's GradScaler skips the step
            self.calls[key] = self.calls.get(key, 0) + 1
            return
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
        to_final = scale / self._post(module_key)
        if self.where == "both" and self.replicate_group is not None and not self._replicate_sums(module_key):
            to_final /= self.replicate_group.size()
        flat = inp.view(-1)
        self._settle_layout(
            key, module_key, flat, self._layout(module_key, flat, tuple(range(p)), to_final), True
        )
        why = self._dense_reason(key, inp.numel(), p, inp.element_size())
        self._note(key, why)
        self.calls[key] = self.calls.get(key, 0) + 1
        if why is not None:
            dist.reduce_scatter_tensor(out, inp, op=op, group=group)
            self.traffic.add("shard", (p - 1) / p * inp.numel() * inp.element_size(), "reduce_scatter")
            return
        self._check_dtype(module_key, inp.dtype)
        coder = Coder(self._resident_codec(inp.device), key, self.loss_scale)

        def program() -> Program:
            pieces = yield from reduce_scatter_pieces(flat, group, "shard", coder)
            return partial(apply_pieces, pieces, out.view(-1), coder.plain, scale)

        with P.record_traffic() as t:
            run(program())
        self._count(t)

    def _resident_codec(self, device: torch.device) -> Compressor:
        """The codec, its resident mode chosen at the first compressed reduction (by ``device``,
        unless ``resident`` was given) and kept: the codec refuses a change once it has encoded."""
        assert self.codec is not None
        if self.resident is None:
            self.resident = resident_on(None, device)
            self.codec.set_resident(self.resident)
        return self.codec

    def watched_all_reduce(self, module_key: str, shard: torch.Tensor) -> None:
        """:meth:`all_reduce` as FSDP's hook calls it (seen by an audit of host reads)."""
        with host_reads.watching():
            self.all_reduce(module_key, shard)

    def all_reduce(self, module_key: str, shard: torch.Tensor) -> None:
        """The replicate dimension's all-reduce of one module's reduced shard, in place: the mean
        over the replicas, or their sum where the module has a gradient divide factor
        (``set_gradient_divide_factor``: FSDP divides by it alone, as native HSDP does)."""
        group = self.replicate_group
        assert group is not None
        key = f"{module_key}/ar"
        r = group.size()
        if r == 1:
            return
        keep_alive_on_this_stream(shard)
        self._enter(key)
        if self._overflowed(shard):
            shard.fill_(float("nan"))
            self.calls[key] = self.calls.get(key, 0) + 1
            return
        summed = self._replicate_sums(module_key)
        scale = 1.0 if summed else 1.0 / r
        m = self._modules.get(module_key)
        groups = _groups(m) if m is not None else []
        own = 0  # the row of the module's gradient this rank's shard is
        if groups and _mesh_kind(groups[0]) == "fsdp":
            own = max(dist.get_rank(groups[0]._reduce_scatter_process_group), 0)
        flat = shard.view(-1)
        layout = self._layout(module_key, flat, (own,), scale / self._post(module_key))
        self._settle_layout(key, module_key, flat, layout, self.where == "replicate")
        strategy = compressed_strategy(self.scheme.strategy or DEFAULT_STRATEGY)
        why = self._dense_reason(key, shard.numel(), r if strategy.pieces else 1, shard.element_size())
        self._note(key, why)
        self.calls[key] = self.calls.get(key, 0) + 1
        if why is not None:
            dist.all_reduce(shard, op=dist.ReduceOp.SUM if summed else dist.ReduceOp.AVG, group=group)
            self.traffic.add(
                "replicate", 2 * (r - 1) / r * shard.numel() * shard.element_size(), "all_reduce"
            )
            return
        self._check_dtype(module_key, shard.dtype)
        coder = Coder(self._resident_codec(shard.device), key, self.loss_scale)
        rank = dist.get_rank()

        def program() -> Program:
            pieces = yield from run_strategy(flat, group, "replicate", coder, strategy.name, rank, final=True)
            return partial(apply_pieces, pieces, flat, coder.plain, scale)

        with P.record_traffic() as t:
            run(program())
        self._count(t)

    # ------------------------------------------------------------------ what is owed
    def residual_norm(self) -> float:
        """The L2 norm of everything error feedback still owes on this rank (0 without it)."""
        norm = self.codec.residual_norm() if self.codec is not None else None
        return float(norm or 0.0)

    def owed_gradients(self) -> dict[str, torch.Tensor]:
        """What this rank still owes the mean gradient, per parameter name (relative to the
        module given to :func:`compress_fsdp`): flat, unscaled, in the units of the gradient
        FSDP leaves in ``param.grad`` (the mean over the ranks, or the sum divided by
        ``set_gradient_divide_factor``'s factor). The ranks' values add up to everything error
        feedback held back and has not applied yet, as ``HookState.owed_gradients`` for the DDP
        hook and ``engine.owed_gradients`` for ``wrap``. Call it between steps."""
        layouts = Layouts()
        for key, layout in self.layouts.items():
            layouts.add(key, layout.pieces(), layout.to_final)
        return self.ledger.owed_gradients(layouts, 1, strict=False)

    # ------------------------------------------------------------------ state
    def signature(self) -> dict[str, Any]:
        """What a checkpoint must match: world, scheme, where, codec and the parameters."""
        return {
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "scheme": self.scheme.text,
            "where": self.where,
            "codecs": [] if self.codec is None else [self.codec.spec()],
            "params": sorted(self._names.values()),
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals, codec streams, carry, layouts and call counts (save one per
        rank): tensors and plain values, as they are (``torch.load(..., weights_only=True)``),
        in the envelope of :mod:`gradsync.sync.checkpoint` (its ``step``: the synchronizations of
        the most-called stream), with the signature a load checks."""
        return front_state(
            STATE_FORMAT, dist.get_rank() if dist.is_initialized() else 0, self.signature(),
            max(self.calls.values(), default=0), self.ledger,
            scheme=self.scheme.text, where=self.where, calls=dict(self.calls),
            layouts={k: v.to_state() for k, v in self.layouts.items()},
        )  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], reset_compression_state: bool = False) -> None:
        """Restore :meth:`state_dict`. Tensors stay where they were loaded (``map_location``):
        each follows its gradient's device at its first use. A state saved under another world,
        scheme, placement, codec or model, or by another rank, is refused naming the difference
        (the same check as ``wrap``'s and the DDP hook's); with ``reset_compression_state=True``
        it is left out with a warning and the compression state starts afresh."""
        if not isinstance(state, dict) or state.get("format") not in (STATE_FORMAT, *_OLDER_FORMATS):
            raise ValueError(f"FsdpCompression.load_state_dict: not a {STATE_FORMAT} state")
        rank = dist.get_rank() if dist.is_initialized() else 0
        fmt = state["format"]
        if fmt in _SIGNED_FORMATS and must_reset(state, self.signature(), rank, reset_compression_state, fmt):
            self.ledger.reset()
            self.layouts = {}
            self._called = set()
            return
        for field in ("scheme", "where"):
            mine = self.scheme.text if field == "scheme" else self.where
            if state[field] != mine:
                raise ValueError(
                    f"FsdpCompression.load_state_dict: the state was saved with {field}={state[field]!r}, "
                    f"this compression has {field}={mine!r}"
                )
        self.calls = {str(k): int(v) for k, v in state["calls"].items()}
        self.ledger.load_state_dict(state)
        self.layouts = {str(k): _StreamLayout.from_state(v) for k, v in (state.get("layouts") or {}).items()}
        self._called = set()


def keep_alive_on_this_stream(buffer: torch.Tensor) -> None:
    """Tell the caching allocator that ``buffer`` is used on the current stream (CUDA only).

    FSDP calls the all-reduce hook on its all-reduce stream with the reduce-scatter's output,
    which it allocated on the reduce-scatter stream. Native HSDP keeps that buffer alive across
    layers; through the hook nothing does, so where the reduce dtype differs from the
    parameters' the buffer is freed once FSDP has cast it, and the next layer's reduce-scatter
    could reuse its memory while this stream's kernels (the hook's, and the cast) still read it.
    Recording the stream makes the allocator wait for them first."""
    if buffer.is_cuda:
        buffer.record_stream(torch.cuda.current_stream(buffer.device))


def _check_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"compress_fsdp: {name} must be an integer >= 0, got {value!r}")
    return value


def _check_scaler(grad_scaler: object) -> None:
    methods = ("get_scale", "is_enabled")
    if grad_scaler is not None and not all(callable(getattr(grad_scaler, m, None)) for m in methods):
        raise ValueError(
            "compress_fsdp: grad_scaler must be None or a torch.amp.GradScaler (something with "
            f"get_scale() and is_enabled()), got {type(grad_scaler).__name__}"
        )


def _describe(
    scheme: str,
    replicate_group: dist.ProcessGroup | None,
    where: str | None,
    error_feedback: bool | None,
    dense_warmup_steps: int,
    min_compress_bytes: int,
    grad_scaler: Any | None,
    resident: bool | None = None,
) -> str:
    """The configuration as text, compared across ranks at start-up."""
    replicas = replicate_group.size() if isinstance(replicate_group, dist.ProcessGroup) else None
    return (
        f"scheme={Scheme.parse(scheme).text if isinstance(scheme, str) else scheme!r} where={where} "
        f"replicas={replicas} error_feedback={error_feedback} dense_warmup_steps={dense_warmup_steps} "
        f"min_compress_bytes={min_compress_bytes} grad_scaler={grad_scaler is not None} resident={resident}"
    )


_OPTIONS = ("error_feedback", "dense_warmup_steps", "min_compress_bytes", "grad_scaler", "resident")


def _check_resident(resident: object) -> None:
    if resident is not None and not isinstance(resident, bool):  # (1 == True: no `in` test)
        raise ValueError(f"compress_fsdp: resident must be None, True or False, got {resident!r}")


def describe_options(scheme: str, options: dict[str, Any]) -> str:
    """The configuration :func:`gradsync.fsdp.replicate` passes on, checked (``ValueError`` for a
    bad scheme or option) and as text for the start-up agreement."""
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(
            f"gradsync.fsdp.replicate: unknown option(s) {', '.join(unknown)}; the options are "
            f"{', '.join(_OPTIONS)} (and blocks=, mp_policy=)"
        )
    parse_fsdp_scheme(scheme)
    error_feedback = options.get("error_feedback")
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ValueError(f"compress_fsdp: error_feedback must be None, True or False, got {error_feedback!r}")
    warmup = _check_int("dense_warmup_steps", options.get("dense_warmup_steps", 0))
    min_bytes = _check_int("min_compress_bytes", options.get("min_compress_bytes", 16384))
    _check_scaler(options.get("grad_scaler"))
    _check_resident(options.get("resident"))
    return _describe(
        scheme, None, "replicate", error_feedback, warmup, min_bytes, options.get("grad_scaler"),
        options.get("resident"),
    )  # fmt: skip


def agree(build: Callable[[], Any], describe: Callable[[], str], module: nn.Module | None) -> Any:
    """``build()`` (which checks the arguments and may raise ``ValueError``/``TypeError``), then,
    before any other collective, check that every rank of the default process group was given
    the same configuration and model (hashes exchanged as one small tensor, as
    :func:`gradsync.integrate.agreement.agreed` does for wrap and the DDP hook): a rank that
    differs, or failed, makes every rank raise an error that names the differing ranks."""
    error: Exception | None = None
    value = None
    try:
        value = build()
        text = describe()
    except (ValueError, TypeError) as e:
        error, text = e, f"invalid: {e}"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        P.check_same(
            None, "gradsync fsdp start-up", {"parameters": explain_models},
            config=text, parameters=model_fingerprint(module),
        )  # fmt: skip
    if error is not None:
        raise error
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
    grad_scaler: Any | None = None,
    resident: bool | None = None,
) -> FsdpCompression:
    """Compress the gradient synchronization of every FSDP module in ``module`` (after
    ``fully_shard``, before the first backward pass).

    ``where``: ``"shard"`` (the reduce-scatter; the default without ``replicate_group``),
    ``"replicate"`` (the all-reduce across ``replicate_group``, done by the hook; the default
    with it) or ``"both"``. ``error_feedback``: None adds it to biased codecs, True always, False
    never. The first ``dense_warmup_steps`` synchronizations of each module are dense, and so
    is every module gradient under ``min_compress_bytes``. ``grad_scaler``: the
    ``torch.amp.GradScaler`` that scales the loss (needed for float16 compute or reduction with
    a compressed scheme): residuals are kept unscaled, and a step in which any rank's gradient
    overflowed is skipped by every rank's scaler and leaves every rank's residuals as they were.
    ``resident``: the codec's resident mode (:meth:`gradsync.codecs.Compressor.set_resident`:
    fixed-size payloads, no size exchange, statistics on the device); None: on where the
    gradients are on a GPU.

    Every argument is checked on every rank, then every rank of the default process group
    checks that all were given the same configuration and model (one small all-gather), before
    any other collective; then the ranks of ``replicate_group`` check that they hold the same
    parameters (one small all-gather).
    """
    options = (
        replicate_group, where, error_feedback, dense_warmup_steps, min_compress_bytes, grad_scaler, resident
    )  # fmt: skip
    comp = agree(lambda: _build(module, scheme, *options), lambda: _describe(scheme, *options), module)
    assert isinstance(comp, FsdpCompression)
    modules = _fsdp_modules(module)
    replicating = comp.where in ("replicate", "both")
    if replicating:
        _check_replicas(modules, replicate_group)
    compressing = comp.codec is not None
    comp._names = {id(p): n for n, p in module.named_parameters()}
    for name, m in modules:
        if not _groups(m):
            continue
        comp._modules[name] = m
        if comp.where in ("shard", "both"):
            m.set_custom_reduce_scatter(_CompressedReduceScatter(comp, name, m))
            comp.streams.add(f"{name}/rs")
        if replicating:
            m.set_all_reduce_hook(partial(comp.watched_all_reduce, name))
            comp.streams.add(f"{name}/ar")
        if compressing:
            m.set_reduce_scatter_unused_params(True, recurse=False)
    return comp


def _build(
    module: nn.Module,
    scheme: str,
    replicate_group: dist.ProcessGroup | None,
    where: str | None,
    error_feedback: bool | None,
    dense_warmup_steps: int,
    min_compress_bytes: int,
    grad_scaler: Any | None,
    resident: bool | None = None,
) -> FsdpCompression:
    """Check every argument (no collective) and build the compression."""
    if where is None:
        where = "replicate" if replicate_group is not None else "shard"
    if where not in WHERE:
        raise ValueError(f"compress_fsdp: where must be one of {', '.join(WHERE)}, got {where!r}")
    _check_int("dense_warmup_steps", dense_warmup_steps)
    _check_int("min_compress_bytes", min_compress_bytes)
    _check_scaler(grad_scaler)
    _check_resident(resident)
    if error_feedback is not None and not isinstance(error_feedback, bool):
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
        grad_scaler=grad_scaler,
        resident=resident,
    )
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
            if comp.codec is not None:
                comp._check_dtype(f"FSDP module {name}", _reduce_dtype(g))
                if g.mp_policy.param_dtype == torch.float16 and grad_scaler is None:
                    raise ValueError(
                        f"compress_fsdp: FSDP module {name} computes in float16 (param_dtype), which trains "
                        "with loss scaling: pass grad_scaler= (the torch.amp.GradScaler that scales the "
                        "loss), or compute in bfloat16 (MixedPrecisionPolicy(param_dtype=torch.bfloat16))"
                    )
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
