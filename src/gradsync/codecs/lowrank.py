"""PowerSGD: rank-r approximation by one step of power iteration with a warm-started factor.

The gradient is viewed as a matrix M (first dimension by the rest). One step computes
``P = M Q``, orthonormalizes P, then ``Q = M^T P``; the approximation is ``P Q^T``. ``Q`` is kept per
stream and reused as the starting point of the next call (warm start), which is what makes a
single iteration accurate over time.

Across workers the steps are linear in M, so their factors can be summed (the ``lowrank`` trait):
:meth:`PowerSGD.project` gives ``P_i = M_i Q`` (sum them), :meth:`PowerSGD.reproject` takes the
summed P and gives ``Q_i = M_i^T orth(sum P)`` (sum them), and :meth:`PowerSGD.reconstruct`
turns the summed Q into ``orth(sum P) (sum Q)^T = approx(sum M)``. Every worker must start from
the same Q, which holds because Q comes from the stream's seeded generator and is then updated
with the same summed values everywhere. :meth:`Codec.encode` runs the three steps locally.

Matrices too small to gain (``rank * (rows + cols) >= rows * cols``) and 1-D tensors are sent
dense: the payload is flagged ``DENSE`` and holds the values as float32.

In resident mode the orthogonalization decides on the device (:func:`orthogonalize_on_device`),
whether a payload is dense follows from its shape alone, and the non-finite flag stays on the
device.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import ClassVar

import torch

from gradsync.codecs.base import Codec, EncodeContext, Stream, follow_device, nonfinite_flag
from gradsync.codecs.compressor import Compressor
from gradsync.codecs.config import CodecConfig, check_range
from gradsync.codecs.ops import device_stats, orthogonalize_, orthogonalize_on_device, tensor_stats
from gradsync.codecs.ops.backend import expected_host_read
from gradsync.codecs.payload import Flag, Header, Layout, Payload, device_flags, write_device_header
from gradsync.codecs.registry import register


@dataclass(frozen=True)
class PowersgdConfig(CodecConfig):
    codec: ClassVar[str] = "powersgd"
    rank: int = 4
    warm_start: bool = True
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        check_range(self.codec, "rank", self.rank, 1, 1024)


@dataclass
class PowersgdStream(Stream):
    q: torch.Tensor | None = None  # cols x rank, float32: the warm start
    p: torch.Tensor | None = None  # rows x rank, float32: orth(sum P) of the current call


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The (rows, cols) view PowerSGD uses for a tensor of this shape."""
    if len(shape) < 2:
        return (shape.numel(), 1)
    return (shape[0], shape.numel() // shape[0] if shape[0] else 0)


@register
class PowerSGD(Codec[PowersgdStream]):
    """Rank-r PowerSGD with warm start; payload holds P (rows x r) and Q (cols x r) in float32."""

    name = "powersgd"
    Config = PowersgdConfig
    StreamType = PowersgdStream
    lowrank = True
    per_tensor = True
    randomized = True
    config: PowersgdConfig

    def compresses(self, shape: torch.Size) -> bool:
        """Whether a tensor of this shape is sent as factors (else dense)."""
        rows, cols = matrix_shape(shape)
        r = self.config.rank
        return len(shape) >= 2 and r * (rows + cols) < rows * cols

    def why_dense(self, shape: torch.Size) -> str:
        if len(shape) < 2:
            return "PowerSGD sends 1-D tensors dense"
        return (
            f"PowerSGD rank {self.config.rank} gains nothing on a {tuple(shape)} matrix "
            "(rank x (rows + cols) >= its size)"
        )

    def _layout(self, shape: torch.Size) -> Layout:
        rows, cols = matrix_shape(shape)
        if not self.compresses(shape):
            return Layout([("dense", shape.numel(), torch.float32)])
        r = self.config.rank
        return Layout([("p", rows * r, torch.float32), ("q", cols * r, torch.float32)])

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        return self._layout(shape).nbytes

    # --- the three summable steps -------------------------------------------------------------
    def project(self, m: torch.Tensor, stream: PowersgdStream) -> torch.Tensor:
        """``P = M Q`` with the stream's Q (drawn from its generator on first use)."""
        cols = m.shape[1]
        r = self.config.rank
        follow_device(stream, m.device)
        if stream.q is None or stream.q.shape != (cols, r) or not self.config.warm_start:
            assert stream.generator is not None
            q = torch.randn(
                cols, r, generator=stream.generator, dtype=torch.float32, device=stream.generator.device
            )
            with expected_host_read("a stream's CPU generator"):  # (a first call, or a new shape)
                stream.q = orthogonalize_(q).to(m.device)
        # (Q^T M^T)^T: the same product, several times faster than M @ Q in CPU BLAS for thin Q
        return torch.mm(stream.q.T, m.T).T

    @property
    def host_free(self) -> bool:
        return True

    def orthogonalize(self, m: torch.Tensor) -> torch.Tensor:
        """Orthonormalize the columns of ``m`` in place (on the device in resident mode)."""
        return orthogonalize_on_device(m) if self._on_device else orthogonalize_(m)

    def reproject(self, m: torch.Tensor, p_sum: torch.Tensor, stream: PowersgdStream) -> torch.Tensor:
        """Orthonormalize the summed P (kept in the stream) and return ``Q = M^T P``."""
        stream.p = self.orthogonalize(p_sum.clone())
        return torch.mm(stream.p.T, m).T  # (P^T M)^T = M^T P

    def reconstruct(
        self, q_sum: torch.Tensor, stream: PowersgdStream, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``P (sum Q)^T`` (into ``out``, rows x cols float32, when given); the summed Q becomes
        the next warm start."""
        assert stream.p is not None, "reconstruct() needs reproject() first"
        stream.q = q_sum.clone()
        if out is None:
            return stream.p @ q_sum.T
        return torch.mm(stream.p, q_sum.T, out=out)

    # --- local codec ----------------------------------------------------------------------------
    def _encode(
        self,
        x: torch.Tensor,
        shape: torch.Size,
        ctx: EncodeContext,
        stream: PowersgdStream,
        out: torch.Tensor | None,
    ) -> Payload:
        lay = self._layout(shape)
        data, payload = self._new_payload(lay, x, shape, out)
        if self._on_device:
            return self._encode_on_device(x, shape, stream, data, payload, lay)
        st = tensor_stats(x)
        if not self.compresses(shape):
            lay.view(data, "dense").copy_(x)
            return self._finish(
                data, payload, Header(count=x.numel(), flags=Flag.DENSE | nonfinite_flag(st.nonfinite))
            )
        m = x.view(matrix_shape(shape)).float()
        if st.nonfinite:
            m = torch.zeros_like(m)  # keep the factors finite; the payload is flagged anyway
        q = self.reproject(m, self.project(m, stream), stream)
        assert stream.p is not None  # reproject() keeps orth(P) in the stream
        stream.q = q.clone()
        lay.view(data, "p").copy_(stream.p.reshape(-1))
        lay.view(data, "q").copy_(q.reshape(-1))
        return self._finish(data, payload, Header(count=self.config.rank, flags=nonfinite_flag(st.nonfinite)))

    def _encode_on_device(
        self,
        x: torch.Tensor,
        shape: torch.Size,
        stream: PowersgdStream,
        data: torch.Tensor,
        payload: Payload,
        lay: Layout,
    ) -> Payload:
        nonfinite = device_stats(x).nonfinite
        if not self.compresses(shape):
            lay.view(data, "dense").copy_(x)
            write_device_header(data, x.numel(), device_flags(nonfinite) | int(Flag.DENSE))
            return payload
        m = x.view(matrix_shape(shape)).float()
        m = torch.where(nonfinite, 0.0, m)  # keep the factors finite; the payload is flagged anyway
        q = self.reproject(m, self.project(m, stream), stream)
        assert stream.p is not None
        stream.q = q.clone()
        lay.view(data, "p").copy_(stream.p.reshape(-1))
        lay.view(data, "q").copy_(q.reshape(-1))
        write_device_header(data, self.config.rank, device_flags(nonfinite))
        return payload

    def _dense(self, payload: Payload) -> bool:
        """Whether a payload holds the values instead of factors (in resident mode from its
        shape, without reading the header)."""
        if self._on_device:
            return not self.compresses(payload.shape)
        return bool(payload.header.flags & Flag.DENSE)

    def payload_nbytes(self, payload: Payload) -> int:
        if self._on_device:
            return super().payload_nbytes(payload)
        h = payload.header
        dense = bool(h.flags & Flag.DENSE)
        if dense == self.compresses(payload.shape) or (not dense and h.count != self.config.rank):
            raise ValueError(
                f"{self.name}: header (count={h.count}, flags={h.flags!r}) does not fit "
                f"rank {self.config.rank} for shape {tuple(payload.shape)}"
            )
        return super().payload_nbytes(payload)

    def factors(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._dense(payload):
            return None
        lay = self._layout(payload.shape)
        rows, cols = matrix_shape(payload.shape)
        r = self.config.rank
        return lay.view(payload.data, "p").view(rows, r), lay.view(payload.data, "q").view(cols, r)

    def _decode(self, payload: Payload, out: torch.Tensor, accumulate: bool, scale: float) -> None:
        lay = self._layout(payload.shape)
        if self._dense(payload):
            v = lay.view(payload.data, "dense")
            if scale != 1.0:
                v = v * scale
            out.add_(v) if accumulate else out.copy_(v)
            return
        rows, cols = matrix_shape(payload.shape)
        r = self.config.rank
        p = lay.view(payload.data, "p").view(rows, r)
        q = lay.view(payload.data, "q").view(cols, r)
        if scale != 1.0:
            p = p * scale  # rows x rank
        if out.dtype != torch.float32:
            v = (p @ q.T).reshape(-1)
            out.add_(v) if accumulate else out.copy_(v)
        elif accumulate:
            out.view(rows, cols).addmm_(p, q.T)
        else:
            torch.mm(p, q.T, out=out.view(rows, cols))


def lowrank_codec(compressor: Compressor) -> PowerSGD:
    """The low-rank codec inside a compressor whose ``lowrank`` trait is set."""
    codec = compressor.plain
    if not isinstance(codec, PowerSGD):
        raise TypeError(f"{compressor.spec()!r} is not a low-rank codec")
    return codec


def summed_rounds(
    compressor: Compressor, parts: list[tuple[torch.Tensor, str]], loss_scale: float = 1.0
) -> Generator[tuple[torch.Tensor, bool], None, Callable[[], None] | None]:
    """PowerSGD's synchronization of the tensors ``parts`` (with their stream keys) as rounds of
    sums, the codec's half of it (the collective's half sums each round over the ranks:
    :func:`gradsync.collectives.lowrank_rounds.lowrank_rounds`).

    Yields ``(tensor, last)`` twice: the P factors of every matrix of ``parts`` (the tensors the
    codec sends dense ride along), then the Q factors; the caller sums the tensor in place over
    the ranks before it resumes the rounds, ``last`` saying that no round follows. Returns the
    finisher that writes the summed result into ``parts`` (None when there is nothing to send).
    Each matrix's state (factors, error feedback's residual, its offsets counting from the
    matrix's first element) is its own stream, keyed by its key; a non-finite sum on any rank
    leaves the factors and the residuals as they were and the results NaN."""
    codec = lowrank_codec(compressor)
    feedback = compressor if compressor.error_feedback else None
    dense = [x for x, _ in parts if not codec.compresses(x.shape)]
    mats = []
    first_parts = [x.reshape(-1).float() for x in dense]
    for x, key in parts:
        if not codec.compresses(x.shape):
            continue
        v = compressor.accumulate(x, key, loss_scale)
        m = v.view(matrix_shape(x.shape)).float()
        stream = codec.stream(key)
        p = codec.project(m, stream)
        mats.append((x, key, m, stream, p.shape, stream.p))  # stream.p: restored if the sums overflow
        first_parts.append(p.reshape(-1))
    if not first_parts:
        return None
    first = torch.cat(first_parts)
    yield first, not mats
    pos = sum(x.numel() for x in dense)
    q_locals = []
    for _, _, m, stream, shape, _ in mats:
        n = shape.numel()
        q_locals.append(codec.reproject(m, first[pos : pos + n].view(shape), stream).contiguous())
        pos += n
    second = torch.cat([q.reshape(-1) for q in q_locals]) if q_locals else first.new_empty(0)
    if mats:
        yield second, True

    def finish() -> None:
        # any rank's inf/NaN reaches the summed factors (and stays there: never hidden); in
        # resident mode the test stays on the device and every branch below becomes a where
        finite_t = torch.isfinite(first).all() & torch.isfinite(second).all()
        resident = codec.resident
        finite = True if resident else bool(finite_t)
        pos = 0
        for x in dense:
            x.copy_(first[pos : pos + x.numel()].view(x.shape))
            pos += x.numel()
        qpos = 0
        for (x, key, _, stream, _, old_p), q_local in zip(mats, q_locals, strict=True):
            q_sum = second[qpos : qpos + q_local.numel()].view(q_local.shape)
            qpos += q_local.numel()
            assert stream.p is not None  # reproject() kept orth(sum P) in the stream
            old_q = stream.q
            if feedback is not None:
                if finite:  # what this rank's data contributed to the sum
                    feedback.commit(key, factors=(stream.p, q_local))
                    if resident:
                        feedback.keep_if(~finite_t, key)
                else:
                    feedback.discard(key)
            if not finite:  # keep the factors finite (a skipped step); the NaN result makes it skip
                stream.p = old_p
                x.fill_(float("nan"))
                continue
            out = x.view(matrix_shape(x.shape)) if x.dtype == torch.float32 and x.is_contiguous() else None
            result = codec.reconstruct(q_sum, stream, out=out)
            if out is None:
                x.copy_(result.view(x.shape))
            if resident:
                x.masked_fill_(~finite_t, float("nan"))
                if old_p is not None:
                    stream.p = torch.where(finite_t, stream.p, old_p)
                if old_q is not None and stream.q is not None:
                    stream.q = torch.where(finite_t, stream.q, old_q)

    return finish
