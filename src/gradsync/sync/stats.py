"""What one synchronized step cost, as the engine measured it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


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

    @property
    def overlapped_s(self) -> float:
        """Communication time that ran while the backward pass was still computing."""
        if self.first_comm_at is None:
            return 0.0
        return max(0.0, min(self.comm_s, self.backward_end_at - self.first_comm_at))

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["overlapped_s"] = self.overlapped_s
        return d
