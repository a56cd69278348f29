"""Error feedback (residual accumulation) around any lossy codec, with the RedSync paper's
Algorithm 4.

Per tensor stream the wrapper keeps a residual ``r`` of everything not yet transmitted::

    v = r + g                  (plain)
    u = m * u + g;  v = r + u  (momentum correction)
    u = m * (u + g); v = r + u + g  (Nesterov momentum correction)
    payload = encode(v);  r = v - decode(payload)
    u[transmitted] = 0         (momentum-factor masking, with momentum)

so ``g + r_old == decode(payload) + r_new`` holds exactly (the invariant the tests check). With
momentum correction the optimizer must run without momentum: it has moved in here.

Mixed precision: ``loss_scale`` is the scale the incoming gradient carries. The residual and
momentum are kept in the current scale's units for speed and rescaled when it changes;
:meth:`ErrorFeedback.state_dict` stores them unscaled. A gradient with inf/NaN produces a flagged
payload and leaves every piece of state untouched, so the step a GradScaler skips never leaks
into the residual.

Half-precision gradients are accumulated in float32 (the residual and momentum are float32),
and what is compressed is that sum rounded back to the gradient's dtype: the payload is in the
gradient's dtype, as every receiver expects (it sizes payloads by the tensor it reduces), and
costs half-precision bytes on the wire. The rounding error is not lost: the residual keeps
``sum - decode(payload)`` in float32, so the invariant above still holds exactly. A float16 sum
beyond float16's range becomes inf, which flags the payload like an overflowing gradient (the
GradScaler lowers its scale, which shrinks the residual with it).

One pass where it can: with nothing but ``v = r + g`` to accumulate (no momentum, no clipping,
no half-precision gradient) the codec receives ``r`` and ``g`` apart and adds them while it reads
(:meth:`~gradsync.codecs.Codec.encode_sum`; the scanning sparsifiers do it in their first scan),
so ``v`` is written once and not read back. Payload and residual are the same bits either way.

Local clipping (``clip``): before accumulation the gradient is scaled so that its L2 norm
(unscaled) is at most ``clip``. The RedSync paper clips with the global threshold divided by
sqrt(world size); this wrapper sees one tensor at a time, so ``clip`` is a per-tensor bound.

References:

- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradsync.codecs.base import Codec, EncodeContext, follow_device
from gradsync.codecs.compressor import Compressor, Owed
from gradsync.codecs.config import OptionsConfig, check_range
from gradsync.codecs.ops import sparse_add_
from gradsync.codecs.payload import Payload, allocate


@dataclass(frozen=True)
class FeedbackConfig(OptionsConfig):
    codec: ClassVar[str] = "ef"
    momentum: float = 0.0
    nesterov: bool = False
    masking: bool = True
    clip: float | None = None
    decay: float = 1.0
    """The residual's weight when the next gradient joins it (``v = decay * r + g``): below 1 an
    old residual fades instead of being owed for ever, SparseLoCo's error feedback in place of
    momentum. The invariant becomes ``g + decay * r_old == sent + r_new``."""

    def validate(self) -> None:
        check_range(self.codec, "momentum", self.momentum, 0.0, 1.0, hi_open=True)
        check_range(self.codec, "decay", self.decay, 0.0, 1.0, lo_open=True)
        if self.nesterov and self.momentum == 0.0:
            raise ValueError(f"{self.codec}: nesterov needs momentum > 0")
        if self.clip is not None:
            check_range(self.codec, "clip", self.clip, 0.0, lo_open=True)


_HALF = (torch.float16, torch.bfloat16)


@dataclass
class FeedbackStream:
    residual: torch.Tensor | None = None  # flat, in units of `scale`
    momentum: torch.Tensor | None = None  # flat, in units of `scale`
    scale: float = 1.0
    offset: int = 0  # EncodeContext.offset of the last encode: where the caller's elements start
    # work buffers (not state): the next residual / momentum is computed here, then swapped in
    spare: torch.Tensor | None = None
    spare_u: torch.Tensor | None = None
    # the step between accumulate() and commit()/discard()
    pending: torch.Tensor | None = None
    pending_u: torch.Tensor | None = None
    # committed since begin_round(): the previous residual / momentum are in spare / spare_u
    committed: bool = False
    # a replayed encode of a half-precision gradient: the sum rounded to the gradient's dtype
    wire: torch.Tensor | None = None


def _warn_lost(key: str, s: FeedbackStream, numel: int) -> None:
    """A stream handed a gradient of another size: its residual cannot be placed in it. The
    layers above take a stream before its layout changes (:mod:`gradsync.sync.carry`); reaching
    this is a caller that did not, so what is dropped is said, never silently."""
    assert s.residual is not None
    lost = float(torch.linalg.vector_norm(s.residual.double())) / s.scale
    if lost > 0 or (s.momentum is not None and bool(s.momentum.any())):
        warnings.warn(
            f"gradsync: error-feedback stream {key!r} held {s.residual.numel()} elements and was "
            f"handed {numel}: its residual (norm {lost:.3g}) is dropped; the tensors it belonged "
            "to changed (a parameter's requires_grad toggled, or another layout)",
            RuntimeWarning,
            stacklevel=4,
        )


def _buffer(spare: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if spare is None or spare.shape != like.shape or spare.dtype != like.dtype or spare.device != like.device:
        return torch.empty_like(like)
    return spare


class ErrorFeedback(Compressor):
    """Wrap a codec with error feedback; the same :class:`Compressor` protocol as the codec,
    with the codec's traits."""

    error_feedback = True
    fuse_sum = True
    """Hand the codec the residual and the gradient apart, for it to add them in its first pass
    (:meth:`~gradsync.codecs.Codec.encode_sum`), when nothing else is accumulated (no momentum,
    no clipping, no half-precision gradient). False: add first, then encode (the same payload
    and residual; ``gradsync bench codecs --ef`` times both)."""

    def __init__(self, codec: Codec, config: FeedbackConfig | None = None) -> None:
        config = config or FeedbackConfig()
        if not isinstance(codec, Codec):
            raise ValueError(
                "error feedback wraps a codec"
                + (" (it is already applied to this one)" if isinstance(codec, Compressor) else "")
                + f", got {type(codec).__name__}"
            )
        if config.momentum > 0 and not codec.sparse:
            raise ValueError(
                "ef: momentum correction needs a sparsifying codec (topk, mstopk, dgc, ...), "
                f"got {codec.name!r}; use the optimizer's momentum instead"
            )
        self.codec = codec
        self.config = config
        self.name = codec.name
        for trait in (
            "sparse",
            "lossless",
            "randomized",
            "summable",
            "agreed_scale",
            "lowrank",
            "per_tensor",
            "biased",
        ):
            setattr(self, trait, getattr(codec, trait))
        self._streams: dict[str, FeedbackStream] = {}

    @property
    def plain(self) -> Codec:
        return self.codec

    def spec(self) -> str:
        return f"{self.codec.config.spec()}+{self.config.spec()}"

    def fresh(self) -> ErrorFeedback:
        return ErrorFeedback(self.codec.fresh(), self.config)

    def encode(
        self,
        grad: torch.Tensor,
        ctx: EncodeContext | None = None,
        *,
        out: torch.Tensor | None = None,
        loss_scale: float = 1.0,
    ) -> Payload:
        """Add ``grad`` to the stream's residual, encode the sum, keep what was not sent."""
        ctx = ctx or EncodeContext()
        if self.codec.replays and self.config.clip is None and grad.numel():
            return self._encode_replayed(grad, ctx, out, loss_scale)
        if (
            self.fuse_sum
            and self.config.momentum == 0
            and self.config.clip is None
            and self.config.decay == 1.0
            and grad.dtype not in _HALF
        ):
            # v = r + g is all there is to accumulate: the codec adds it up as it reads (one pass
            # for sparsifiers that scan first) and leaves the sum in v
            s, g = self._stream_for(grad, ctx.key, loss_scale, ctx.offset)
            assert s.residual is not None
            v = _buffer(s.spare, s.residual)
            s.pending, s.pending_u = v, None
            payload = self.codec.encode_sum(s.residual, g, v, grad.shape, ctx, out=out)
        else:
            v = self.accumulate(grad, ctx.key, loss_scale, ctx.offset)
            wire = v if v.dtype == grad.dtype else v.to(grad.dtype)  # see "Half-precision" above
            payload = self.codec.encode(wire.view(grad.shape), ctx, out=out)
        resident = self.codec.resident and self.codec.host_free
        if not resident and payload.nonfinite:
            self.discard(ctx.key)  # a skipped step: residual and momentum stay as they were
            return payload
        sent = self.codec.transmitted(payload)
        if sent is not None:
            self.commit(ctx.key, indices=sent[0], values=sent[1])
        elif grad.dtype == torch.float32 and (factors := self.codec.factors(payload)) is not None:
            self.commit(ctx.key, factors=factors)  # P Q^T in place: its float32 product is the decode
        else:
            self.commit(ctx.key, dense=self.codec.decode(payload).view(-1))
        if resident:  # the flag stays on the device: where it is set, the old state comes back
            self.keep_if(payload.flag_word(), ctx.key)
        return payload

    def _encode_replayed(
        self, grad: torch.Tensor, ctx: EncodeContext, out: torch.Tensor | None, loss_scale: float
    ) -> Payload:
        """:meth:`encode` of a resident codec that replays (:attr:`Codec.replays`): the
        accumulation, the codec's encode, the commit and the undo of a non-finite step as one
        replayed graph over the stream's buffers; Python only picks the buffers before it and
        swaps them after it, as :meth:`commit` does."""
        codec = self.codec
        s, flat = self._stream_for(grad, ctx.key, loss_scale, ctx.offset, convert=False)
        assert s.residual is not None
        r, n, shape = s.residual, flat.numel(), grad.shape
        v = _buffer(s.spare, r)
        m, nesterov = self.config.momentum, self.config.nesterov
        u_old, u_new = s.momentum, (_buffer(s.spare_u, r) if m > 0 else None)
        if flat.dtype != r.dtype:  # a half-precision gradient: the sum is sent in its dtype
            s.wire = _buffer(s.wire, flat)
        else:
            s.wire = None
        decay = self.config.decay
        fused = getattr(codec, "fuses_sum", False) and m == 0 and decay == 1.0 and s.wire is None
        codec.check_numel(n)
        cstream = follow_device(codec.stream(ctx.key), flat.device)
        decided = codec.before_device_work(cstream, flat.device)
        nbytes = codec.max_nbytes(n, shape, grad.dtype)
        data = (
            allocate(nbytes, flat.device, out)
            if out is not None
            else codec.payload_slot(ctx.key, nbytes, flat.device)
        )
        agreed = ctx.amax if isinstance(ctx.amax, torch.Tensor) else None
        inputs = [flat] if agreed is None else [flat, agreed]
        optional = [t for t in (u_old, u_new, s.wire) if t is not None]
        static = [r, v, data, *optional, *codec.device_state(cstream)]

        def work(g: torch.Tensor, *rest: torch.Tensor) -> None:
            c = ctx if agreed is None else dataclasses.replace(ctx, amax=rest[0])
            r, v, data, *more = rest[len(inputs) - 1 :]
            uo = more.pop(0) if u_old is not None else None
            un = more.pop(0) if u_new is not None else None
            wire = more.pop(0) if s.wire is not None else None
            with codec._ops_backend(), codec.bound_state(cstream, more):
                if fused:  # the codec adds r and g as it reads (SparseCodec.encode_sum)
                    codec._encode(v, shape, c, cstream, data, (r, g))  # type: ignore[call-arg]
                else:
                    g = g if g.dtype == r.dtype else g.to(r.dtype)
                    _accumulate_into(v, r, g, uo, un, m, nesterov, 1.0, decay)
                    src = v if wire is None else wire.copy_(v)
                    codec._encode(src, shape, c, cstream, data)
            payload = Payload(data, codec.name, shape, grad.dtype)
            sent = codec.transmitted(payload)
            if sent is not None:
                _subtract_sent(v, un, self.config.masking, True, indices=sent[0], values=sent[1])
            else:
                _subtract_sent(v, un, self.config.masking, True, dense=codec.decode(payload).view(-1))
            _restore_where(payload.flag_word(), v, r, un, uo)

        consts = (tuple(shape), grad.dtype, m, nesterov, self.config.masking, decay, fused, decided, ctx.rank,
                  ctx.summands, None if agreed is not None else ctx.amax)  # fmt: skip
        codec.replayer.run("encode+ef", work, inputs=inputs, static=static, consts=consts)
        codec.after_device_work(cstream)
        s.spare, s.residual = r, v
        if u_new is not None:
            s.spare_u, s.momentum = u_old, u_new
        s.pending = s.pending_u = None
        s.committed = True
        return Payload(data, codec.name, shape, grad.dtype)

    def keep_if(self, flag: torch.Tensor, key: str = "") -> None:
        """Undo the commit just made where the device flag ``flag`` is set (a non-finite input),
        without reading it: the previous residual and momentum are still in the spare buffers."""
        s = self._streams[key]
        if s.residual is not None and s.spare is not None:
            _restore_where(flag, s.residual, s.spare, s.momentum, s.spare_u)

    def owed(self) -> list[Owed]:
        """What every stream still owes, unscaled copies with each stream's offset."""
        return [self._owed(key, s) for key, s in sorted(self._streams.items()) if s.residual is not None]

    @staticmethod
    def _owed(key: str, s: FeedbackStream) -> Owed:
        assert s.residual is not None
        momentum = None if s.momentum is None else s.momentum / s.scale
        return Owed(key, s.offset, s.residual / s.scale, momentum)

    def take_streams(self, keep: Callable[[str], bool]) -> list[Owed]:
        """Drop the streams ``keep`` rejects (and the codec's streams of those keys) and return
        what their residuals and momentum still owed, for the caller to pass on."""
        taken = [
            self._owed(k, s)
            for k, s in sorted(self._streams.items())
            if not keep(k) and s.residual is not None
        ]
        self.drop_streams(keep)
        return taken

    def homes(self) -> dict[str, tuple[int, int]]:
        return {k: (s.offset, s.residual.numel()) for k, s in self._streams.items() if s.residual is not None}

    def rollback_elements(self, key: str, start: int, stop: int) -> bool:
        """Elements ``start:stop`` of stream ``key`` go back to the residual (and momentum) they
        had before this round's commit: what was sent of them was not applied (a parameter no
        rank used, whose synchronized gradient is dropped), so it is still owed."""
        s = self._streams.get(key)
        if s is None or not s.committed or s.residual is None or s.spare is None or start >= stop:
            return False
        s.residual[start:stop].copy_(s.spare[start:stop])
        if s.momentum is not None:  # no momentum before this round's commit: it was zero
            if s.spare_u is None:
                s.momentum[start:stop].zero_()
            else:
                s.momentum[start:stop].copy_(s.spare_u[start:stop])
        return True

    def residual_norm(self) -> float | None:
        """The L2 norm over every stream's residual, in unscaled units (the gradient still owed
        to the model). One pass over the residuals: for telemetry every few steps, not every step."""
        squares = [
            (torch.linalg.vector_norm(s.residual) / s.scale) ** 2
            for s in self._streams.values()
            if s.residual is not None
        ]
        if not squares:
            return 0.0
        return math.sqrt(float(torch.stack([q.cpu() for q in squares]).sum()))

    # The three steps of encode(), for protocols that compress in several rounds (PowerSGD in a
    # collective): accumulate() returns the buffer to compress, commit() takes what was sent.
    def accumulate(
        self, grad: torch.Tensor, key: str = "", loss_scale: float = 1.0, offset: int = 0
    ) -> torch.Tensor:
        """The flat tensor to compress for this step: residual + gradient (with momentum
        correction and clipping as configured). Pending until :meth:`commit` or :meth:`discard`.
        ``offset``: where ``grad`` sits in the caller's tensor (``EncodeContext.offset``)."""
        s, g = self._stream_for(grad, key, loss_scale, offset)
        assert s.residual is not None
        alpha = 1.0
        if self.config.clip is not None:
            norm = float(torch.linalg.vector_norm(g)) / loss_scale
            if norm > self.config.clip:
                alpha = self.config.clip / norm
        v = _buffer(s.spare, s.residual)
        m = self.config.momentum
        s.pending_u = _buffer(s.spare_u, s.residual) if m > 0 else None
        c = self.config
        _accumulate_into(v, s.residual, g, s.momentum, s.pending_u, m, c.nesterov, alpha, c.decay)
        s.pending = v
        return v

    def _stream_for(
        self, grad: torch.Tensor, key: str, loss_scale: float, offset: int, convert: bool = True
    ) -> tuple[FeedbackStream, torch.Tensor]:
        """The stream of ``key``, its residual (and momentum) sized for ``grad`` and in the units
        of ``loss_scale``; and ``grad`` flat in the residual's dtype (``convert``) or its own."""
        if not (loss_scale > 0 and math.isfinite(loss_scale)):
            raise ValueError(f"ef: loss_scale must be a positive finite number, got {loss_scale!r}")
        flat = self.codec._flatten(grad)
        work_dtype = torch.float32 if flat.dtype in (torch.float16, torch.bfloat16) else flat.dtype
        s = self._streams.setdefault(key, FeedbackStream())
        s.offset = offset
        n = flat.numel()
        if s.residual is not None and s.residual.numel() != n:
            _warn_lost(key, s, n)
            s.residual = None
        if s.residual is None:
            s.residual = torch.zeros(n, dtype=work_dtype, device=flat.device)
            s.momentum = None
            s.scale = loss_scale
        elif s.residual.device != flat.device or s.residual.dtype != work_dtype:
            # state loaded with map_location="cpu", or a gradient whose dtype changed: the
            # residual follows the gradient (its values kept, nothing owed is dropped)
            s.residual = s.residual.to(flat.device, work_dtype)
            if s.momentum is not None:
                s.momentum = s.momentum.to(flat.device, work_dtype)
            s.spare = s.spare_u = None
        if loss_scale != s.scale:
            ratio = loss_scale / s.scale
            s.residual.mul_(ratio)
            if s.momentum is not None:
                s.momentum.mul_(ratio)
            s.scale = loss_scale
        return s, (flat if flat.dtype == work_dtype or not convert else flat.to(work_dtype))

    def commit(
        self,
        key: str = "",
        *,
        dense: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """Keep ``pending - sent`` as the new residual. ``sent`` is a dense flat tensor, or
        distinct ``indices`` with their decoded ``values`` (then momentum masking applies), or
        low-rank ``factors`` ``(P, Q)``: the matrix ``P Q^T`` over the pending elements in row-major
        order, subtracted in place in one pass (no product of the matrix's size is made)."""
        s = self._streams.get(key)
        if s is None or s.pending is None:
            raise RuntimeError(f"ef: commit({key!r}) without a pending accumulate()")
        v = s.pending
        if indices is None and dense is None and factors is None:
            raise ValueError("ef: commit needs dense=, indices= and values=, or factors=")
        if factors is not None:
            p, q = factors
            if p.shape[0] * q.shape[0] != v.numel() or p.shape[1] != q.shape[1]:
                raise ValueError(
                    f"ef: commit factors {tuple(p.shape)} x {tuple(q.shape)}^T do not cover the "
                    f"{v.numel()} pending elements"
                )
        if s.pending_u is not None and self.config.masking and indices is None:
            raise ValueError("ef: momentum masking needs the transmitted indices")
        _subtract_sent(
            v, s.pending_u, self.config.masking, self.resident,
            dense=dense, indices=indices, values=values, factors=factors,
        )  # fmt: skip
        s.spare, s.residual = s.residual, v
        if s.pending_u is not None:
            s.spare_u, s.momentum = s.momentum, s.pending_u
        s.pending = s.pending_u = None
        s.committed = True

    def discard(self, key: str = "") -> None:
        """Drop a pending step (its gradient was non-finite): residual and momentum unchanged."""
        s = self._streams.get(key)
        if s is not None and s.pending is not None:
            s.spare, s.spare_u = s.pending, s.pending_u
            s.pending = s.pending_u = None

    def begin_round(self, scope: Callable[[str], bool] | None = None) -> None:
        """Start a synchronization round (a training step): :meth:`rollback_round` undoes the
        commits made after this call (to the streams ``scope`` accepts: the outer loop's
        fragments meet in rounds of their own, which overlap)."""
        for key, s in self._streams.items():
            if scope is None or scope(key):
                s.committed = False

    def rollback_round(self, scope: Callable[[str], bool] | None = None) -> int:
        """Undo every commit since :meth:`begin_round` (to the streams ``scope`` accepts) and
        return how many streams were reset.

        For a step that every rank skips because *some* rank's gradient overflowed: this rank's
        own gradient was finite, so its residual and momentum were updated and must go back."""
        undone = 0
        for key, s in self._streams.items():
            if not s.committed or (scope is not None and not scope(key)):
                continue
            s.residual, s.spare = s.spare, s.residual
            if self.config.momentum > 0:
                s.momentum, s.spare_u = s.spare_u, s.momentum
            s.committed = False
            undone += 1
        return undone

    def decode(
        self,
        payload: Payload,
        *,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
        scale: float = 1.0,
    ) -> torch.Tensor:
        return self.codec.decode(payload, out=out, accumulate=accumulate, scale=scale)

    def transmitted(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.codec.transmitted(payload)

    def factors(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.codec.factors(payload)

    def check_numel(self, numel: int) -> None:
        self.codec.check_numel(numel)

    def estimate_nbytes(
        self,
        numel: int,
        shape: torch.Size | tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        return self.codec.estimate_nbytes(numel, shape, dtype)

    def max_nbytes(
        self,
        numel: int,
        shape: torch.Size | tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        return self.codec.max_nbytes(numel, shape, dtype)

    def payload_from_bytes(
        self, data: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype
    ) -> Payload:
        return self.codec.payload_from_bytes(data, shape, dtype)

    def payload_nbytes(self, payload: Payload) -> int:
        return self.codec.payload_nbytes(payload)

    def values(self, payload: Payload) -> torch.Tensor | None:
        return self.codec.values(payload)

    def residual(self, key: str = "") -> torch.Tensor | None:
        """The unscaled residual of a stream (a copy), or None before its first encode."""
        s = self._streams.get(key)
        return None if s is None or s.residual is None else s.residual / s.scale

    def reset_state(self) -> None:
        self._streams.clear()
        self.codec.reset_state()

    def drop_streams(self, keep: Callable[[str], bool]) -> list[str]:
        """Forget the residuals (and the codec's streams) that ``keep`` rejects: what they owed
        the model is lost, so the caller says so."""
        dropped = sorted(k for k in self._streams if not keep(k))
        for k in dropped:
            del self._streams[k]
        return sorted(set(dropped) | set(self.codec.drop_streams(keep)))

    def state_dict(self) -> dict[str, Any]:
        streams = {}
        for key, s in self._streams.items():
            streams[key] = {
                "residual": None if s.residual is None else s.residual / s.scale,
                "momentum": None if s.momentum is None else s.momentum / s.scale,
                "offset": s.offset,
            }
        return {"ef": self.config.to_dict(), "codec": self.codec.state_dict(), "streams": streams}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "ef" not in state:
            raise ValueError("state has no error-feedback section (saved without ef?)")
        mine = self.config.to_dict()
        if state["ef"] != mine:
            raise ValueError(f"ef: state was saved with config {state['ef']} but this wrapper has {mine}")
        self.codec.load_state_dict(state["codec"])
        self._streams = {
            key: FeedbackStream(
                residual=None if v["residual"] is None else v["residual"].clone(),
                momentum=None if v["momentum"] is None else v["momentum"].clone(),
                offset=int(v.get("offset", 0)),
            )
            for key, v in state["streams"].items()
        }


# ---------------------------------------------------------------------------------- device work
# The tensor arithmetic of error feedback, shared by the steps of encode() (accumulate, commit,
# keep_if) and by its replayed form, which runs them as one graph.
def _accumulate_into(
    v: torch.Tensor,
    r: torch.Tensor,
    g: torch.Tensor,
    u: torch.Tensor | None,
    new_u: torch.Tensor | None,
    m: float,
    nesterov: bool,
    alpha: float,
    decay: float = 1.0,
) -> None:
    """``v = decay * r + g`` (``alpha``: the clipping factor on g), with momentum correction into
    ``new_u`` from ``u`` when ``m > 0`` (``u`` None: no momentum yet, zero)."""
    if m > 0:
        assert new_u is not None
        if u is None:
            u = torch.zeros_like(r)
        if nesterov:  # u' = m (u + g); v = decay r + u' + g
            torch.add(u, g, alpha=alpha, out=new_u).mul_(m)
            if decay == 1.0:
                torch.add(r, new_u, out=v).add_(g, alpha=alpha)
            else:
                torch.mul(r, decay, out=v).add_(new_u).add_(g, alpha=alpha)
        else:  # u' = m u + g; v = decay r + u'
            torch.mul(u, m, out=new_u).add_(g, alpha=alpha)
            if decay == 1.0:
                torch.add(r, new_u, out=v)
            else:
                torch.mul(r, decay, out=v).add_(new_u)
    elif decay == 1.0:
        torch.add(r, g, alpha=alpha, out=v)
    else:
        torch.mul(r, decay, out=v).add_(g, alpha=alpha)


def _subtract_sent(
    v: torch.Tensor,
    new_u: torch.Tensor | None,
    masking: bool,
    resident: bool,
    *,
    dense: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    factors: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``v -= sent`` in place (dense, sparse, or low-rank ``P Q^T``), and momentum-factor masking
    of ``new_u`` at the sent indices."""
    if indices is not None:
        assert values is not None
        sparse_add_(v, indices, values.to(v.dtype), alpha=-1.0, on_device=resident)
    elif dense is not None:
        v.sub_(dense.to(v.dtype))
    elif factors is not None:
        p, q = factors
        v.view(p.shape[0], q.shape[0]).addmm_(p.to(v.dtype), q.to(v.dtype).T, alpha=-1)
    if new_u is not None and masking and indices is not None:
        new_u.index_fill_(0, indices.long(), 0)


def _restore_where(
    flag: torch.Tensor,
    v: torch.Tensor,
    before: torch.Tensor,
    u: torch.Tensor | None,
    u_before: torch.Tensor | None,
) -> None:
    """Where the device flag is set (a non-finite input), the residual ``v`` takes ``before``
    back, and the momentum ``u`` its ``u_before`` (zero when there was none: a stream's first
    round), without the host reading the flag."""
    v.copy_(torch.where(flag, before, v))
    if u is not None:
        prior = u_before if u_before is not None else torch.zeros((), dtype=u.dtype, device=u.device)
        u.copy_(torch.where(flag, prior, u))
