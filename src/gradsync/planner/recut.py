"""Re-cutting compressed buckets by their ready times: fewer start-ups where they outweigh overlap.

The fusion timeout (:func:`gradsync.sync.buckets.build_groups`) cuts buckets where gradients
become ready far apart, for the sake of overlap. On a slow network with small compressed
payloads that is the wrong trade: each compressed bucket costs its own collectives (two
all-gathers for a PowerSGD bucket, one per part for top-k), and each of those pays the link's
start-up whatever it carries. A 4 x 1 run of vgg-small at 100 Mbit/s measured 7-15 ms per such
collective in the engine, for 2 to 15 kB of payload, while its whole backward pass took 12-33 ms.

So once the planner has decided each bucket, it merges two compressed buckets of the same codec
class (the later one taking the earlier one's gradients) when the merged plan is predicted to
finish sooner. Their chosen codecs may differ where the planner has candidates (``auto``): the
merged bucket is decided afresh, among the same candidates. The prediction runs the plan through
the engine's order of work: a bucket launches when its last gradient is ready and not before the
bucket ahead of it; its encode runs on the compute thread while the communication thread still
carries the buckets ahead of it, which it then takes one after another (each stage for the time
the cost model predicts for it). An order of work that ran each bucket whole, one after another,
overrated merges: the simulator's 2 x 2 with four PowerSGD buckets ready 10 ms apart merged two
of them under top-k and came out 14 % slower than PowerSGD alone
(``tests/test_whatif.py::test_plain_auto_is_no_slower_than_any_fixed_scheme_of_its_codecs``).
A merge launches the earlier bucket's gradients later and
saves one bucket's fixed costs; it is made only where it saves at least ``MIN_GAIN`` of what the
earlier bucket was predicted to take, so that a few microseconds of jitter in the measured ready
times do not flip the plan from one re-plan to the next. Passes over the plan, each merging where
it pays, keep the work near quadratic in the number of buckets (a best-merge-first search is
cubic).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence

from gradsync.planner.plan import BucketPlan

MIN_GAIN = 0.1
"""The share of the earlier bucket's predicted time a merge must save to be made."""


def launch_times(buckets: Sequence[BucketPlan], ready: Sequence[float]) -> list[float]:
    """When each bucket launches: its last gradient ready, and not before the bucket ahead of it
    (the engine launches the plan's buckets in order)."""
    out, t = [], 0.0
    for b in buckets:
        t = max(t, max(ready[s] for s in b.slots))
        out.append(t)
    return out


def bucket_seconds(b: BucketPlan) -> float:
    """The planner's prediction for one bucket (its encode and decode included)."""
    ms = b.compressed_ms if b.compress else b.dense_ms
    return (ms or 0.0) / 1e3


def span(buckets: Sequence[BucketPlan], ready: Sequence[float]) -> float:
    """Predicted seconds from the first gradient ready to the last bucket synchronized, in the
    engine's order of work (:mod:`gradsync.sync.tasks`): a bucket launches as
    :func:`launch_times` says; each of its parts is encoded on the compute thread, communicated
    on the communication thread (strictly bucket after bucket, part after part), then decoded on
    the compute thread; the compute thread runs the ready work of the oldest bucket first. So a
    bucket's encode overlaps the communication of the buckets ahead of it. A bucket without
    stages (dense, or planned without them) is one communication of its predicted time."""
    work = []  # per part, in plan order: (launch, encode, communication, decode)
    for b, launch in zip(buckets, launch_times(buckets, ready), strict=True):
        if b.compress and b.stages_ms is not None:
            enc, comm, dec = (x / 1e3 for x in b.stages_ms)
            work += [(launch, enc, comm, dec)] * max(b.partitions, 1)
        else:
            work.append((launch, 0.0, bucket_seconds(b), 0.0))
    cpu = comm_free = done = 0.0
    encode_next = 0  # encodes run in order (oldest first): the next one is work[encode_next]
    # decodes waiting for the compute thread, (ready, seconds): communication runs in order, so
    # they become ready in order, and the first is both the earliest and the oldest
    decodes: deque[tuple[float, float]] = deque()
    while encode_next < len(work) or decodes:
        enc_ready = work[encode_next][0] if encode_next < len(work) else math.inf
        now = max(cpu, min(enc_ready, decodes[0][0] if decodes else math.inf))
        if decodes and decodes[0][0] <= now:  # a waiting decode is older than any encode left
            cpu = now + decodes.popleft()[1]
            done = max(done, cpu)
            continue
        _, enc, comm, dec = work[encode_next]
        cpu = now + enc
        comm_free = max(comm_free, cpu) + comm
        decodes.append((comm_free, dec))
        done = max(done, comm_free)
        encode_next += 1
    return done


def merge_compressed(
    buckets: list[BucketPlan],
    classes: list[int],
    ready: Sequence[float],
    decide: Callable[[list[int], int], BucketPlan],
    nbytes: Sequence[int],
    kinds: Sequence[object],
    max_bytes: int,
    min_gain: float = MIN_GAIN,
) -> list[BucketPlan]:
    """Merge compressed buckets while a merge shortens the predicted :func:`span`.

    ``buckets`` in launch order, ``classes`` each one's codec class (what ``decide`` takes),
    ``ready`` each slot's ready time (seconds after the step's first gradient). ``decide(slots,
    cls)`` plans a bucket of those slots afresh (codec, parts, predictions). A compressed bucket
    may merge into the next compressed bucket of the same class (whatever candidate codec each
    chose: the merged one chooses again), when their slots
    share a ``kinds`` entry and hold at most ``max_bytes`` together; the merged bucket takes the
    later one's place, and may merge on in turn. A merge is made when it saves at least
    ``min_gain`` of the earlier bucket's predicted time; passes over the plan repeat until none
    is. Returns the buckets."""
    buckets, classes = list(buckets), list(classes)
    cache: dict[tuple[tuple[int, ...], int], BucketPlan] = {}

    def merged(slots: list[int], cls: int) -> BucketPlan:
        key = (tuple(slots), cls)
        if key not in cache:
            cache[key] = decide(slots, cls)
        return cache[key]

    current = span(buckets, ready)
    changed = True
    while changed:
        changed = False
        i = 0
        while i < len(buckets):
            a = buckets[i]
            j = _next_of_its_class(buckets, classes, i) if a.compress else None
            if j is not None and kinds[buckets[j].slots[0]] == kinds[a.slots[0]]:
                slots = a.slots + buckets[j].slots
                m = merged(slots, classes[i]) if sum(nbytes[s] for s in slots) <= max_bytes else None
                if m is not None and m.compress:
                    trial = buckets[:i] + buckets[i + 1 : j] + [m] + buckets[j + 1 :]
                    t = span(trial, ready)
                    if current - t >= min_gain * bucket_seconds(a):
                        buckets, current, changed = trial, t, True
                        del classes[i]  # the merged bucket has the class both had
                        continue  # the bucket now at i is the next one; the merged one comes later
            i += 1
    return buckets


def _next_of_its_class(buckets: Sequence[BucketPlan], classes: Sequence[int], i: int) -> int | None:
    for j in range(i + 1, len(buckets)):
        if buckets[j].compress and classes[j] == classes[i]:
            return j
    return None
