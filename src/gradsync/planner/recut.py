"""Re-cutting compressed buckets by their ready times (fewer start-ups where they outweigh overlap),
and re-choosing their candidate codecs by the same order of work.

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

The planner first takes, per bucket, the candidate whose formula predicts the least time. That
total does not say which thread the time holds: the communication thread runs the buckets'
collectives one after another, so a candidate that keeps it longer (PowerSGD with local
aggregation holds it from the node's reduce to its broadcast, its leader's projections and
decode included) can lengthen the step although its own total is the least; on a simulated 2 x 2
at 100 Mbit/s it did by a tenth against top-k, whose encode and decode run on the compute thread
beside the other buckets' transfers. :func:`rechoose_candidates` therefore tries each bucket's
other candidates in :func:`span` and takes one where it shortens the step by ``MIN_GAIN`` of the
bucket's predicted time.
"""

from __future__ import annotations

import heapq
import math
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
    :func:`launch_times` says; each of its parts runs its steps (:attr:`BucketPlan.stages_ms`,
    compute and communication in turn, as :func:`gradsync.planner.decide.stage_times` gives
    them) one after another. The communication thread serves the parts strictly in order, each
    until its last collective is done, and waits for a part's compute between its collectives
    (PowerSGD's second projection) without taking the next part's; the compute thread, when
    free, runs the ready step of the oldest part. So a bucket's encode overlaps the
    communication of the buckets ahead of it. A bucket without stages (dense, or planned without
    them) is one communication of its predicted time."""
    parts: list[tuple[float, tuple[float, ...]]] = []  # (launch, steps) in plan order
    for b, launch in zip(buckets, launch_times(buckets, ready), strict=True):
        if b.compress and b.stages_ms is not None:
            parts += [(launch, tuple(x / 1e3 for x in b.stages_ms))] * max(b.partitions, 1)
        else:
            parts.append((launch, (0.0, bucket_seconds(b), 0.0)))
    n = len(parts)
    steps = [st for _, st in parts]
    last = [len(st) - 2 for st in steps]  # each part's last collective
    nxt = [0] * n  # each part's next step
    free = [launch for launch, _ in parts]  # when each part's next step may start
    pending = [(launch, p) for p, (launch, _) in enumerate(parts)]  # compute steps, by ready time
    heapq.heapify(pending)
    oldest: list[int] = []  # compute steps ready now, by part
    push, pop, inf = heapq.heappush, heapq.heappop, math.inf
    serving = 0  # the part the communication thread serves
    t = cpu = comm = done = 0.0
    while True:
        while serving < n and nxt[serving] > last[serving]:
            serving += 1  # no collective left in that part
        waiting = inf  # when the communication thread's next step may start
        if serving < n and nxt[serving] % 2:
            waiting = max(free[serving], comm)
            if waiting <= t:
                k = nxt[serving]
                comm = t + steps[serving][k]
                free[serving] = comm
                done = max(done, comm)
                nxt[serving] = k + 1
                push(pending, (comm, serving))  # a part's steps end with a compute step
                waiting = inf
        if cpu <= t:
            while pending and pending[0][0] <= t:
                push(oldest, pop(pending)[1])
            if oldest:
                p = pop(oldest)
                cpu = t + steps[p][nxt[p]]
                free[p] = cpu
                done = max(done, cpu)
                nxt[p] += 1
                continue
        upcoming = inf  # the next moment either thread may start something
        for moment in (waiting, cpu, comm, pending[0][0] if pending else inf):
            if t < moment < upcoming:
                upcoming = moment
        if upcoming == inf:
            return done
        t = upcoming


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


def rechoose_candidates(
    buckets: list[BucketPlan],
    ready: Sequence[float],
    alternatives: Callable[[BucketPlan], Sequence[BucketPlan]],
    min_gain: float = MIN_GAIN,
) -> list[BucketPlan]:
    """Swap compressed buckets for other candidates while a swap shortens the predicted
    :func:`span`.

    ``alternatives(b)`` gives bucket ``b`` planned with each of its other candidates (the same
    slots; those that are not compressed are not taken). First, where taking one candidate in
    every bucket that can take it gives a shorter span, the plan starts from the shortest such
    one (swaps one bucket at a time can stop short of it, each having to pay on its own). Then a
    bucket takes the choice that shortens the span the most, when that saves at least
    ``min_gain`` of the bucket's predicted time (so that jitter in the measured ready times does
    not flip the plan); passes repeat until no swap is made. Every change shortens the span, so
    the passes end. Returns the buckets."""
    buckets = list(buckets)
    choices = [[b, *(a for a in alternatives(b) if a.compress)] if b.compress else [b] for b in buckets]
    current = span(buckets, ready)
    for cid in dict.fromkeys(a.codec_id for each in choices for a in each[1:]):
        uniform = [
            next((a for a in each if a.codec_id == cid), b) for b, each in zip(buckets, choices, strict=True)
        ]
        t = span(uniform, ready)
        if t < current:
            buckets, current = uniform, t
    changed = True
    while changed:
        changed = False
        for i, b in enumerate(buckets):
            best: tuple[float, BucketPlan] | None = None
            for alt in choices[i]:
                if alt is b:
                    continue
                t = span([*buckets[:i], alt, *buckets[i + 1 :]], ready)
                pays = t < current and current - t >= min_gain * bucket_seconds(b)
                if pays and (best is None or t < best[0]):
                    best = (t, alt)
            if best is not None:
                current, buckets[i] = best
                changed = True
    return buckets
