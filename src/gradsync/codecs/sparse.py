"""Sparsifying codecs: the payload is (indices, values) and decoding is a sparse add.

Payload: header (count = number of elements sent) + int32 indices (int64 for tensors of 2^31
elements or more) + values in the input dtype. ``qrgc`` in :mod:`gradsync.codecs.quantize`
sends indices with one shared value instead.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from gradsync.codecs import selection, selection_on_device
from gradsync.codecs.base import Codec, EncodeContext, Stream, StreamT, nonfinite_flag
from gradsync.codecs.config import SparsityConfig, check_range
from gradsync.codecs.ops import sparse_add_, sparse_to_dense_
from gradsync.codecs.payload import Header, Layout, Payload, device_flags, write_device_header
from gradsync.codecs.registry import register


def index_dtype(numel: int) -> torch.dtype:
    """int32 indices while they fit, int64 beyond."""
    return torch.int32 if numel <= 2**31 - 1 else torch.int64


def chunk_counts(numel: int, chunk: int, density: float) -> tuple[int, int, int]:
    """A chunked selection's counts for ``numel`` elements: (full chunks, elements kept per full
    chunk, elements kept of the last, shorter one), each chunk keeping ``ceil(density * its
    size)`` and at least one."""
    full, tail = divmod(numel, chunk)
    per_chunk = min(chunk, max(1, math.ceil(density * chunk)))
    of_tail = min(tail, max(1, math.ceil(density * tail))) if tail else 0
    return full, per_chunk, of_tail


def sparse_layout(numel: int, count: int, dtype: torch.dtype) -> Layout:
    return Layout([("idx", count, index_dtype(numel)), ("val", count, dtype)])


class SparseCodec(Codec[StreamT]):
    """Base of the (indices, values) codecs; subclasses implement :meth:`select`."""

    sparse = True
    config: SparsityConfig
    capturable = True

    fuses_sum: ClassVar[bool] = False
    """:meth:`select` takes ``addends`` and computes its input as their sum in its first scan
    (the others are never given any)."""

    def select(
        self, x: torch.Tensor, k: int, stream: StreamT, addends: selection.Addends = None
    ) -> selection.Selected:
        raise NotImplementedError

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
        if not self.fuses_sum:
            return super().encode_sum(a, b, into, shape, ctx, out=out)
        ctx = ctx or EncodeContext()
        flat, addends = into.view(-1), (a.view(-1), b.view(-1))
        return self._encode_in_stream(
            flat, ctx, lambda stream: self._encode(flat, shape, ctx, stream, out, addends)
        )

    def select_on_device(
        self, x: torch.Tensor, k: int, stream: StreamT, addends: selection.Addends = None
    ) -> selection_on_device.Capped | None:
        """The host-free selection (:mod:`gradsync.codecs.selection_on_device`) into
        :meth:`device_capacity` slots; None where the codec has none. ``addends``: ``x`` is to be
        their sum (error feedback's residual and gradient), written into it as it is read."""
        return None

    def device_capacity(self, numel: int) -> int:
        """The slots of a resident payload: the most elements the host-free selection sends."""
        return self.target_count(numel)

    @property
    def host_free(self) -> bool:
        return type(self).select_on_device is not SparseCodec.select_on_device

    def _count(self, numel: int, payload: Payload | None = None) -> int:
        """Elements in a payload: the fixed capacity in resident mode, else the header's count
        (for a payload) or the expected count."""
        if self._on_device:
            return self.device_capacity(numel)
        return payload.count if payload is not None else self.target_count(numel)

    def check_numel(self, numel: int) -> None:
        self.target_count(numel)

    def target_count(self, numel: int) -> int:
        """The ``k`` handed to :meth:`select` (and the expected payload count)."""
        return self.config.k_for(numel, self.scheduled_density)

    def max_count(self, numel: int) -> int:
        """Most elements a payload can hold (its capacity)."""
        return self.target_count(numel)

    def _encode(
        self,
        x: torch.Tensor,
        shape: torch.Size,
        ctx: EncodeContext,
        stream: StreamT,
        out: torch.Tensor | None,
        addends: selection.Addends = None,
    ) -> Payload:
        n = x.numel()
        if self._on_device:
            return self._encode_on_device(x, shape, stream, out, addends)
        if n == 0:
            sel = selection.Selected(x.new_zeros(0, dtype=torch.int32), x[:0], selection.tensor_stats(x))
        else:
            sel = self.select(x, self.target_count(n), stream, addends)
        lay = sparse_layout(n, sel.count, x.dtype)
        data, payload = self._new_payload(lay, x, shape, out)
        lay.view(data, "idx").copy_(sel.idx)
        lay.view(data, "val").copy_(sel.val)
        return self._finish(data, payload, Header(count=sel.count, flags=nonfinite_flag(sel.stats.nonfinite)))

    def _encode_on_device(
        self,
        x: torch.Tensor,
        shape: torch.Size,
        stream: StreamT,
        out: torch.Tensor | None,
        addends: selection.Addends,
    ) -> Payload:
        """Resident mode: a fixed-capacity payload, its header written on the device."""
        n, cap = x.numel(), self.device_capacity(x.numel())
        lay = sparse_layout(n, cap, x.dtype)
        data, payload = self._new_payload(lay, x, shape, out)
        if n == 0:
            write_device_header(data, 0)
            return payload
        sel = self.select_on_device(x, self.target_count(n), stream, addends)
        assert sel is not None and sel.idx.numel() == cap, (self.name, cap)
        lay.view(data, "idx").copy_(sel.idx)
        lay.view(data, "val").copy_(sel.val)
        write_device_header(data, sel.count, device_flags(sel.nonfinite))
        return payload

    def sparse_view(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        """The (indices, values) sections of a payload (in resident mode, every slot: padding
        slots hold a selected index with the value 0)."""
        lay = sparse_layout(payload.numel, self._count(payload.numel, payload), payload.dtype)
        return lay.view(payload.data, "idx"), lay.view(payload.data, "val")

    def _decode(self, payload: Payload, out: torch.Tensor, accumulate: bool, scale: float) -> None:
        idx, val = self.sparse_view(payload)
        if scale != 1.0:
            val = val * scale  # k elements
        if accumulate:
            sparse_add_(out, idx, val, on_device=self._on_device)
        else:
            sparse_to_dense_(out, idx, val, on_device=self._on_device)

    def transmitted(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor]:
        return self.sparse_view(payload)

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        return sparse_layout(numel, self._count(numel), dtype).nbytes

    def _max_nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        count = self.device_capacity(numel) if self._on_device else self.max_count(numel)
        return sparse_layout(numel, count, dtype).nbytes

    def payload_nbytes(self, payload: Payload) -> int:
        if self._on_device:  # fixed: the header is not read
            return sparse_layout(payload.numel, self.device_capacity(payload.numel), payload.dtype).nbytes
        if not 0 <= payload.count <= max(payload.numel, 0):
            raise ValueError(f"{self.name}: header count {payload.count} is outside [0, {payload.numel}]")
        return sparse_layout(payload.numel, payload.count, payload.dtype).nbytes


@dataclass(frozen=True)
class TopkConfig(SparsityConfig):
    codec: ClassVar[str] = "topk"


@register
class TopK(SparseCodec[Stream]):
    """Exact top-k by magnitude (the reference selection)."""

    name = "topk"
    Config = TopkConfig

    fuses_sum = True

    def select(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection.Selected:
        return selection.exact_topk(x, k, self.ws, addends)

    def select_on_device(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection_on_device.Capped:
        return selection_on_device.exact_topk(x, k, addends)


@dataclass(frozen=True)
class ChunktopkConfig(SparsityConfig):
    codec: ClassVar[str] = "chunktopk"
    chunk: int = 4096
    """Elements per chunk: each chunk keeps its own ``ceil(density * chunk)`` largest."""

    def validate(self) -> None:
        if self.k is not None:
            raise ValueError(
                f"{self.codec}: give density (the share each chunk keeps), not k (got k={self.k})"
            )
        super().validate()
        check_range(self.codec, "chunk", self.chunk, 1)


@register
class ChunkTopK(SparseCodec[Stream]):
    """Top-k within each fixed-size chunk: the payload's size follows from the tensor's alone."""

    name = "chunktopk"
    Config = ChunktopkConfig
    config: ChunktopkConfig

    fuses_sum = True  # resident: error feedback's add fused into the selection kernel's read

    def _counts(self, numel: int) -> tuple[int, int, int]:
        """(full chunks, elements kept per full chunk, elements kept of the last, shorter one)."""
        density = self.scheduled_density if self.scheduled_density is not None else self.config.density
        assert density is not None
        return chunk_counts(numel, self.config.chunk, density)

    def target_count(self, numel: int) -> int:
        full, per_chunk, of_tail = self._counts(numel)
        return full * per_chunk + of_tail

    def select(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection.Selected:
        if addends is not None:  # (the host path adds first; the resident kernel adds as it reads)
            torch.add(*addends, out=x)
        return selection.chunked_topk(x, self.config.chunk, *self._counts(x.numel())[1:])

    def select_on_device(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection_on_device.Capped:
        return selection_on_device.chunked_topk(x, self.config.chunk, *self._counts(x.numel())[1:], addends)


@dataclass(frozen=True)
class MstopkConfig(SparsityConfig):
    codec: ClassVar[str] = "mstopk"
    iters: int = 20
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        check_range(self.codec, "iters", self.iters, 1, 64)


@register
class MSTopK(SparseCodec[Stream]):
    """The MSTopK paper's approximate top-k: exactly k elements, at most a few from a narrow band."""

    name = "mstopk"
    Config = MstopkConfig
    config: MstopkConfig
    randomized = True

    fuses_sum = True

    def select(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection.Selected:
        assert stream.generator is not None
        return selection.mstopk(x, k, self.config.iters, stream.generator, self.ws, addends)

    def select_on_device(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection_on_device.Capped:
        return selection_on_device.mstopk(x, k, self.config.iters, stream.words(1), addends)


@dataclass(frozen=True)
class TrimmedTopkConfig(SparsityConfig):
    codec: ClassVar[str] = "trimmed_topk"
    step: float = 0.2

    def validate(self) -> None:
        super().validate()
        check_range(self.codec, "step", self.step, 0.0, 1.0, lo_open=True)


@register
class TrimmedTopK(SparseCodec[Stream]):
    """The RedSync paper's trimmed top-k: an exact top-k restricted to a trimmed candidate set."""

    name = "trimmed_topk"
    Config = TrimmedTopkConfig
    config: TrimmedTopkConfig

    fuses_sum = True

    def select(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection.Selected:
        return selection.trimmed_topk(x, k, self.config.step, self.ws, addends)

    def select_on_device(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection_on_device.Capped:
        return selection_on_device.trimmed_topk(x, k, self.config.step, addends)


@dataclass(frozen=True)
class BsearchConfig(SparsityConfig):
    codec: ClassVar[str] = "bsearch"
    eps: float = 1e-3
    reuse: int = 5

    def validate(self) -> None:
        super().validate()
        check_range(self.codec, "eps", self.eps, 0.0, 1.0, lo_open=True, hi_open=True)
        check_range(self.codec, "reuse", self.reuse, 1)


@dataclass
class BsearchStream(Stream):
    threshold: float | torch.Tensor | None = None
    """The threshold to reuse: a float on the host path, a 0-dim tensor in resident mode."""
    age: int = 0


@register
class Bsearch(SparseCodec[BsearchStream]):
    """The RedSync paper's threshold binary search: between k and 2k elements, threshold reused
    ``reuse`` calls."""

    name = "bsearch"
    Config = BsearchConfig
    config: BsearchConfig
    StreamType = BsearchStream

    def max_count(self, numel: int) -> int:
        # the count is in [k, 2k] except on data where no threshold achieves it (heavy ties)
        return numel

    def device_capacity(self, numel: int) -> int:
        return min(numel, 2 * self.target_count(numel))

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        if self._on_device:
            return super()._nbytes(numel, shape, dtype)
        k = self.config.k_for(numel, self.scheduled_density)
        return sparse_layout(numel, min(numel, math.ceil(1.5 * k)), dtype).nbytes

    def _reuses(self, stream: BsearchStream) -> bool:
        """Resident mode: whether this call reuses the stream's threshold (a decision of the host,
        from its count of calls since the last search: a constant of the call's graph)."""
        return isinstance(stream.threshold, torch.Tensor) and 1 <= stream.age < self.config.reuse

    def before_device_work(self, stream: BsearchStream, device: torch.device) -> tuple[Any, ...]:
        t = stream.threshold
        if not isinstance(t, torch.Tensor) or t.device != device or t.dim() != 0:
            # one 0-dim tensor for good, updated in place (a float left by the host path is
            # not reused: the next call searches)
            stream.threshold, stream.age = torch.zeros((), dtype=torch.float32, device=device), 0
        return (*super().before_device_work(stream, device), self._reuses(stream))

    def after_device_work(self, stream: BsearchStream) -> None:
        super().after_device_work(stream)
        stream.age = stream.age + 1 if self._reuses(stream) else 1

    def select_on_device(
        self, x: torch.Tensor, k: int, stream: BsearchStream, addends: selection.Addends = None
    ) -> selection_on_device.Capped:
        t = stream.threshold
        assert isinstance(t, torch.Tensor)
        if addends is not None:
            torch.add(*addends, out=x)
        sel, threshold = selection_on_device.bsearch(
            x, k, self.config.eps, t if self._reuses(stream) else None
        )
        t.copy_(threshold)
        return sel

    def select(
        self, x: torch.Tensor, k: int, stream: BsearchStream, addends: selection.Addends = None
    ) -> selection.Selected:
        t = stream.threshold  # (a tensor left by resident mode is not reused here)
        reuse = t if isinstance(t, float) and stream.age < self.config.reuse else None
        res = selection.bsearch(x, k, self.config.eps, reuse, self.ws)
        if not res.selected.stats.nonfinite:  # a non-finite input leaves the state alone
            stream.threshold = res.threshold
            stream.age = 1 if res.searched else stream.age + 1
        return res.selected


@dataclass(frozen=True)
class DgcConfig(SparsityConfig):
    codec: ClassVar[str] = "dgc"
    sample: float = 0.01
    tolerance: float = 0.2
    seed: int = 0

    def validate(self) -> None:
        super().validate()
        check_range(self.codec, "sample", self.sample, 0.0, 1.0, lo_open=True)
        check_range(self.codec, "tolerance", self.tolerance, 0.0, 1.0, hi_open=True)


@register
class DGC(SparseCodec[Stream]):
    """Deep Gradient Compression's sampled-threshold selection, refined to exactly k when it can."""

    name = "dgc"
    Config = DgcConfig
    config: DgcConfig
    randomized = True

    def select(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection.Selected:
        assert stream.generator is not None
        return selection.dgc(x, k, self.config.sample, self.config.tolerance, stream.generator, self.ws)

    def select_on_device(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection_on_device.Capped:
        return selection_on_device.dgc(x, k, self.config.sample, stream.words(), addends)


@dataclass(frozen=True)
class GraddropConfig(SparsityConfig):
    codec: ClassVar[str] = "graddrop"
    threshold: float | None = None
    sample: float = 0.01
    seed: int = 0

    def validate(self) -> None:
        if self.threshold is None:
            super().validate()
        else:
            check_range(self.codec, "threshold", self.threshold, 0.0)
            if self.density is not None or self.k is not None:
                raise ValueError(f"{self.codec}: give threshold or density/k, not both")
        check_range(self.codec, "sample", self.sample, 0.0, 1.0, lo_open=True)


@register
class GradDrop(SparseCodec[Stream]):
    """GradDrop: drop every element below a magnitude threshold (given or sampled for a density)."""

    name = "graddrop"
    Config = GraddropConfig
    config: GraddropConfig
    randomized = True

    def target_count(self, numel: int) -> int:
        return 0 if self.config.threshold is not None else self.config.k_for(numel, self.scheduled_density)

    def max_count(self, numel: int) -> int:
        return numel

    def _nbytes(self, numel: int, shape: torch.Size, dtype: torch.dtype) -> int:
        if self.config.threshold is not None:  # unknown in advance: the worst case
            return self._max_nbytes(numel, shape, dtype)
        return super()._nbytes(numel, shape, dtype)

    @property
    def host_free(self) -> bool:
        # a given threshold bounds nothing: its payload's size is the data's (read on the host)
        return self.config.threshold is None

    def device_capacity(self, numel: int) -> int:
        return min(numel, 2 * self.target_count(numel))

    def select_on_device(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection_on_device.Capped:
        return selection_on_device.graddrop(x, k, self.config.sample, stream.words(), addends)

    def select(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection.Selected:
        assert stream.generator is not None
        return selection.graddrop(
            x, k or None, self.config.threshold, self.config.sample, stream.generator, self.ws
        )


@dataclass(frozen=True)
class RandomkConfig(SparsityConfig):
    codec: ClassVar[str] = "randomk"
    unbiased: bool = False
    seed: int = 0


@register
class RandomK(SparseCodec[Stream]):
    """k uniformly random elements; ``unbiased`` scales them by numel/k so E[decode] = x."""

    name = "randomk"
    Config = RandomkConfig
    randomized = True
    config: RandomkConfig

    def __init__(self, config: RandomkConfig) -> None:
        super().__init__(config)
        self.biased = not config.unbiased

    def select(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection.Selected:
        assert stream.generator is not None
        sel = selection.randomk(x, k, stream.generator)
        if self.config.unbiased and k:
            sel.val = sel.val * (x.numel() / k)
        return sel

    def select_on_device(
        self, x: torch.Tensor, k: int, stream: Stream, addends: selection.Addends = None
    ) -> selection_on_device.Capped:
        sel, sizes = selection_on_device.randomk(x, k, stream.words(), addends)
        if self.config.unbiased and k:  # each element sent with probability 1 / its stratum's size
            sel.val = sel.val * sizes.to(sel.val.dtype)
        return sel
