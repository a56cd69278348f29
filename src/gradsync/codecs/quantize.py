"""Quantizing codecs: ``onebit``, ``tbq``, ``terngrad`` and ``qrgc``.

- ``onebit``: one sign bit per element plus reconstruction values (1-bit SGD). With ``scales=2``
  (default) a non-negative element decodes to the mean of the non-negative elements and a negative
  one to the mean of the negative elements, which minimizes the squared error for a sign code.
  ``scales=1`` decodes to ``sign * mean |x|`` (the scaled-sign variant of BytePS / signSGD).
- ``tbq``: threshold binary quantization (Strom): elements beyond ``+-threshold`` are sent as
  ``+-threshold``, the rest as 0; 2-bit codes. Meant to run under error feedback.
- ``terngrad``: stochastic ternary (``bits=2``) or ``2^(bits-1)-1``-level quantization scaled by the
  maximum magnitude (optionally clipped at ``clip * rms``); unbiased up to that clipping.
- ``qrgc``: the RedSync paper's quantized residual compression: alternate between the ``k`` largest
  positive and the ``k`` most negative elements, send their indices and a single mean value.

References:

- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from gradsync.codecs import kernels
from gradsync.codecs.base import Codec, EncodeContext, Stream, nonfinite_flag
from gradsync.codecs.config import CodecConfig, SparsityConfig, check_choice, check_range
from gradsync.codecs.ops import (
    Key,
    abs_max,
    device_stats,
    draw_words,
    lut_decode,
    packed_nbytes,
    sign_pack,
    sign_pack_on_device,
    sparse_add_,
    sparse_to_dense_,
    stochastic_pack,
    tensor_stats,
    threshold_pack,
    threshold_pack_on_device,
    topk,
)
from gradsync.codecs.payload import Header, Layout, Payload, device_flags, write_device_header
from gradsync.codecs.registry import register
from gradsync.codecs.sparse import index_dtype

_TINY = 1.401298464324817e-45  # smallest positive float32: "strictly positive" as a floor


def _codes_layout(numel: int, bits: int) -> Layout:
    return Layout([("codes", packed_nbytes(numel, bits), torch.uint8)])


@dataclass(frozen=True)
class OnebitConfig(CodecConfig):
    codec: ClassVar[str] = "onebit"
    scales: int = 2

    def validate(self) -> None:
        super().validate()
        check_choice(self.codec, "scales", self.scales, (1, 2))


@register
class OneBit(Codec[Stream]):
    """Sign bits with one or two reconstruction values (header ``s0``: bit 1, ``s1``: bit 0)."""

    capturable = True

    name = "onebit"
    Config = OnebitConfig
    config: OnebitConfig

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        return _codes_layout(numel, 1).nbytes

    def _encode(
        self, x: torch.Tensor, shape: torch.Size, ctx: EncodeContext, stream: Stream, out: torch.Tensor | None
    ) -> Payload:
        n = x.numel()
        lay = _codes_layout(n, 1)
        data, payload = self._new_payload(lay, x, shape, out)
        if self._on_device:
            return self._encode_on_device(x, data, payload, lay.view(data, "codes"))
        st = sign_pack(x, lay.view(data, "codes"))
        if self.config.scales == 2:
            hi = st.pos_sum / st.pos_count if st.pos_count else 0.0
            lo = st.neg_sum / st.neg_count if st.neg_count else 0.0
        else:
            m = (st.pos_sum - st.neg_sum) / n if n else 0.0
            hi, lo = m, -m
        return self._finish(data, payload, Header(count=n, flags=nonfinite_flag(st.nonfinite), s0=hi, s1=lo))

    @property
    def host_free(self) -> bool:
        return True

    def _encode_on_device(
        self, x: torch.Tensor, data: torch.Tensor, payload: Payload, codes: torch.Tensor
    ) -> Payload:
        if kernels.use_kernels(x):  # one fused pass (gradsync.codecs.kernels)
            sums = torch.empty(4, dtype=torch.float64, device=x.device)
            kernels.onebit_encode(x, codes, sums)
        else:
            sums = sign_pack_on_device(x, codes)
        pos_sum, pos_count, neg_sum, nonfinite = sums.unbind()
        n = x.numel()
        if self.config.scales == 2:
            hi = torch.where(pos_count > 0, pos_sum / pos_count.clamp(min=1), 0.0)
            lo = torch.where(pos_count < n, neg_sum / (n - pos_count).clamp(min=1), 0.0)
        else:
            hi = (pos_sum - neg_sum) / max(n, 1)
            lo = -hi
        write_device_header(data, n, device_flags(nonfinite), 0, hi.float(), lo.float())
        return payload

    def _decode(self, payload: Payload, out: torch.Tensor, accumulate: bool, scale: float) -> None:
        codes = _codes_layout(payload.numel, 1).view(payload.data, "codes")
        if self._on_device:
            table = torch.stack([payload.field("s1"), payload.field("s0")]) * scale
            lut_decode(codes, 1, table, out, accumulate)
            return
        h = payload.header
        lut_decode(codes, 1, [h.s1 * scale, h.s0 * scale], out, accumulate)


@dataclass(frozen=True)
class TbqConfig(CodecConfig):
    codec: ClassVar[str] = "tbq"
    threshold: float = 0.01

    def validate(self) -> None:
        super().validate()
        check_range(self.codec, "threshold", self.threshold, 0.0, lo_open=True)


@register
class TBQ(Codec[Stream]):
    """2-bit codes: +threshold, -threshold or 0 (header ``count``: non-zero codes, ``s0``: threshold)."""

    capturable = True

    name = "tbq"
    Config = TbqConfig
    config: TbqConfig

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        return _codes_layout(numel, 2).nbytes

    def _encode(
        self, x: torch.Tensor, shape: torch.Size, ctx: EncodeContext, stream: Stream, out: torch.Tensor | None
    ) -> Payload:
        lay = _codes_layout(x.numel(), 2)
        data, payload = self._new_payload(lay, x, shape, out)
        tau = self.config.threshold
        if self._on_device:
            if kernels.use_kernels(x):  # one fused pass (gradsync.codecs.kernels)
                counts = torch.empty(2, dtype=torch.int64, device=x.device)
                kernels.tbq_encode(x, tau, lay.view(data, "codes"), counts)
            else:
                counts = threshold_pack_on_device(x, tau, lay.view(data, "codes"))
            nonzero_t, nonfinite_t = counts.unbind()
            write_device_header(data, nonzero_t, device_flags(nonfinite_t), 0, tau)
            return payload
        nonzero, nonfinite = threshold_pack(x, tau, lay.view(data, "codes"))
        return self._finish(data, payload, Header(count=nonzero, flags=nonfinite_flag(nonfinite), s0=tau))

    @property
    def host_free(self) -> bool:
        return True

    def _decode(self, payload: Payload, out: torch.Tensor, accumulate: bool, scale: float) -> None:
        codes = _codes_layout(payload.numel, 2).view(payload.data, "codes")
        if self._on_device:
            t = payload.field("s0") * scale
            lut_decode(
                codes, 2, torch.stack([torch.zeros_like(t), t, -t, torch.zeros_like(t)]), out, accumulate
            )
            return
        tau = payload.header.s0 * scale
        lut_decode(codes, 2, [0.0, tau, -tau, 0.0], out, accumulate)


@dataclass(frozen=True)
class TerngradConfig(CodecConfig):
    codec: ClassVar[str] = "terngrad"
    bits: int = 2
    clip: float | None = None
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        check_choice(self.codec, "bits", self.bits, (2, 4, 8))
        if self.clip is not None:
            check_range(self.codec, "clip", self.clip, 0.0, lo_open=True)


@register
class TernGrad(Codec[Stream]):
    """Stochastic symmetric quantization scaled by max |x| (header ``s0``: scale, ``aux``: bits)."""

    capturable = True

    name = "terngrad"
    Config = TerngradConfig
    config: TerngradConfig
    randomized = True
    biased = False  # stochastic rounding: E[decode(encode(x))] = x

    @property
    def levels(self) -> int:
        return 2 ** (self.config.bits - 1) - 1

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        return _codes_layout(numel, self.config.bits).nbytes

    def _encode(
        self, x: torch.Tensor, shape: torch.Size, ctx: EncodeContext, stream: Stream, out: torch.Tensor | None
    ) -> Payload:
        assert stream.generator is not None
        n, bits = x.numel(), self.config.bits
        lay = _codes_layout(n, bits)
        data, payload = self._new_payload(lay, x, shape, out)
        if self._on_device:
            return self._encode_on_device(x, ctx, stream.words(), data, payload, lay.view(data, "codes"))
        if self.config.clip is None:
            scale, nonfinite = abs_max(x)
        else:
            st = tensor_stats(x)
            nonfinite = st.nonfinite > 0
            scale = min(st.max_abs, self.config.clip * math.sqrt(st.sum_sq / n)) if n else 0.0
        k1, k2 = draw_words(stream.generator)
        # distinct noise per worker: otherwise every rank would round the same way
        k2 = (k2 + 0x9E3779B9 * ctx.rank) & 0xFFFFFFFF
        mult = self.levels / scale if scale > 0 and math.isfinite(scale) else 0.0
        stochastic_pack(x, mult, self.levels, bits, (k1, k2), lay.view(data, "codes"))
        header = Header(
            count=n, flags=nonfinite_flag(nonfinite), aux=bits, s0=scale if math.isfinite(scale) else 0.0
        )
        return self._finish(data, payload, header)

    @property
    def host_free(self) -> bool:
        return True

    def _encode_on_device(
        self,
        x: torch.Tensor,
        ctx: EncodeContext,
        words: torch.Tensor,
        data: torch.Tensor,
        payload: Payload,
        codes: torch.Tensor,
    ) -> Payload:
        n, bits = x.numel(), self.config.bits
        st = device_stats(x)
        scale = st.max_abs.float()
        if self.config.clip is not None and n:
            scale = torch.minimum(scale, self.config.clip * (st.sum_sq / n).sqrt().float())
        usable = (scale > 0) & scale.isfinite()
        mult = torch.where(usable, self.levels / torch.where(usable, scale, 1.0), 0.0)
        k1, k2 = words[0], words[1]  # (distinct noise per worker, as on the host path)
        k2 = (k2 + 0x9E3779B9 * ctx.rank) & 0xFFFFFFFF
        if kernels.use_kernels(x):  # one fused pass (gradsync.codecs.kernels)
            keys = torch.stack([k1.reshape(()), k2.reshape(())]).to(torch.int64)
            kernels.stochastic_encode(x, mult.float().reshape(1), self.levels, bits, keys, codes)
        else:
            stochastic_pack(x, mult, self.levels, bits, (k1, k2), codes)
        s0 = torch.where(scale.isfinite(), scale, 0.0)
        write_device_header(data, n, device_flags(st.nonfinite), bits, s0)
        return payload

    def lut(self, scale: float, bits: int) -> list[float]:
        levels = 2 ** (bits - 1) - 1
        step = scale / levels
        half = 1 << (bits - 1)
        return [(-1.0 if c & half else 1.0) * (c & (half - 1)) * step for c in range(1 << bits)]

    def _decode(self, payload: Payload, out: torch.Tensor, accumulate: bool, scale: float) -> None:
        bits = self.config.bits
        if self._on_device:  # the table made on the device from the header's scale
            code = torch.arange(1 << bits, device=out.device)
            half = 1 << (bits - 1)
            level = torch.where((code & half) != 0, -(code & (half - 1)), code & (half - 1))
            step = payload.field("s0") * scale / self.levels
            codes = _codes_layout(payload.numel, bits).view(payload.data, "codes")
            lut_decode(codes, bits, level.float() * step, out, accumulate)
            return
        h = payload.header
        lut_decode(
            _codes_layout(payload.numel, bits).view(payload.data, "codes"),
            bits,
            self.lut(h.s0 * scale, bits),
            out,
            accumulate,
        )


@dataclass(frozen=True)
class QrgcConfig(SparsityConfig):
    codec: ClassVar[str] = "qrgc"


@register
class QRGC(Codec[Stream]):
    """The RedSync paper's quantized RGC: k same-signed indices and their mean (header ``s0``: mean,
    ``aux``: sign)."""

    name = "qrgc"
    Config = QrgcConfig
    sparse = True
    config: QrgcConfig

    def check_numel(self, numel: int) -> None:
        self.config.k_for(numel, self.scheduled_density)

    @staticmethod
    def _layout(numel: int, count: int) -> Layout:
        return Layout([("idx", count, index_dtype(numel))])

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        return self._layout(numel, self.config.k_for(numel, self.scheduled_density)).nbytes

    def payload_nbytes(self, payload: Payload) -> int:
        if not 0 <= payload.count <= payload.numel:
            raise ValueError(f"{self.name}: header count {payload.count} is outside [0, {payload.numel}]")
        return self._layout(payload.numel, payload.count).nbytes

    def _encode(
        self, x: torch.Tensor, shape: torch.Size, ctx: EncodeContext, stream: Stream, out: torch.Tensor | None
    ) -> Payload:
        n = x.numel()
        positive = stream.calls % 2 == 0
        if n:
            idx, val, st = topk(
                x,
                self.config.k_for(n, self.scheduled_density),
                Key.POS if positive else Key.NEG,
                at_least=_TINY,
                ws=self.ws,
            )
        else:
            idx, val, st = x.new_zeros(0, dtype=torch.int32), x[:0], tensor_stats(x)
        mean = float(val.float().mean()) if val.numel() else 0.0
        lay = self._layout(n, idx.numel())
        data, payload = self._new_payload(lay, x, shape, out)
        lay.view(data, "idx").copy_(idx)
        header = Header(
            count=idx.numel(), flags=nonfinite_flag(st.nonfinite), aux=1 if positive else -1, s0=mean
        )
        return self._finish(data, payload, header)

    def transmitted(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        idx = self._layout(payload.numel, payload.count).view(payload.data, "idx")
        return idx, torch.full((idx.numel(),), payload.header.s0, dtype=payload.dtype, device=idx.device)

    def _decode(self, payload: Payload, out: torch.Tensor, accumulate: bool, scale: float) -> None:
        idx, val = self.transmitted(payload)
        val = val.to(out.dtype) * scale
        if accumulate:
            sparse_add_(out, idx, val)
        else:
            sparse_to_dense_(out, idx, val)
