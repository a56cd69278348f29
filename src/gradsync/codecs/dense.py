"""Dense codecs: ``none`` (passthrough) and the 16-bit float casts ``fp16`` and ``bf16``.

All three are summable: the value section of payloads made with the same scale can be added
element-wise (in the value dtype) and decodes to the sum.

The 16-bit casts scale by a power of two, 2^e with e in the header's ``aux``, chosen from
``max |x|`` so that ``summands`` payloads can be added without leaving the format's range. Powers
of two change only the exponent, so every value representable in the format round-trips exactly.
With ``scaling=auto`` (default) fp16 also scales small gradients *up* into its range, where they
would otherwise flush to zero; bf16 has float32's exponent range and only ever scales down. To
sum payloads from several workers, give every worker the same ``EncodeContext.amax`` (an agreed
maximum), so that they pick the same exponent. Without it the exponent follows the local maximum:
reused from the previous call while it still fits, so steady state costs one pass.
``scaling=none`` casts as is and flags a payload whose finite values overflowed the format.

In resident mode (:meth:`~gradsync.codecs.Compressor.set_resident`) the exponent is computed on
the device from this call's maximum (or the agreed one, a device tensor) and written into the
header there; the decoder reads it there too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from gradsync.codecs import kernels
from gradsync.codecs.base import Codec, EncodeContext, Stream
from gradsync.codecs.config import CodecConfig, check_choice
from gradsync.codecs.ops import (
    FORMAT_MAX,
    abs_max,
    abs_max_on_device,
    cast_checked,
    cast_on_device,
    native,
    uncast,
)
from gradsync.codecs.payload import Flag, Header, Layout, Payload, device_flags, write_device_header
from gradsync.codecs.registry import register


@dataclass(frozen=True)
class NoneConfig(CodecConfig):
    codec: ClassVar[str] = "none"


@register
class NoCompression(Codec[Stream]):
    """Dense passthrough: the raw bytes of the tensor (any dtype, integers and bool included)."""

    name = "none"
    Config = NoneConfig
    capturable = True
    summable = True
    lossless = True
    biased = False

    def _flatten(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{self.name}: expected a torch.Tensor, got {type(x).__name__}")
        return x.reshape(-1) if x.is_contiguous() else x.contiguous().view(-1)

    @staticmethod
    def _layout(numel: int, dtype: torch.dtype) -> Layout:
        return Layout([("val", numel, dtype)])

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        return self._layout(numel, dtype).nbytes

    def _encode(
        self, x: torch.Tensor, shape: torch.Size, ctx: EncodeContext, stream: Stream, out: torch.Tensor | None
    ) -> Payload:
        lay = self._layout(x.numel(), x.dtype)
        data, payload = self._new_payload(lay, x, shape, out)
        vals = lay.view(data, "val")
        if self._on_device:
            vals.copy_(x)
            flags = device_flags(~torch.isfinite(x).all()) if x.is_floating_point() else 0
            write_device_header(data, x.numel(), flags)
            return payload
        flags = Flag.NONE
        if native.usable(x) and x.numel():
            bad = native.ext().copy_check(native.ptr(x), x.numel(), native.ptr(vals), vals.nbytes)
        else:
            vals.copy_(x)
            bad = x.is_floating_point() and abs_max(x)[1]
        if bad:
            flags = Flag.NONFINITE
        return self._finish(data, payload, Header(count=x.numel(), flags=flags))

    @property
    def host_free(self) -> bool:
        return True

    def values(self, payload: Payload) -> torch.Tensor:
        """The summable value section."""
        return self._layout(payload.numel, payload.dtype).view(payload.data, "val")

    def _decode(self, payload: Payload, out: torch.Tensor, accumulate: bool, scale: float) -> None:
        v = self.values(payload)
        if accumulate:
            out.add_(v, alpha=scale) if scale != 1.0 else out.add_(v)
        elif scale != 1.0:
            torch.mul(v, scale, out=out)
        else:
            out.copy_(v)


@dataclass(frozen=True)
class HalfConfig(CodecConfig):
    codec: ClassVar[str] = "fp16"
    scaling: str = "auto"

    def validate(self) -> None:
        super().validate()
        check_choice(self.codec, "scaling", self.scaling, ("auto", "none"))


@dataclass(frozen=True)
class BHalfConfig(HalfConfig):
    codec: ClassVar[str] = "bf16"


@dataclass
class CastStream(Stream):
    exponent: int | None = None


class _HalfCodec(Codec[CastStream]):
    """Shared by fp16 and bf16."""

    summable = True
    agreed_scale = True
    capturable = True
    biased = False  # round to nearest: too small an error to accumulate
    StreamType = CastStream
    fmt: ClassVar[torch.dtype]
    config: HalfConfig

    def _layout(self, numel: int) -> Layout:
        return Layout([("val", numel, self.fmt)])

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        return self._layout(numel).nbytes

    def exponent_for(self, amax: float, summands: int) -> int:
        """The power of two e such that ``summands * amax * 2^e`` sits at most at half the range."""
        if not math.isfinite(amax) or amax <= 0.0:
            return 0
        e = math.floor(math.log2(FORMAT_MAX[self.fmt] / 2 / (amax * max(summands, 1))))
        if self.fmt == torch.bfloat16:
            e = min(e, 0)  # bf16 has float32's range: only scale down
        return max(min(e, 100), -100)

    def _fits(self, e: int, amax: float, summands: int) -> bool:
        """Whether a previous exponent is still right for this maximum (no overflow, no waste)."""
        best = self.exponent_for(amax, summands)
        return e == best or (self.fmt == torch.float16 and best - 2 <= e <= best)

    def _encode(
        self,
        x: torch.Tensor,
        shape: torch.Size,
        ctx: EncodeContext,
        stream: CastStream,
        out: torch.Tensor | None,
    ) -> Payload:
        lay = self._layout(x.numel())
        data, payload = self._new_payload(lay, x, shape, out)
        vals = lay.view(data, "val")
        if self._on_device:
            return self._encode_on_device(x, ctx, data, payload, vals)
        agreed = float(ctx.amax) if isinstance(ctx.amax, torch.Tensor) else ctx.amax
        if self.config.scaling == "none":
            e = 0
        elif agreed is not None:
            e = self.exponent_for(agreed, ctx.summands)
        else:
            e = stream.exponent if stream.exponent is not None else 0
        st = cast_checked(x, self.fmt, 2.0**e, vals)
        if (
            self.config.scaling == "auto"
            and agreed is None
            and not st.nonfinite
            and not self._fits(e, st.max_abs, ctx.summands)
        ):
            e = self.exponent_for(st.max_abs, ctx.summands)
            st = cast_checked(x, self.fmt, 2.0**e, vals)
        stream.exponent = e
        flags = Flag.NONE
        if st.nonfinite:
            flags |= Flag.NONFINITE
        if st.overflow:
            flags |= Flag.OVERFLOW
        return self._finish(data, payload, Header(count=x.numel(), flags=flags, aux=e))

    @property
    def host_free(self) -> bool:
        return True

    def _exponent_on_device(self, amax: torch.Tensor, summands: int) -> torch.Tensor:
        """:meth:`exponent_for` as a 0-dim int32 device tensor."""
        amax = amax.float().reshape(())
        usable = amax.isfinite() & (amax > 0)
        room = FORMAT_MAX[self.fmt] / 2 / max(summands, 1)
        e = torch.floor(torch.log2(room / torch.where(usable, amax, 1.0)))
        if self.fmt == torch.bfloat16:
            e = e.clamp(max=0)
        return torch.where(usable, e.clamp(-100, 100), 0.0).to(torch.int32)

    def _encode_on_device(
        self, x: torch.Tensor, ctx: EncodeContext, data: torch.Tensor, payload: Payload, vals: torch.Tensor
    ) -> Payload:
        if self.config.scaling == "none":
            e = torch.zeros((), dtype=torch.int32, device=x.device)
        else:
            amax = ctx.amax if ctx.amax is not None else abs_max_on_device(x)
            if not isinstance(amax, torch.Tensor):
                amax = torch.full((), amax, dtype=torch.float32, device=x.device)
            e = self._exponent_on_device(amax, ctx.summands)
        scale = torch.exp2(e.float())
        if kernels.use_kernels(x):  # one fused pass (gradsync.codecs.kernels)
            st = torch.empty(3, dtype=torch.float32, device=x.device)
            kernels.cast_encode(x, self.fmt, scale.reshape(1), vals, st)
        else:
            st = cast_on_device(x, self.fmt, scale, vals)
        nonfinite = st[1] > 0
        write_device_header(data, x.numel(), device_flags(nonfinite, (st[2] > 0) & ~nonfinite), e)
        return payload

    def values(self, payload: Payload) -> torch.Tensor:
        """The summable value section (in the 16-bit format)."""
        return self._layout(payload.numel).view(payload.data, "val")

    def _decode(self, payload: Payload, out: torch.Tensor, accumulate: bool, scale: float) -> None:
        if self._on_device:
            factor = torch.exp2(-payload.field("aux").float()) * scale
            uncast(self.values(payload), self.fmt, factor, out, accumulate)
            return
        uncast(self.values(payload), self.fmt, scale * 2.0 ** (-payload.header.aux), out, accumulate)


@register
class Fp16(_HalfCodec):
    """IEEE half precision (2 bytes per element), power-of-two scaled."""

    name = "fp16"
    Config = HalfConfig
    fmt = torch.float16


@register
class Bf16(_HalfCodec):
    """bfloat16 (2 bytes per element): float32's range with 8 bits of mantissa."""

    name = "bf16"
    Config = BHalfConfig
    fmt = torch.bfloat16
