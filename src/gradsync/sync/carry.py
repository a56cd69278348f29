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


class Layouts:
    """Which parameters lie where in each bucket, to trace a stream key back to them.

    Stream keys are made by the synchronizer: ``KEY/role`` or ``KEY#PART/role`` for a bucket
    ``KEY`` (offsets count from the bucket's first element), or the name of one parameter for a
    per-tensor stream (PowerSGD's; offsets count from the parameter's first element, so such a
    stream keeps its meaning when its parameter moves to another bucket)."""

    def __init__(self, buckets: Iterable[tuple[str, Sequence[tuple[str, int]]]]) -> None:
        self._by_key: dict[str, list[tuple[str, int, int]]] = {}
        self._tensors: dict[str, list[tuple[str, int, int]]] = {}
        for key, members in buckets:
            layout, start = [], 0
            for name, numel in members:
                layout.append((name, start, numel))
                self._tensors[name] = [(name, 0, numel)]
                start += numel
            self._by_key[key] = layout

    def of(self, stream_key: str) -> list[tuple[str, int, int]] | None:
        """``[(name, start, numel), ...]``: the parameters of what a stream's offsets count in."""
        found = self._tensors.get(stream_key)  # a per-tensor stream; a bucket's have a role
        if found is not None:
            return found
        prefix = stream_key.split("/", 1)[0]
        found = self._by_key.get(prefix)
        if found is None and "#" in prefix:
            found = self._by_key.get(prefix.rsplit("#", 1)[0])
        return found

    def spans(self, stream_key: str, offset: int, numel: int) -> list[Span]:
        """Where the elements ``offset:offset+numel`` of a stream's bucket fall in its parameters
        (padding beyond the last one falls nowhere). ``ValueError`` for a key of no bucket."""
        layout = self.of(stream_key)
        if layout is None:
            raise ValueError(f"gradsync: compression stream {stream_key!r} belongs to no known bucket")
        out = []
        for name, start, n in layout:
            lo, hi = max(offset, start), min(offset + numel, start + n)
            if lo < hi:
                out.append(Span(name, n, lo - offset, lo - start, hi - lo))
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
        """Put the residuals of taken streams on their parameters, as this rank's share. A stream
        of no known bucket raises ``ValueError``, or with ``strict=False`` is returned (its key)."""
        lost = []
        for o in owed:
            if not strict and layouts.of(o.key) is None:
                lost.append(o.key)
                continue
            for s in layouts.spans(o.key, o.offset, o.residual.numel()):
                self._add(self.local, s.name, s.numel, s.in_param, _piece(o.residual, s))
        return lost

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

    def inject(self, name: str, grad: torch.Tensor, scale: float) -> None:
        """Add this rank's share of ``name`` (times the loss ``scale``) to its flat gradient
        ``grad`` (a bucket's region): it is synchronized with it."""
        t = self._placed(self.local, name, grad)
        if t is not None:
            grad.add_(t.to(grad.dtype) if scale == 1.0 else (t * scale).to(grad.dtype))

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
    codecs: Iterable[Compressor], layouts: Layouts, carry: Carry, world: int
) -> dict[str, torch.Tensor]:
    """What this rank still owes the mean gradient, per parameter name (flat, unscaled): the
    codecs' residuals traced back through ``layouts``, plus ``carry``. The ranks' values add up
    to everything computed but not applied yet."""
    residuals = Carry()
    for codec in codecs:
        residuals.add_owed(codec.owed(), layouts)
    out = carry.owed(world)
    for name, t in residuals.owed(world).items():
        out[name] = out[name] + t if name in out else t
    return out
