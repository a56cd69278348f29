"""What one synchronized step cost, as the engine measured it."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gradsync.sync.buckets import Bucket
    from gradsync.sync.tasks import Task


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


@dataclass
class StepState:
    """The engine's record of one synchronized step while it runs: the figures above are made
    from it when it ends. ``slots``: the parameters synchronized."""

    slots: int
    dense: bool = True
    shadow: bool = False  # taken without data (a joined rank under Join)
    loss_scale: float = 1.0  # read once, when the step begins
    ready_at: list[float | None] = field(default_factory=list)  # per slot; None: not (yet) ready
    order: list[int] = field(default_factory=list)  # the slots in the order they became ready
    next: int = 0  # the next bucket to launch
    tasks: list[Task] = field(default_factory=list)
    task_bucket: list[int] = field(default_factory=list)  # per task: its bucket (-1: check, flags)
    backward_end_at: float = 0.0
    nonfinite: list[Any] = field(default_factory=list)  # per packed bucket: a 0-d bool on its device

    def __post_init__(self) -> None:
        if not self.ready_at:
            self.ready_at = [None] * self.slots


def bucket_stats(buckets: Sequence[Bucket], cur: StepState) -> list[BucketStats]:
    """Each bucket's figures for the step ``cur``."""
    out = [
        BucketStats(
            index=b.index,
            key=b.key,
            raw_bytes=b.nbytes,
            wire_bytes=0,
            compressed=b.compress and not cur.dense,
            parts=0,
            ready_at=max(
                (r for r in (cur.ready_at[s.index] for s in b.slots) if r is not None), default=b.launched_at
            ),
            launched_at=b.launched_at,
            done_at=0.0,
            compute_s=0.0,
            decode_s=0.0,
            comm_s=0.0,
        )
        for b in buckets
    ]
    for task, b in zip(cur.tasks, cur.task_bucket, strict=True):
        if b < 0:
            continue
        st = out[b]
        st.parts += 1
        st.wire_bytes += task.sent_bytes
        st.compute_s += task.compute_s
        st.decode_s += task.finish_s
        st.comm_s += task.comm_s
        st.done_at = max(st.done_at, task.done_at or 0.0)
    return out


def step_stats(
    step: int,
    cur: StepState,
    buckets: Sequence[Bucket],
    launched_in_backward: int,
    overflow: bool,
    sent_bytes: dict[str, int],
    world: int,
    lag: tuple[float | None, float | None],
    density: float | None,
) -> StepStats:
    """The figures of the step ``cur`` that just ended: its tasks' busy times, its timestamps,
    the bytes sent (``sent_bytes``, per level) and each bucket's figures. ``lag``: the step
    check's wait and lag (None without the check)."""
    now = time.perf_counter()
    tasks = cur.tasks
    first_ready = min((t for t in cur.ready_at if t is not None), default=cur.backward_end_at)
    comm_starts = [t.first_comm_at for t in tasks if t.first_comm_at is not None]
    per_bucket = bucket_stats(buckets, cur)
    raw = sum(b.raw_bytes for b in per_bucket)
    return StepStats(
        step=step,
        dense=cur.dense,
        buckets=len(buckets),
        compressed_buckets=0 if cur.dense else sum(b.compress for b in buckets),
        launched_in_backward=launched_in_backward,
        backward_s=cur.backward_end_at - first_ready,
        exposed_s=now - cur.backward_end_at,
        compute_s=sum(t.compute_s for t in tasks),
        decode_s=sum(t.finish_s for t in tasks),
        comm_s=sum(t.comm_s for t in tasks),
        sent_bytes=sent_bytes,
        overflow=overflow,
        first_ready_at=first_ready,
        backward_end_at=cur.backward_end_at,
        first_comm_at=min(comm_starts) if comm_starts else None,
        done_at=now,
        raw_bytes=raw,
        dense_wire_bytes=int(2 * (world - 1) / world * raw),
        check_wait_s=lag[0],
        lag_s=lag[1],
        bucket_stats=per_bucket,
        density=None if cur.dense else density,
    )
