"""What error feedback still owes the model, kept per parameter when its stream cannot keep it.

Error feedback keeps one residual per compression stream: the part of the gradient that has not
been sent yet, owed to the model. A stream belongs to one bucket layout (which parameters, cut
into which parts, compressed by which codec). Three events would lose what it owes:

- the layout changes: a re-plan (or its revert) cuts a bucket differently, gives it another
  codec or sends it dense, or the run switches to dense training at ``dense_from_step``;
- part of a bucket's synchronized result is thrown away: a parameter that no rank used keeps
  ``grad = None`` (as DDP leaves it), so what error feedback sent of it this step never reached
  the model;
- DDP rebuilds its buckets (the comm hook): a residual keyed by the old bucket finds no stream.

For the second, :meth:`~gradsync.codecs.Compressor.rollback_elements` gives those elements their
residual back. For the others the stream is taken (:meth:`~gradsync.codecs.Compressor.take_streams`)
and what it owed is traced back to parameters through the offset each stream records
(``EncodeContext.offset``) and the layout it was made under (:class:`Layouts`). A :class:`Carry`
then keeps it per parameter name until a step has applied it:

- :attr:`Carry.local`, this rank's share, in the units of a gradient summed over the ranks: it is
  added to the parameter's gradient on this rank before the next synchronization, which then
  sends it like any gradient (exactly when that bucket is dense; through error feedback when it
  is compressed, so what is not sent stays owed in the new stream). With local aggregation a
  residual belongs to the node's sum; added to one rank's gradient it re-enters that sum.
- :attr:`Carry.mean`, with momentum correction (``ef:momentum``): there the residual is part of
  an *update* (it already went through the momentum) and must not pass through a momentum again,
  so the engine sums every rank's share once, at the change, and the mean, the same on every
  rank, is added to the synchronized gradients of the next step (after the momentum).

A step that is skipped (a GradScaler overflow), or in which the parameter got no gradient,
applies nothing, so the carry stays until a step that does. Everything is kept unscaled (a
loss scale divided out) in float32 (float64 for float64 parameters) and saved with the engine's
state. A 16-bit gradient receives its carry rounded to its own dtype, the precision its
synchronization has anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradsync.codecs import Compressor, Owed


@dataclass(frozen=True)
class Span:
    """Elements shared by a stream and a parameter: ``length`` elements starting at
    ``in_stream`` in the stream's residual and at ``in_param`` in the flat parameter."""

    name: str
    numel: int  # the parameter's
    in_stream: int
    in_param: int
    length: int


@dataclass(frozen=True)
class Piece:
    """``length`` consecutive elements of a stream's input that belong to parameter ``name``
    (``numel`` elements in all) from its element ``in_param`` on. ``name`` "" is padding: it
    belongs to no parameter."""

    name: str
    numel: int
    in_param: int
    length: int


def whole(members: Iterable[tuple[str, int]]) -> list[Piece]:
    """Pieces for parameters laid out whole, one after the other (``(name, numel)`` each)."""
    return [Piece(name, numel, 0, numel) for name, numel in members]


class Layouts:
    """Which parameters lie where in each bucket, to trace a stream key back to them.

    Stream keys are made by the synchronizer: ``KEY/role`` or ``KEY#PART/role`` for a bucket
    ``KEY`` (offsets count from the bucket's first element), or the name of one parameter for a
    per-tensor stream (PowerSGD's; offsets count from the parameter's first element, so such a
    stream keeps its meaning when its parameter moves to another bucket).

    A bucket is a sequence of :class:`Piece` s: whole parameters (``wrap``'s buckets, DDP's), or
    chunks of them with padding between (FSDP's flat gradient, one padded chunk of every
    parameter per rank). Each bucket also has a ``factor``: what one element of its input is
    worth in the units the :class:`Carry` keeps (1 for wrap and the DDP hook, whose carry is in
    the units of a local gradient; FSDP's carry is in the final gradient's units)."""

    def __init__(self, buckets: Iterable[tuple[str, Sequence[tuple[str, int]]]] = ()) -> None:
        self._by_key: dict[str, tuple[list[tuple[Piece, int]], float]] = {}
        self._tensors: dict[str, list[tuple[Piece, int]]] = {}
        for key, members in buckets:
            self.add(key, whole(members))

    def add(self, key: str, pieces: Sequence[Piece], factor: float = 1.0) -> Layouts:
        """Bucket ``key`` holds ``pieces`` in this order (returns self)."""
        layout, start = [], 0
        for piece in pieces:
            if piece.name:
                layout.append((piece, start))
                if piece.in_param == 0 and piece.length == piece.numel:
                    self._tensors[piece.name] = [(piece, 0)]
            start += piece.length
        self._by_key[key] = (layout, factor)
        return self

    def _bucket(self, stream_key: str) -> tuple[list[tuple[Piece, int]], float] | None:
        """The bucket a stream key belongs to: the longest ``/``-separated prefix of the key that
        names one (``KEY/role``, ``KEY#PART/role``; FSDP's ``module/rs/role``)."""
        parts = stream_key.split("/")
        for n in range(len(parts), 0, -1):
            prefix = "/".join(parts[:n])
            found = self._by_key.get(prefix)
            if found is None and "#" in parts[n - 1]:
                found = self._by_key.get(prefix.rsplit("#", 1)[0])
            if found is not None:
                return found
        return None

    def of(self, stream_key: str) -> list[tuple[Piece, int]] | None:
        """``[(piece, start in the stream), ...]``: the parameters of what a stream's offsets
        count in (None for a key of no known bucket)."""
        found = self._tensors.get(stream_key)  # a per-tensor stream; a bucket's have a role
        if found is not None:
            return found
        bucket = self._bucket(stream_key)
        return None if bucket is None else bucket[0]

    def factor(self, stream_key: str) -> float:
        """What one element of the stream is worth in the carry's units."""
        if stream_key in self._tensors:
            return 1.0
        bucket = self._bucket(stream_key)
        return 1.0 if bucket is None else bucket[1]

    def spans(self, stream_key: str, offset: int, numel: int) -> list[Span]:
        """Where the elements ``offset:offset+numel`` of a stream's bucket fall in its parameters
        (padding falls nowhere). ``ValueError`` for a key of no bucket."""
        layout = self.of(stream_key)
        if layout is None:
            raise ValueError(f"gradsync: compression stream {stream_key!r} belongs to no known bucket")
        out = []
        for piece, start in layout:
            lo, hi = max(offset, start), min(offset + numel, start + piece.length)
            if lo < hi:
                out.append(Span(piece.name, piece.numel, lo - offset, piece.in_param + lo - start, hi - lo))
        return out


def overlapping(spans: Iterable[Span], names: set[str]) -> Iterator[tuple[int, int]]:
    """The stream ranges ``(start, stop)`` of the spans of these parameters."""
    for s in spans:
        if s.name in names:
            yield s.in_stream, s.in_stream + s.length


class Carry:
    """What is owed per parameter name until a step applies it (see the module)."""

    def __init__(self) -> None:
        self.local: dict[str, torch.Tensor] = {}
        """This rank's share (summed-gradient units), added to its gradient before synchronizing."""
        self.mean: dict[str, torch.Tensor] = {}
        """The same on every rank (mean units), added to the synchronized gradient."""

    def __bool__(self) -> bool:
        return bool(self.local or self.mean)

    @staticmethod
    def _add(table: dict[str, torch.Tensor], name: str, numel: int, at: int, values: torch.Tensor) -> None:
        dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
        t = table.get(name)
        if t is None:
            t = table[name] = torch.zeros(numel, dtype=dtype, device=values.device)
        elif t.device != values.device:  # loaded elsewhere: it follows the residuals
            t = table[name] = t.to(values.device)
        t[at : at + values.numel()].add_(values.reshape(-1).to(t.dtype))

    def add_owed(self, owed: Iterable[Owed], layouts: Layouts, strict: bool = True) -> list[str]:
        """Put the residuals of taken streams on their parameters, as this rank's share (in the
        carry's units: times the bucket's :meth:`Layouts.factor`). A stream of no known bucket
        raises ``ValueError``, or with ``strict=False`` is returned (its key)."""
        lost = []
        for o in owed:
            if not strict and layouts.of(o.key) is None:
                lost.append(o.key)
                continue
            factor = layouts.factor(o.key)
            for s in layouts.spans(o.key, o.offset, o.residual.numel()):
                values = _piece(o.residual, s)
                values = values if factor == 1.0 else values * factor
                self._add(self.local, s.name, s.numel, s.in_param, values)
        return lost

    def add_local(self, name: str, values: torch.Tensor) -> None:
        """Add ``values`` (the whole flat parameter's) to this rank's share of ``name``."""
        self._add(self.local, name, values.numel(), 0, values)

    def add_mean(self, name: str, values: torch.Tensor) -> None:
        self._add(self.mean, name, values.numel(), 0, values)

    @staticmethod
    def _placed(table: dict[str, torch.Tensor], name: str, grad: torch.Tensor) -> torch.Tensor | None:
        """``table[name]`` on ``grad``'s device (moved there for good: state loaded with
        ``map_location="cpu"`` follows the gradient on first use), checked to fit it."""
        t = table.get(name)
        if t is None:
            return None
        if t.numel() != grad.numel():
            raise ValueError(
                f"gradsync: the gradient owed to parameter {name!r} has {t.numel()} elements, the "
                f"parameter {grad.numel()}: the state was saved for another model or layout"
            )
        if t.device != grad.device:
            t = table[name] = t.to(grad.device)
        return t

    def inject(self, piece: Piece, region: torch.Tensor, scale: float) -> bool:
        """Add this rank's share of ``piece`` (times ``scale``: the loss scale, over the bucket's
        factor) to ``region``, the piece's elements of a stream's input: it is synchronized with
        them. Returns whether something was owed to the piece's parameter."""
        t = self.local.get(piece.name)
        if t is None:
            return False
        if t.numel() != piece.numel:
            raise ValueError(
                f"gradsync: the gradient owed to parameter {piece.name!r} has {t.numel()} elements, the "
                f"parameter {piece.numel}: the state was saved for another model or layout"
            )
        if t.device != region.device:  # loaded elsewhere: it follows the gradient on first use
            t = self.local[piece.name] = t.to(region.device)
        if piece.in_param or piece.length != t.numel():
            t = t[piece.in_param : piece.in_param + piece.length]
        region.add_(t.to(region.dtype) if scale == 1.0 else (t * scale).to(region.dtype))
        return True

    def apply_mean(self, name: str, grad: torch.Tensor, scale: float) -> None:
        """Add the agreed share of ``name`` (times ``scale``) to its synchronized gradient."""
        t = self._placed(self.mean, name, grad)
        if t is not None:
            grad.add_(t.view(grad.shape).to(grad.dtype), alpha=scale)

    def settle(self, names: Iterable[str], local: bool = True, mean: bool = True) -> None:
        """These parameters' step applied what they were owed: forget it."""
        for name in names:
            if local:
                self.local.pop(name, None)
            if mean:
                self.mean.pop(name, None)

    def owed(self, world: int) -> dict[str, torch.Tensor]:
        """This rank's part of what is owed to the mean gradient, per parameter (flat): the
        ranks' parts add up to it."""
        out: dict[str, torch.Tensor] = {}
        for table in (self.local, self.mean):
            for name, t in table.items():
                out[name] = out[name] + t / world if name in out else t / world
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "local": {k: v.clone() for k, v in self.local.items()},
            "mean": {k: v.clone() for k, v in self.mean.items()},
        }

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.local = {k: v.clone() for k, v in state.get("local", {}).items()}
        self.mean = {k: v.clone() for k, v in state.get("mean", {}).items()}


def _piece(values: torch.Tensor, s: Span) -> torch.Tensor:
    return values[s.in_stream : s.in_stream + s.length]


def gather_for_mean(
    owed: Iterable[Owed],
    layouts: Layouts,
    names: Sequence[tuple[str, int]],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """One flat tensor for the agreement of :attr:`Carry.mean`: the residuals, then the momenta,
    of the parameters ``names`` (name, numel; the same list on every rank), this rank's shares
    placed where they belong and zeros elsewhere, ready for a sum over the ranks."""
    starts, total = {}, 0
    for name, numel in names:
        starts[name] = total
        total += numel
    out = torch.zeros(2 * total, dtype=dtype, device=device)
    for o in owed:
        for s in layouts.spans(o.key, o.offset, o.residual.numel()):
            at = starts[s.name] + s.in_param
            out[at : at + s.length].add_(_piece(o.residual, s).to(device, dtype))
            if o.momentum is not None:
                out[total + at : total + at + s.length].add_(_piece(o.momentum, s).to(device, dtype))
    return out


def give_back_unused(codecs: Iterable[Compressor], layouts: Layouts, unused: set[str]) -> None:
    """Parameters no rank used get no gradient, so what error feedback sent of them this step
    never reaches the model: their elements get their residual back."""
    for codec in codecs:
        for key, (offset, numel) in codec.homes().items():
            for start, stop in overlapping(layouts.spans(key, offset, numel), unused):
                codec.rollback_elements(key, start, stop)


def owed_by_parameter(
    codecs: Iterable[Compressor], layouts: Layouts, carry: Carry, world: int, strict: bool = True
) -> dict[str, torch.Tensor]:
    """What this rank still owes the mean gradient, per parameter name (flat, unscaled): the
    codecs' residuals traced back through ``layouts``, plus ``carry``. The ranks' values add up
    to everything computed but not applied yet. ``strict=False``: streams of no known layout are
    left out (else ``ValueError``)."""
    residuals = Carry()
    for codec in codecs:
        residuals.add_owed(codec.owed(), layouts, strict=strict)
    out = carry.owed(world)
    for name, t in residuals.owed(world).items():
        out[name] = out[name] + t if name in out else t
    return out
