"""The codec contract.

A codec turns a gradient into a :class:`~gradsync.codecs.payload.Payload` (one ``uint8`` tensor
with an in-band header) and back. It never communicates. Per-tensor state (reused thresholds,
PowerSGD factors, random generators, call counters) lives in one *stream* per ``EncodeContext.key``
and is saved with :meth:`Codec.state_dict` as tensors and plain values only.

Rules every codec follows:

- the input may be any shape, contiguous or not (``channels_last`` included); it is read in its
  logical (row-major) order and decoded to a contiguous tensor of the same shape and dtype;
- floating inputs only (``none`` also passes integer and bool tensors through);
- inf/NaN in the input is never hidden: the payload is flagged (``Payload.nonfinite``) and
  decodes to a NaN-filled tensor, so a GradScaler that checks gradients skips the step;
- the payload size is known from the numel (and the count in the header for variable-size
  sparsifiers) and matches :meth:`Codec.estimate_nbytes` for fixed-size codecs;
- randomness comes only from the stream's generator, seeded from ``(seed, key)``.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar, cast

import torch

from gradsync.codecs.compressor import Compressor
from gradsync.codecs.config import CodecConfig, SparsityConfig
from gradsync.codecs.graphs import Replayer
from gradsync.codecs.ops.backend import backend
from gradsync.codecs.ops.random import device_words, make_generator
from gradsync.codecs.ops.workspace import Workspace
from gradsync.codecs.payload import Flag, Header, Layout, Payload, allocate, write_header

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class EncodeContext:
    """Facts about one encode call that are not part of the codec's configuration."""

    key: str = ""
    """The tensor stream: per-tensor state is kept apart by key (use the parameter name)."""
    rank: int = 0
    """This worker's rank; decorrelates stochastic rounding noise across workers."""
    summands: int = 1
    """How many payloads will be summed before decoding; summable formats leave that headroom."""
    amax: float | torch.Tensor | None = None
    """An agreed ``max |x|`` over all summands, so that summable formats pick the same scale (a
    float, or a 1-element tensor on the device that a resident codec reads there)."""
    offset: int = 0
    """Where the encoded tensor's first element sits in what the stream's key names (a bucket the
    caller reduces in pieces; 0 for a stream of one whole tensor). Codecs ignore it; error
    feedback records it with the stream's residual, so that the caller can tell later which
    elements the residual is owed to (see :class:`~gradsync.codecs.Owed`)."""


@dataclass
class Stream:
    """Per-tensor state of a codec. Subclasses add fields (tensors, numbers, generators)."""

    calls: int = 0
    generator: torch.Generator | None = None
    counter: torch.Tensor | None = None
    """Resident mode of a randomized codec: how many calls drew random words, as a 0-dim int64
    tensor on the device, advanced there (:func:`~gradsync.codecs.ops.device_words`), so that a
    replayed graph draws new words on every call (the host path draws from ``generator``)."""

    def words(self, count: int = 2) -> torch.Tensor:
        """``count`` random 32-bit words for this call of a resident codec (a device tensor)."""
        assert self.counter is not None and self.generator is not None, "a randomized codec's stream"
        return device_words(self.counter, self.generator.initial_seed(), count)


StreamT = TypeVar("StreamT", bound=Stream)
"""The stream type of a codec: ``class PowerSGD(Codec[PowersgdStream])``."""


def follow_device(stream: StreamT, device: torch.device) -> StreamT:
    """Move a stream's tensors (not its CPU generator) to ``device``, where its input now is:
    state loaded with ``map_location="cpu"`` follows the gradient on first use."""
    for f in dataclasses.fields(stream):
        v = getattr(stream, f.name)
        if isinstance(v, torch.Tensor) and v.device != device:
            setattr(stream, f.name, v.to(device))
    return stream


class Codec(Compressor, Generic[StreamT]):
    """Base class: input checks, streams, state, payload plumbing, the operator backend."""

    Config: ClassVar[type[CodecConfig]]
    StreamType: ClassVar[type[Stream]] = Stream
    """The class of ``StreamT`` (a codec with its own stream type names it in both places)."""
    # traits (see gradsync.codecs.compressor): subclasses set sparse, lossless, randomized,
    # summable, agreed_scale, lowrank and biased as class attributes

    def __init__(self, config: CodecConfig) -> None:
        if not isinstance(config, self.Config):
            raise TypeError(f"{self.name} needs a {self.Config.__name__}, got {type(config).__name__}")
        self.config = config
        self.ws = Workspace()
        self._streams: dict[str, StreamT] = {}
        # compile=true: the common operators run their torch definitions through torch.compile
        self._backend = "compiled" if config.compile else None
        self.scheduled_density: float | None = None
        """A density that replaces the configured one for now (the sync engine's density
        schedule, a sparsity warm-up); only for :attr:`schedulable` codecs."""
        self._resident = False
        self.replayer = Replayer(self.name)
        """The CUDA graphs of this codec's resident work (:mod:`gradsync.codecs.graphs`)."""
        self._slots: dict[str, tuple[list[torch.Tensor], int]] = {}
        # resident payload buffers by stream key: two, used in turn, so that a graph writes
        # the same bytes every other call and a payload still being sent is never overwritten

    @property
    def resident(self) -> bool:
        return self._resident

    @property
    def host_free(self) -> bool:
        return False

    def set_resident(self, on: bool) -> None:
        on = bool(on)
        if on != self._resident and (self._streams or self._slots):
            raise RuntimeError(
                f"{self.name}: resident mode is chosen once, before the codec's first encode (it "
                f"fixes the payload sizes and where the state lives); this codec already runs "
                f"{'resident' if self._resident else 'on the host'}: build a new codec to change it"
            )
        self._resident = on

    @property
    def _on_device(self) -> bool:
        """Resident and able to stay on the device: the host-free versions run."""
        return self._resident and self.host_free

    capturable: ClassVar[bool] = False
    """The resident encode and decode keep the contract of :mod:`gradsync.codecs.graphs`
    (device work only, no Python state changed inside, what varies in device tensors), so they
    are replayed as CUDA graphs."""

    @property
    def replays(self) -> bool:
        """Whether resident encodes and decodes go through :attr:`replayer`."""
        return self._on_device and self.capturable

    def before_device_work(self, stream: StreamT, device: torch.device) -> tuple[Any, ...]:
        """Python's part of a resident encode, before the device work: the stream's device state
        made where missing, and the decisions the work depends on (constants of its graph)."""
        if self.randomized and stream.counter is None:
            stream.counter = torch.zeros((), dtype=torch.int64, device=device)
        return ()

    def after_device_work(self, stream: StreamT) -> None:
        """Python's part of a resident encode after the device work (counters kept on the host)."""
        stream.calls += 1

    def device_state(self, stream: StreamT) -> list[torch.Tensor]:
        """The stream's tensors, which the resident work reads and updates in place."""
        return [getattr(stream, name) for name in _tensor_fields(stream)]

    @staticmethod
    @contextlib.contextmanager
    def bound_state(stream: StreamT, tensors: list[torch.Tensor]) -> Iterator[None]:
        """Inside the block the stream's tensor fields are ``tensors`` (those a replayed function
        was given: the same objects in a CUDA capture, their traced stand-ins in the CPU's
        emulation), then the stream's own again."""
        names = _tensor_fields(stream)
        own = [getattr(stream, n) for n in names]
        for n, t in zip(names, tensors, strict=True):
            setattr(stream, n, t)
        try:
            yield
        finally:
            for n, t in zip(names, own, strict=True):
                setattr(stream, n, t)

    def payload_slot(self, key: str, nbytes: int, device: torch.device) -> torch.Tensor:
        """The next of the stream's two resident payload buffers (made at the first call)."""
        bufs, turn = self._slots.get(key, ([], 0))
        if len(bufs) != 2 or bufs[0].numel() < nbytes or bufs[0].device != device:
            bufs, turn = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(2)], 0
        self._slots[key] = (bufs, 1 - turn)
        return bufs[turn][:nbytes]

    @property
    def schedulable(self) -> bool:
        """Whether the codec keeps a share of the elements given by a ``density`` that a
        schedule may raise for a while (sparsifiers configured by density, not by k or a threshold)."""
        c = self.config
        return (
            isinstance(c, SparsityConfig)
            and c.k is None
            and c.density is not None
            and getattr(c, "threshold", None) is None
        )

    # ------------------------------------------------------------------ public API
    @property
    def plain(self) -> Codec:
        return self

    def spec(self) -> str:
        return self.config.spec()

    def fresh(self) -> Codec:
        codec = type(self)(self.config)
        codec.set_resident(self._resident)
        return codec

    def encode(
        self,
        x: torch.Tensor,
        ctx: EncodeContext | None = None,
        *,
        out: torch.Tensor | None = None,
        loss_scale: float = 1.0,
    ) -> Payload:
        """Compress ``x``. ``out`` (uint8, at least :meth:`max_nbytes`) avoids an allocation.
        ``loss_scale`` is unused: a codec's state does not depend on the gradient's scale.

        A resident payload (:attr:`replays`) lives in one of the stream's two buffers: it stays
        valid until the second next encode of the same stream."""
        ctx = ctx or EncodeContext()
        flat = self._flatten(x)
        if self.replays and flat.numel():
            return self._encode_replayed(flat, x.shape, ctx, out)
        return self._encode_in_stream(flat, ctx, lambda stream: self._encode(flat, x.shape, ctx, stream, out))

    def _encode_in_stream(
        self, flat: torch.Tensor, ctx: EncodeContext, encode: Callable[[StreamT], Payload]
    ) -> Payload:
        """Run ``encode`` on the stream of ``ctx.key`` for the flat input ``flat``: its size checked
        first, under the codec's operator backend, the stream's call counted after."""
        self.check_numel(flat.numel())
        stream = follow_device(self.stream(ctx.key), flat.device)
        if self._on_device:
            self.before_device_work(stream, flat.device)
        with self._ops_backend():
            payload = encode(stream)
        if self._on_device:
            self.after_device_work(stream)
        else:
            stream.calls += 1
        return payload

    def _encode_replayed(
        self, flat: torch.Tensor, shape: torch.Size, ctx: EncodeContext, out: torch.Tensor | None
    ) -> Payload:
        """The resident encode as the replay of a graph (:attr:`replayer`): Python's decisions
        first, then the device work into a stream's payload buffer (or ``out``)."""
        self.check_numel(flat.numel())
        stream = follow_device(self.stream(ctx.key), flat.device)
        decided = self.before_device_work(stream, flat.device)
        nbytes = self.max_nbytes(flat.numel(), shape, flat.dtype)
        data = (
            allocate(nbytes, flat.device, out)
            if out is not None
            else self.payload_slot(ctx.key, nbytes, flat.device)
        )
        agreed = ctx.amax if isinstance(ctx.amax, torch.Tensor) else None
        inputs = [flat] if agreed is None else [flat, agreed]

        def work(x: torch.Tensor, *rest: torch.Tensor) -> None:
            c = ctx if agreed is None else dataclasses.replace(ctx, amax=rest[0])
            data, *state = rest[len(inputs) - 1 :]
            with self._ops_backend(), self.bound_state(stream, state):
                self._encode(x, shape, c, stream, data)

        consts = (tuple(shape), ctx.rank, ctx.summands, None if agreed is not None else ctx.amax, decided)
        self.replayer.run(
            "encode", work, inputs=inputs, static=[data, *self.device_state(stream)], consts=consts
        )
        self.after_device_work(stream)
        return Payload(data, self.name, shape, flat.dtype)

    def encode_sum(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        into: torch.Tensor,
        shape: torch.Size,
        ctx: EncodeContext | None = None,
        *,
        out: torch.Tensor | None = None,
    ) -> Payload:
        """Compress ``a + b`` (flat, of ``into``'s size and dtype), leaving that sum in ``into``
        and encoding it as a tensor of ``shape``: error feedback's residual + gradient. A codec
        whose first pass can compute the sum while it reads overrides this (one pass instead of
        an addition and a read); the payload is the same either way."""
        torch.add(a, b, out=into)
        return self.encode(into.view(shape), ctx, out=out)

    def decode(
        self,
        payload: Payload,
        *,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
        scale: float = 1.0,
    ) -> torch.Tensor:
        """Decompress into a new tensor, or into (``accumulate``: add to) ``out``.

        ``scale`` multiplies the decoded values at no extra pass (a mean is a scaled sum)."""
        if payload.codec != self.name:
            raise ValueError(f"{self.name} cannot decode a payload made by {payload.codec!r}")
        if out is None:
            out = torch.zeros(payload.shape, dtype=payload.dtype, device=payload.data.device)
            accumulate = False
        elif out.shape != payload.shape or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous tensor of shape {tuple(payload.shape)}, got {tuple(out.shape)}"
                f"{'' if out.is_contiguous() else ' (non-contiguous)'}"
            )
        flat = out.view(-1)
        if not self._on_device and payload.nonfinite:
            flat.fill_(math.nan)
            return out
        if not self._on_device:
            with self._ops_backend():
                self._decode(payload, flat, accumulate, scale)
            return out
        shape, dtype = payload.shape, payload.dtype

        def work(data: torch.Tensor, into: torch.Tensor) -> None:
            p = Payload(data, self.name, shape, dtype)
            with self._ops_backend():
                self._decode(p, into, accumulate, scale)
            if into.is_floating_point():  # the flags stay on the device: NaN where flagged
                into.masked_fill_(p.flag_word(), math.nan)

        if self.replays and flat.numel():
            consts = (tuple(shape), dtype, accumulate, scale)
            self.replayer.run("decode", work, inputs=[payload.data], static=[flat], consts=consts)
        else:
            work(payload.data, flat)
        return out

    def _ops_backend(self) -> contextlib.AbstractContextManager[None]:
        return backend(self._backend) if self._backend else contextlib.nullcontext()

    def estimate_nbytes(
        self,
        numel: int,
        shape: torch.Size | tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """Payload bytes for a ``dtype`` tensor of ``numel`` elements, computed without compressing.

        Exact for fixed-size codecs; the expected size for codecs whose count varies per call.
        """
        return self._nbytes(numel, _shape(numel, shape), dtype)

    def max_nbytes(
        self,
        numel: int,
        shape: torch.Size | tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """An upper bound of the payload size (the capacity an ``out`` buffer needs)."""
        return self._max_nbytes(numel, _shape(numel, shape), dtype)

    def check_numel(self, numel: int) -> None:
        """Raise ``ValueError`` if this codec's config cannot be applied to ``numel`` elements."""

    def payload_from_bytes(
        self, data: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype
    ) -> Payload:
        """Wrap bytes received from a peer, checking that their size agrees with their header."""
        p = Payload(data, self.name, torch.Size(shape), dtype)
        expected = self.payload_nbytes(p)
        if expected != p.nbytes:
            raise ValueError(
                f"{self.name}: received {p.nbytes} bytes but the header (count={p.count}) implies {expected}"
            )
        return p

    def payload_nbytes(self, payload: Payload) -> int:
        """The size a payload must have given its header (variable-size codecs override)."""
        return self.estimate_nbytes(payload.numel, payload.shape, payload.dtype)

    def values(self, payload: Payload) -> torch.Tensor | None:
        """The section of a payload that can be summed across ranks in place (single-round
        summable codecs: none, fp16, bf16); None for every other codec."""
        return None

    def transmitted(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(indices, decoded values)`` of a sparse payload (distinct indices); None for dense codecs.

        Equal to ``decode(payload).view(-1)[indices]``, without materializing the dense tensor.
        """
        return None

    # ------------------------------------------------------------------ state
    def stream(self, key: str = "") -> StreamT:
        """The state of one tensor stream (created on first use)."""
        s = self._streams.get(key)
        if s is None:
            # StreamType is StreamT's class: a ClassVar cannot name a type variable, so say it here
            s = cast(StreamT, self.StreamType())
            if self.randomized:
                s.generator = make_generator(getattr(self.config, "seed", 0), key)
            self._streams[key] = s
        return s

    def reset_state(self) -> None:
        """Forget every stream (thresholds, factors, generators, counters)."""
        self._streams.clear()
        self._slots.clear()
        self.replayer.clear()

    def drop_streams(self, keep: Callable[[str], bool]) -> list[str]:
        dropped = sorted(k for k in self._streams if not keep(k))
        for k in dropped:
            del self._streams[k]
            self._slots.pop(k, None)
        if dropped:
            self.replayer.clear()
        return dropped

    def state_dict(self) -> dict[str, Any]:
        """All stream state as tensors and plain values (``torch.load(weights_only=True)`` reads it)."""
        streams = {}
        for key, s in self._streams.items():
            fields = {}
            for f in dataclasses.fields(s):
                v = getattr(s, f.name)
                fields[f.name] = v.get_state() if isinstance(v, torch.Generator) else v
            streams[key] = fields
        return {"codec": self.name, "config": self.config.to_dict(), "streams": streams}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the codec name and config must match."""
        if state.get("codec") != self.name:
            raise ValueError(f"state was saved by codec {state.get('codec')!r}, this is {self.name!r}")
        mine = self.config.to_dict()
        theirs = state.get("config", {})
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if diff:
            detail = ", ".join(f"{k}: saved {theirs.get(k)!r} vs now {mine.get(k)!r}" for k in diff)
            raise ValueError(f"{self.name}: state was saved with a different config ({detail})")
        self._streams.clear()
        self.replayer.clear()  # the streams' tensors are new: graphs of the old ones would not see them
        for key, fields in state.get("streams", {}).items():
            s = self.stream(key)
            for f in dataclasses.fields(s):
                if f.name not in fields:
                    continue
                v = fields[f.name]
                if isinstance(getattr(s, f.name), torch.Generator):
                    getattr(s, f.name).set_state(v)
                else:
                    setattr(s, f.name, v)

    # ------------------------------------------------------------------ for subclasses
    @abc.abstractmethod
    def _encode(
        self,
        x: torch.Tensor,
        shape: torch.Size,
        ctx: EncodeContext,
        stream: StreamT,
        out: torch.Tensor | None,
    ) -> Payload:
        """Encode the flat, contiguous ``x`` (the original had ``shape``)."""

    @abc.abstractmethod
    def _decode(self, payload: Payload, out: torch.Tensor, accumulate: bool, scale: float) -> None:
        """Write (or add) ``scale`` times the decoded flat tensor into the flat, contiguous ``out``."""

    @abc.abstractmethod
    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        """Payload size for ``numel`` elements (expected size for variable-size codecs)."""

    def _max_nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        return self._nbytes(numel, shape, dtype)

    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(
                f"{self.name}: cannot compress a {x.dtype} tensor; codecs take float32, float16, bfloat16 or "
                "float64 (send integer and bool tensors with the 'none' codec)"
            )
        return x.reshape(-1) if x.is_contiguous() else x.contiguous().view(-1)

    def _new_payload(
        self, layout: Layout, x: torch.Tensor, shape: torch.Size, out: torch.Tensor | None
    ) -> tuple[torch.Tensor, Payload]:
        """Bytes for a payload with this layout (in ``out`` when given), padding zeroed."""
        data = allocate(layout.nbytes, x.device, out)
        layout.zero_padding(data)
        return data, Payload(data, self.name, shape, x.dtype)

    @staticmethod
    def _finish(data: torch.Tensor, payload: Payload, header: Header) -> Payload:
        write_header(data, header)
        payload._header = header
        return payload


def _tensor_fields(stream: Stream) -> list[str]:
    return [f.name for f in dataclasses.fields(stream) if isinstance(getattr(stream, f.name), torch.Tensor)]


def _shape(numel: int, shape: torch.Size | tuple[int, ...] | None) -> torch.Size:
    if shape is None:
        return torch.Size([numel])
    shape = torch.Size(shape)
    if shape.numel() != numel:
        raise ValueError(f"shape {tuple(shape)} does not hold {numel} elements")
    return shape


def nonfinite_flag(nonfinite: int | bool) -> Flag:
    """The header flag for a non-finite count."""
    return Flag.NONFINITE if nonfinite else Flag.NONE


__all__ = ["Codec", "EncodeContext", "Stream", "StreamT", "nonfinite_flag"]
