"""The one protocol of everything that compresses a tensor for a collective.

Two kinds of objects implement it: a :class:`~gradsync.codecs.base.Codec` (a compressor with
per-tensor state, no memory of what it dropped) and an
:class:`~gradsync.codecs.feedback.ErrorFeedback` around a codec (which keeps what the codec
dropped and adds it back next time). The collectives, the cost model, the planner and the sync
engine take a :class:`Compressor` and read its *traits*; none of them asks which kind it holds.

Traits (plain attributes, the same on a codec and on error feedback around it):

``sparse``
    the payload is (indices, values): a subset of the elements is sent.
``lossless``
    decode(encode(x)) == x exactly.
``randomized``
    encoding draws random numbers (from the stream's seeded generator).
``summable``
    payloads have a value section (:meth:`Compressor.values`) that adds up across ranks in one
    round, without decoding (dense 16-bit formats): the ring and parameter-server strategies add
    values instead of decoding and re-encoding.
``agreed_scale``
    summable payloads only add up when every rank encoded with the same ``EncodeContext.amax``.
``lowrank``
    the codec compresses by factors whose sums are computed in two all-reduce rounds (PowerSGD),
    so collectives run :mod:`gradsync.collectives.lowrank_rounds` instead of a payload strategy.
``per_tensor``
    the codec needs each tensor whole, with its shape (PowerSGD factors each matrix): a caller
    hands it every tensor of a bucket as a view of its own with its own stream, never a part of a
    bucket or an FSDP shard of several parameters, and it is not element-wise (a momentum
    exchange cannot use it). :meth:`Compressor.compresses` says which shapes it compresses; the
    others travel as they are (:meth:`Compressor.why_dense` says why).
``biased``
    the compression error is systematic, so training needs error feedback to converge like dense
    training (top-k, onebit, PowerSGD). False for lossless codecs, unbiased stochastic ones
    (TernGrad, random-k with ``unbiased=true``) and 16-bit rounding.
``error_feedback``
    this compressor keeps a residual: :meth:`accumulate` / :meth:`commit` / :meth:`discard` and the
    rounds (:meth:`begin_round`, :meth:`rollback_round`) do real work; on a codec they do none.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from gradsync.codecs.base import Codec, EncodeContext
    from gradsync.codecs.payload import Payload


@dataclass
class Owed:
    """What one error-feedback stream still owes: its residual (and, with momentum correction,
    its momentum), flat and unscaled, and where its first element sits in the tensor the caller
    reduced (``EncodeContext.offset``)."""

    key: str
    offset: int
    residual: torch.Tensor
    momentum: torch.Tensor | None = None


class Compressor(abc.ABC):
    """A codec, or a codec with error feedback: what the collectives compress with."""

    name: str
    sparse: bool = False
    lossless: bool = False
    randomized: bool = False
    summable: bool = False
    agreed_scale: bool = False
    lowrank: bool = False
    per_tensor: bool = False
    biased: bool = True
    error_feedback: bool = False

    @property
    @abc.abstractmethod
    def plain(self) -> Codec:
        """The codec that makes and reads the payloads (this object itself for a codec)."""

    @abc.abstractmethod
    def spec(self) -> str:
        """The spec string that builds an equal compressor (``topk:density=0.01+ef``)."""

    @abc.abstractmethod
    def fresh(self) -> Compressor:
        """A new compressor with the same configuration and no state (for timing it)."""

    # ------------------------------------------------------------------ payloads
    @abc.abstractmethod
    def encode(
        self,
        x: torch.Tensor,
        ctx: EncodeContext | None = None,
        *,
        out: torch.Tensor | None = None,
        loss_scale: float = 1.0,
    ) -> Payload:
        """Compress ``x`` (``loss_scale``: the scale ``x`` carries, for state kept across steps)."""

    @abc.abstractmethod
    def decode(
        self,
        payload: Payload,
        *,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
        scale: float = 1.0,
    ) -> torch.Tensor:
        """Decompress into a new tensor, or into (``accumulate``: add to) ``out``, times ``scale``."""

    # ------------------------------------------------------------------ host-free (resident) mode
    @property
    def resident(self) -> bool:
        """Whether this compressor runs in resident mode (see :meth:`set_resident`)."""
        return self.plain.resident

    @property
    def host_free(self) -> bool:
        """Whether, in resident mode, encoding and decoding never read a device value on the host
        (the codec has an on-device version with a fixed-capacity payload). Codecs without one
        keep working in resident mode, with their host reads."""
        return self.plain.host_free

    def set_resident(self, on: bool) -> None:
        """Resident mode: payloads of a size fixed in advance, statistics and flags left on the
        device, headers written there and never read by the host. What a GPU needs to overlap
        communication with computation; on the CPU it serves tests and audits. Every rank must
        choose the same (the payload sizes depend on it). Chosen once: at build
        (:func:`~gradsync.codecs.build_codec`'s ``resident``) or before the first encode; a codec
        that has encoded refuses a change (RuntimeError)."""
        self.plain.set_resident(on)

    def compresses(self, shape: torch.Size) -> bool:
        """Whether a tensor of this shape is compressed (a ``per_tensor`` codec may send some
        shapes as they are); True for every other codec."""
        plain = self.plain
        return True if plain is self else plain.compresses(shape)

    def why_dense(self, shape: torch.Size) -> str:
        """Why a tensor of this shape is not compressed (where :meth:`compresses` is False)."""
        plain = self.plain
        return "" if plain is self else plain.why_dense(shape)

    @abc.abstractmethod
    def check_numel(self, numel: int) -> None:
        """Raise ``ValueError`` if the configuration cannot be applied to ``numel`` elements."""

    @abc.abstractmethod
    def estimate_nbytes(
        self,
        numel: int,
        shape: torch.Size | tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """Payload bytes for ``numel`` elements (exact for fixed-size codecs, else expected)."""

    @abc.abstractmethod
    def max_nbytes(
        self,
        numel: int,
        shape: torch.Size | tuple[int, ...] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> int:
        """An upper bound of the payload size."""

    @abc.abstractmethod
    def payload_from_bytes(
        self, data: torch.Tensor, shape: torch.Size | tuple[int, ...], dtype: torch.dtype
    ) -> Payload:
        """Wrap bytes from a peer, checking their size against their header."""

    @abc.abstractmethod
    def payload_nbytes(self, payload: Payload) -> int:
        """The size a payload must have given its header."""

    @abc.abstractmethod
    def values(self, payload: Payload) -> torch.Tensor | None:
        """The value section of a ``summable`` payload (None otherwise)."""

    @abc.abstractmethod
    def transmitted(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(indices, decoded values)`` of a sparse payload; None for dense ones."""

    def factors(self, payload: Payload) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(P, Q)`` of a low-rank payload that decodes to ``P Q^T``; None for every other."""
        return None

    def transmitted_indices(self, payload: Payload) -> torch.Tensor | None:
        """The indices a sparse payload carries; None for dense ones."""
        sent = self.transmitted(payload)
        return None if sent is None else sent[0]

    # ------------------------------------------------------------------ state
    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """All state as tensors and plain values."""

    @abc.abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the configuration must match)."""

    @abc.abstractmethod
    def reset_state(self) -> None:
        """Forget all state."""

    @abc.abstractmethod
    def drop_streams(self, keep: Callable[[str], bool]) -> list[str]:
        """Forget the state of every stream whose key ``keep`` rejects (the tensors it belonged to
        are no longer compressed this way) and return those keys, sorted."""

    def take_streams(self, keep: Callable[[str], bool]) -> list[Owed]:
        """:meth:`drop_streams`, returning what the dropped streams still owed (nothing without
        error feedback), so that the caller can hand it on instead of losing it."""
        self.drop_streams(keep)
        return []

    # ------------------------------------------------------------------ error feedback
    # Protocols that compress in several rounds (PowerSGD inside a collective) call these three
    # instead of encode(); a compressor without error feedback keeps nothing.
    def accumulate(
        self, grad: torch.Tensor, key: str = "", loss_scale: float = 1.0, offset: int = 0
    ) -> torch.Tensor:
        """The flat tensor to compress this step (the gradient plus what is owed to it);
        ``offset`` as ``EncodeContext.offset``."""
        return grad.reshape(-1)

    def commit(  # noqa: B027 - nothing to keep without error feedback
        self,
        key: str = "",
        *,
        dense: torch.Tensor | None = None,
        indices: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        factors: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """What was sent of the tensor :meth:`accumulate` returned (dense, indices and values, or
        low-rank factors ``(P, Q)`` of ``P Q^T``)."""

    def discard(self, key: str = "") -> None:  # noqa: B027 - nothing to keep without error feedback
        """Drop the step :meth:`accumulate` began (its gradient was not finite)."""

    def keep_if(self, flag: torch.Tensor, key: str = "") -> None:  # noqa: B027 - nothing to keep without error feedback
        """After :meth:`commit`: where the 0-dim device bool ``flag`` is set (the gradient was
        not finite), restore the state the commit replaced; read on the device only (resident
        mode's :meth:`discard`)."""

    def begin_round(self, scope: Callable[[str], bool] | None = None) -> None:  # noqa: B027 - nothing to keep without error feedback
        """A synchronization round (a training step) starts: :meth:`rollback_round` undoes it.
        ``scope``: the round covers the streams whose key it accepts (None: every stream)."""

    def rollback_round(self, scope: Callable[[str], bool] | None = None) -> int:
        """Undo what this round did to the state (of the streams ``scope`` accepts); return how
        many streams changed."""
        return 0

    def residual_norm(self) -> float | None:
        """The L2 norm over every stream's residual (unscaled units), None without error feedback."""
        return None

    def owed(self) -> list[Owed]:
        """What every stream still owes (copies; nothing without error feedback)."""
        return []

    def homes(self) -> dict[str, tuple[int, int]]:
        """``{key: (offset, numel)}`` of every stream with a residual (none without error
        feedback): where each one's elements sit in the caller's tensor."""
        return {}

    def rollback_elements(self, key: str, start: int, stop: int) -> bool:
        """Give elements ``start:stop`` of a stream back the residual and momentum they had
        before this round's commit (their result was not applied); False when there is nothing
        to undo."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec()!r})"


__all__ = ["Compressor", "Owed"]
