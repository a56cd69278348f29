"""The engine's buckets: which parameters travel together and how the plan synchronizes each
group, one :class:`~gradsync.sync.buckets.Bucket` record per bucket.

Before the first plan the buckets are fused by size alone in reverse registration order (roughly
the order backward produces gradients) and synchronized densely; a plan replaces them with its
own grouping and choices. Every rank holds the same layout: the plan is decided on rank 0 and
broadcast, and the initial grouping depends on the model alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync.codecs import Compressor
from gradsync.planner.plan import Plan
from gradsync.sync.buckets import Bucket, Slot, build_groups
from gradsync.sync.carry import Layouts
from gradsync.sync.scheme import Scheme


class BucketLayout:
    """The buckets of ``slots`` (``bucket_bytes``: the fusion threshold of the initial ones)."""

    def __init__(self, slots: Sequence[Slot], bucket_bytes: int) -> None:
        self.slots = slots
        self.bucket_bytes = bucket_bytes
        self.plan: Plan | None = None
        self.buckets: list[Bucket] = []
        self.bucket_of: list[int] = []  # per slot: the index of its bucket
        self.reset()

    def reset(self) -> None:
        """Back to the initial buckets, with no plan."""
        order = [s.index for s in reversed(self.slots)]
        n = len(self.slots)
        self.plan = None
        groups = build_groups(list(self.slots), order, None, [-1] * n, self.bucket_bytes, 0.0)
        self._set([members for members, _ in groups])

    def install(self, plan: Plan, codecs: Sequence[Compressor]) -> None:
        """Make ``plan``'s buckets the layout (``ValueError`` for a plan of other parameters or
        codecs, or one that cuts a low-rank codec's bucket in parts)."""
        covered = sorted(i for b in plan.buckets for i in b.slots)
        if covered != list(range(len(self.slots))) or any(b.codec_id >= len(codecs) for b in plan.buckets):
            raise ValueError("gradsync: the plan does not match this model's parameters or codecs")
        if any(b.compress and b.partitions > 1 and codecs[b.codec_id].per_tensor for b in plan.buckets):
            raise ValueError(
                "gradsync: a per-tensor codec (PowerSGD) needs whole tensors; its buckets take one part"
            )
        self.plan = plan
        self._set([b.slots for b in plan.buckets])
        for bucket, bp in zip(self.buckets, plan.buckets, strict=True):
            bucket.compress, bucket.codec_id = bp.compress, bp.codec_id
            bucket.parts = bp.partitions if bp.compress else 1
            bucket.dense_algorithm = bp.dense_algorithm

    def _set(self, groups: Sequence[Sequence[int]]) -> None:
        self.buckets, self.bucket_of = [], [0] * len(self.slots)
        for b, members in enumerate(groups):
            slots = [self.slots[i] for i in members]
            first, last = slots[0].name, slots[-1].name
            self.buckets.append(Bucket(b, slots, first if first == last else f"{first}..{last}"))
            for i in members:
                self.bucket_of[i] = b

    def layouts(self, buckets: Sequence[Bucket] | None = None) -> Layouts:
        """Where each parameter lies in each bucket (by bucket key): of these buckets, or the
        current ones."""
        return layouts_of(self.buckets if buckets is None else buckets)

    def table(self, scheme: Scheme, codecs: Sequence[Compressor], schemes: Sequence[Scheme]) -> str:
        """The plan as a readable table (empty before the first plan)."""
        if self.plan is None:
            return ""
        return self.plan.table(
            [s.name for s in self.slots], [s.nbytes for s in self.slots], scheme, [c.spec() for c in codecs],
            list(schemes),
        )  # fmt: skip


def layouts_of(buckets: Sequence[Bucket]) -> Layouts:
    """Where each parameter lies in each bucket (by bucket key)."""
    return Layouts((b.key, [(s.name, s.numel) for s in b.slots]) for b in buckets)
