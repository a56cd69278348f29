"""What one synchronized step cost, as the engine measured it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class BucketStats:
    """One bucket of one step, on this rank. Times in seconds; ``*_at`` are ``perf_counter()``
    values. ``compute_s`` is packing and encoding (and merging between collectives), ``decode_s``
    decoding and unpacking, ``comm_s`` the time inside its collectives; ``wire_bytes`` what its
    collectives sent from this rank (all levels)."""

    index: int
    key: str
    raw_bytes: int
    wire_bytes: int
    compressed: bool
    parts: int
    ready_at: float
    launched_at: float
    done_at: float
    compute_s: float
    decode_s: float
    comm_s: float

    @property
    def ratio(self) -> float | None:
        """Gradient bytes over bytes sent (None when nothing was sent)."""
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else None


@dataclass
class StepStats:
    """Times in seconds, measured on this rank.

    ``backward_s`` runs from the first gradient that became ready to the end of the backward
    pass; ``exposed_s`` from the end of the backward pass to the moment every gradient was
    synchronized (the time synchronization added to the step). ``compute_s`` (packing, encoding,
    merging), ``decode_s`` (decoding, unpacking) and ``comm_s`` (inside collectives) are busy
    times of the engine's threads, mostly hidden behind the backward pass when overlap works.
    """

    step: int
    dense: bool
    buckets: int
    compressed_buckets: int
    launched_in_backward: int
    backward_s: float = 0.0
    exposed_s: float = 0.0
    compute_s: float = 0.0
    decode_s: float = 0.0
    comm_s: float = 0.0
    sent_bytes: dict[str, int] = field(default_factory=dict)
    overflow: bool = False
    # absolute perf_counter() timestamps, for timelines
    first_ready_at: float = 0.0
    backward_end_at: float = 0.0
    first_comm_at: float | None = None
    done_at: float = 0.0
    raw_bytes: int = 0
    """Bytes of the gradients synchronized this step."""
    dense_wire_bytes: int = 0
    """What a flat ring all-reduce of the same gradients would send from this rank, 2(p-1)/p of
    ``raw_bytes``: the reference of :attr:`reduction`."""
    check_wait_s: float | None = None
    """This rank's wait in the step check (the first collective of the step, issued when its
    first gradient is ready): how long the slowest rank kept it waiting."""
    lag_s: float | None = None
    """The largest ``check_wait_s`` over all ranks, of the *previous* step (it travels in this
    step's check): how far the slowest rank lagged behind the fastest. None without the check."""
    density: float | None = None
    """The density the sparsifiers ran at under ``density_schedule`` (the largest, when codecs
    differ); None at their own density."""
    bucket_stats: list[BucketStats] = field(default_factory=list)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sent this step, all levels."""
        return sum(self.sent_bytes.values())

    @property
    def reduction(self) -> float | None:
        """How many times fewer bytes than a dense ring all-reduce this rank sent (1.0 dense)."""
        return self.dense_wire_bytes / self.wire_bytes if self.wire_bytes else None

    @property
    def overlapped_s(self) -> float:
        """Communication time that ran while the backward pass was still computing."""
        if self.first_comm_at is None:
            return 0.0
        return max(0.0, min(self.comm_s, self.backward_end_at - self.first_comm_at))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["overlapped_s"] = self.overlapped_s
        d["wire_bytes"] = self.wire_bytes
        d["reduction"] = self.reduction
        return d
