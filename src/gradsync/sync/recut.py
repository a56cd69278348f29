"""Re-cutting compressed buckets by their ready times: fewer start-ups where they outweigh overlap.

The fusion timeout (:func:`gradsync.sync.buckets.build_groups`) cuts buckets where gradients
become ready far apart, for the sake of overlap. On a slow network with small compressed
payloads that is the wrong trade: each compressed bucket costs its own collectives (two
all-gathers for a PowerSGD bucket, one per part for top-k), and each of those pays the link's
start-up whatever it carries. A 4 x 1 run of vgg-small at 100 Mbit/s measured 7-15 ms per such
collective in the engine, for 2 to 15 kB of payload, while its whole backward pass took 12-33 ms.

So once the planner has decided each bucket, it merges two compressed buckets of the same codec
(the later one taking the earlier one's gradients) when the merged plan is predicted to finish
sooner. The prediction runs the plan through the engine's order of work: a bucket launches when
its last gradient is ready and not before the bucket ahead of it, and the communication thread
takes the buckets one after another, each for the time the cost model predicts for it. A merge
launches the earlier bucket's gradients later and saves one bucket's fixed costs; it is kept
only where that saves at least ``MIN_GAIN`` of the predicted span, so that jitter in the
measured ready times does not flip the plan from one re-plan to the next.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gradsync.sync.plan import BucketPlan

MIN_GAIN = 0.01
"""The share of the predicted synchronization span a merge must save to be made."""


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
    """Predicted seconds from the first gradient ready to the last bucket synchronized, with the
    buckets taken one after another in plan order."""
    done = 0.0
    for b, launch in zip(buckets, launch_times(buckets, ready), strict=True):
        done = max(done, launch) + bucket_seconds(b)
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
) -> tuple[list[BucketPlan], list[int]]:
    """Merge compressed buckets while a merge shortens the predicted :func:`span`.

    ``buckets`` in launch order, ``classes`` each one's codec class (what ``decide`` takes),
    ``ready`` each slot's ready time (seconds after the step's first gradient). ``decide(slots,
    cls)`` plans a bucket of those slots afresh (codec, parts, predictions). Candidates are each
    compressed bucket and the next compressed bucket of the same codec and class whose slots
    share its ``kinds`` entry, up to ``max_bytes`` together; the merged bucket takes the later
    one's place. Greedy: the best merge first, until none saves ``min_gain`` of the span.
    Returns the buckets and their classes."""
    buckets, classes = list(buckets), list(classes)
    cache: dict[tuple[tuple[int, ...], int], BucketPlan] = {}

    def merged(slots: list[int], cls: int) -> BucketPlan:
        key = (tuple(slots), cls)
        if key not in cache:
            cache[key] = decide(slots, cls)
        return cache[key]

    while True:
        current = span(buckets, ready)
        best: tuple[float, int, int, BucketPlan] | None = None
        for i, a in enumerate(buckets):
            if not a.compress:
                continue
            j = next((j for j in range(i + 1, len(buckets)) if buckets[j].compress
                      and buckets[j].codec_id == a.codec_id and classes[j] == classes[i]), None)  # fmt: skip
            if j is None or kinds[buckets[j].slots[0]] != kinds[a.slots[0]]:
                continue
            slots = a.slots + buckets[j].slots
            if sum(nbytes[s] for s in slots) > max_bytes:
                continue
            m = merged(slots, classes[i])
            if not m.compress:
                continue
            trial = buckets[:i] + buckets[i + 1 : j] + [m] + buckets[j + 1 :]
            t = span(trial, ready)
            if t < current * (1.0 - min_gain) and (best is None or t < best[0]):
                best = (t, i, j, m)
        if best is None:
            return buckets, classes
        _, i, j, m = best
        buckets[j] = m  # the merged bucket has the class both had
        del buckets[i], classes[i]
