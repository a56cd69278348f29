"""Tensor fusion: which gradients travel together (the ImageNet-in-four-minutes paper's fusion
threshold, the HiPress paper's batch compression), and the flat buffers they are packed into.

Buckets are fixed for a run (all ranks must agree on them, and they key the codecs' per-tensor
state). They are built from the order and the times at which gradients became ready in a measured
step: walking the gradients in ready order, a bucket closes when it holds ``bucket_bytes``
(Horovod's fusion threshold), or before a gradient that became ready more than ``timeout``
after the bucket's first one (Horovod's cycle time: a bucket should not wait long for its last
member while the network idles). Gradients only share a bucket with gradients of the same
dtype, device and codec class (never-compressed small tensors, the main codec, the codec for
large tensors). Buckets are launched in the order in which they become complete.

References:

- ImageNet-in-four-minutes paper: Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
- HiPress paper: Wu et al., "A Generic, High-Performance, Compression-Aware Framework for Data
  Parallel DNN Training", IEEE TPDS (HiPress, CaSync, CompLL).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gradsync.codecs.ops import Workspace


@dataclass
class Slot:
    """One parameter the engine synchronizes."""

    index: int
    name: str
    param: torch.Tensor

    @property
    def numel(self) -> int:
        return self.param.numel()

    @property
    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()

    @property
    def group(self) -> tuple[torch.dtype, torch.device]:
        return (self.param.dtype, self.param.device)


def build_groups(
    slots: list[Slot],
    order: list[int],
    ready_s: list[float] | None,
    codec_class: list[int],
    bucket_bytes: int,
    timeout_s: float,
) -> list[tuple[list[int], int]]:
    """Group slot indices into buckets: ``[(slot indices, codec class), ...]`` in launch order.

    ``order`` lists slot indices in (expected) ready order, ``ready_s`` gives each slot's ready
    time (None: sizes alone decide), ``codec_class`` each slot's class.
    """
    open_: dict[tuple[torch.dtype, torch.device, int], _Open] = {}  # (dtype, device, class)
    closed: list[tuple[int, list[int], int]] = []  # (position of the last member, slots, class)
    for pos, i in enumerate(order):
        slot = slots[i]
        cls = codec_class[i]
        key = (*slot.group, cls)
        t = ready_s[i] if ready_s is not None else 0.0
        b = open_.get(key)
        if b is not None and ready_s is not None and t - b.t0 > timeout_s:
            closed.append((b.last, b.members, cls))
            b = None
        if b is None:
            b = open_[key] = _Open(t0=t)
        b.members.append(i)
        b.nbytes += slot.nbytes
        b.last = pos
        if b.nbytes >= bucket_bytes:
            closed.append((b.last, b.members, cls))
            del open_[key]
    for key, b in open_.items():
        closed.append((b.last, b.members, key[2]))
    closed.sort(key=lambda c: (c[0], c[1][0]))
    return [(members, cls) for _, members, cls in closed]


def codec_class_for(
    nbytes: int, floating: bool, codecs: int, min_compress_bytes: int, large_bytes: int
) -> int:
    """A tensor's codec class: -1 never compressed (no codec, smaller than
    ``min_compress_bytes`` or not floating point), 1 the codec for large tensors (when there are
    two codecs and it holds ``large_bytes`` or more), 0 the scheme's codec."""
    if not codecs or nbytes < min_compress_bytes or not floating:
        return -1
    if codecs > 1 and nbytes >= large_bytes:
        return 1
    return 0


@dataclass
class _Open:
    t0: float
    members: list[int] = field(default_factory=list)
    nbytes: int = 0
    last: int = 0


@dataclass
class Bucket:
    """One bucket of the engine: its slots, how the plan synchronizes it, its flat buffer, and
    the bookkeeping of one step."""

    index: int
    slots: list[Slot]
    key: str
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    workspaces: list[Workspace] = field(default_factory=list)
    _flat: torch.Tensor | None = None
    _lent: torch.Tensor | None = None  # this step: the one gradient that serves as the flat buffer
    # from the plan (before the first plan: dense, the hybrid algorithm)
    compress: bool = False
    parts: int = 1  # pipelined parts when compressed
    codec_id: int = 0  # the codec that compresses it (an id of the engine's CodecSet)
    dense_algorithm: str = "hybrid"  # when it is synchronized densely
    # per step
    skip: frozenset[int] = frozenset()  # positions of frozen slots (requires_grad off): no .grad
    pending: int = 0  # gradients not yet ready
    parts_left: int = 0
    launched_at: float = 0.0

    def __post_init__(self) -> None:
        pos = 0
        self.offsets = []
        for s in self.slots:
            self.offsets.append(pos)
            pos += s.numel
        self.numel = pos

    @property
    def dtype(self) -> torch.dtype:
        return self.slots[0].param.dtype

    @property
    def device(self) -> torch.device:
        return self.slots[0].param.device

    @property
    def nbytes(self) -> int:
        return self.numel * self.slots[0].param.element_size()

    @property
    def flat(self) -> torch.Tensor:
        """The bucket's flat buffer: its own, or for this step the gradient of its one tensor
        (see :meth:`pack`)."""
        if self._lent is not None:
            return self._lent
        if self._flat is None:
            self._flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return self._flat

    def workspace(self, part: int) -> Workspace:
        while len(self.workspaces) <= part:
            self.workspaces.append(Workspace())
        return self.workspaces[part]

    def view(self, j: int) -> torch.Tensor:
        """Slot ``j``'s region of the flat buffer, in the parameter's shape."""
        s = self.slots[j]
        return self.flat[self.offsets[j] : self.offsets[j] + s.numel].view(s.param.shape)

    def holds(self, j: int, g: torch.Tensor) -> bool:
        """Whether gradient ``g`` of slot ``j`` already is its region of the flat buffer (a
        zero-copy bucket): then nothing is copied in or out."""
        if self._flat is None or g.dtype != self._flat.dtype or g.device != self._flat.device:
            return False
        start = self._flat.data_ptr() + self.offsets[j] * g.element_size()
        return g.data_ptr() == start and g.is_contiguous()

    def _lendable(self, g: torch.Tensor) -> bool:
        """Whether a one-tensor bucket can work in its gradient ``g`` itself this step."""
        return (
            len(self.slots) == 1
            and g.layout == torch.strided
            and g.is_contiguous()
            and g.dtype == self.dtype
            and g.device == self.device
            and g.numel() == self.numel
            and not self.holds(0, g)
            and not self.skip
        )

    def attach(self) -> None:
        """Point every slot's ``.grad`` at its region of the flat buffer: a missing gradient
        becomes zeros there, an existing one is copied in once (zero-copy buckets). A frozen
        parameter (``requires_grad`` off) keeps its gradient as it is, None included."""
        self._lent = None
        for j, s in enumerate(self.slots):
            g = s.param.grad
            if not s.param.requires_grad or (g is not None and self.holds(j, g)):
                continue
            view = self.view(j)
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            s.param.grad = view

    def detach(self) -> None:
        """Give every gradient that is a view into the flat buffer its own copy (before the
        buffer is used for something else than this rank's gradients)."""
        self._lent = None
        for j, s in enumerate(self.slots):
            g = s.param.grad
            if g is not None and self.holds(j, g):
                s.param.grad = g.clone()

    def pack(self) -> None:
        """Copy the gradients in (any memory layout); a missing gradient counts as zero.

        A bucket of one tensor whose gradient is contiguous works in that gradient itself this
        step (it is final: its hook fired): nothing is copied in, and the synchronized result is
        already in place for :meth:`unpack` (for the large layers that are a bucket each, two
        passes over their gradient saved every step).

        A frozen slot (in :attr:`skip`) counts as zero and its ``.grad`` is left alone: one that
        is a view into the buffer gets its own copy first."""
        self._lent = None
        g = self.slots[0].param.grad
        if g is not None and self._lendable(g):
            self._lent = g.view(-1)
            return
        for j, s in enumerate(self.slots):
            g = s.param.grad
            if j in self.skip:
                if g is not None and self.holds(j, g):
                    s.param.grad = g.clone()
                self.view(j).zero_()
                continue
            if g is not None and self.holds(j, g):
                continue
            if g is None:
                self.view(j).zero_()
            elif g.layout != torch.strided:
                raise ValueError(
                    f"gradsync: the gradient of {s.name!r} is a {g.layout} tensor; gradsync synchronizes "
                    "dense gradients only (build embeddings with sparse=False)"
                )
            else:
                self.view(j).copy_(g)

    def unpack(self) -> None:
        """Write the synchronized values back into the gradients (creating missing ones), but
        not into those of frozen slots."""
        if self._lent is not None:  # the gradient was the buffer: the result is in it
            self._lent = None
            return
        for j, s in enumerate(self.slots):
            if j in self.skip:
                continue
            g = s.param.grad
            if g is None:
                s.param.grad = self.view(j).clone()
            elif not self.holds(j, g):
                g.copy_(self.view(j))

    def part_range(self, part: int, parts: int) -> tuple[int, int]:
        """Element range of part ``part`` of ``parts`` (equal cuts)."""
        lo = self.numel * part // parts
        return lo, self.numel * (part + 1) // parts
