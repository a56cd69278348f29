"""Sync-layer pieces without a process group: scheme specs, config errors, fusion, the planner,
the task manager's ordering, and the step-program driver."""

import threading
import time

import pytest
import torch

from gradsync.codecs import ErrorFeedback
from gradsync.collectives.cost import CodecCost, CostModel, CostParams, Linear, Link
from gradsync.collectives.program import ProgramError, chain, last, run
from gradsync.planner.decide import make_plan
from gradsync.planner.plan import Plan
from gradsync.sync import Scheme, SyncConfig, TaskError, TaskManager
from gradsync.sync.buckets import Bucket, Slot, build_groups


# ------------------------------------------------------------------------------------- schemes
@pytest.mark.parametrize(
    ("text", "kind", "algorithm", "comm", "strategy", "local", "codec"),
    [
        ("none", "dense", "flat", None, None, None, None),
        ("torus2d/fp16", "dense", "torus2d", "fp16", None, None, None),
        ("hierarchical", "dense", "hierarchical", None, None, None, None),
        ("fp16", "dense", "hybrid", "fp16", None, None, None),
        ("hitopk:density=0.01", "compressed", "flat", None, "allgather", True, "mstopk:density=0.01"),
        ("hitopk/dgc:density=0.001", "compressed", "flat", None, "allgather", True, "dgc:density=0.001"),
        ("ps+local/onebit", "compressed", "flat", None, "ps", True, "onebit"),
        ("ring/terngrad", "compressed", "flat", None, "ring", False, "terngrad"),
        ("topk:density=0.1+ef", "compressed", "flat", None, None, None, "topk:density=0.1+ef"),
        ("auto", "compressed", "flat", None, None, None, "mstopk:density=0.01"),
    ],
)
def test_scheme_specs_parse(text, kind, algorithm, comm, strategy, local, codec):
    s = Scheme.parse(text)
    assert (s.kind, s.algorithm, s.comm_dtype, s.strategy, s.local, s.codec) == (
        kind, algorithm, comm, strategy, local, codec,
    )  # fmt: skip


def test_codec_shortcuts_resolve_by_codec_and_topology():
    assert Scheme.parse("topk").resolve(2, 2).name == "allgather+local/topk"
    assert Scheme.parse("topk").resolve(1, 4).name == "allgather/topk"
    assert Scheme.parse("onebit").resolve(2, 2).name == "ps+local/onebit"
    assert Scheme.parse("onebit").resolve(4, 1).name == "ps/onebit"
    assert Scheme.parse("powersgd:rank=2").resolve(2, 2).local is True
    assert Scheme.parse("ring/onebit").resolve(2, 2).name == "ring/onebit"  # explicit stays


def test_error_feedback_is_added_to_biased_codecs_only():
    assert isinstance(Scheme.parse("topk").build(), ErrorFeedback)
    assert isinstance(Scheme.parse("onebit").build(), ErrorFeedback)
    assert isinstance(Scheme.parse("powersgd").build(), ErrorFeedback)
    assert not isinstance(Scheme.parse("terngrad").build(), ErrorFeedback)  # unbiased
    assert not isinstance(Scheme.parse("randomk:unbiased=true").build(), ErrorFeedback)
    assert not isinstance(Scheme.parse("topk").build(error_feedback=False), ErrorFeedback)
    assert isinstance(Scheme.parse("terngrad").build(error_feedback=True), ErrorFeedback)
    ef = Scheme.parse("dgc+ef:momentum=0.9").build(error_feedback=False)  # explicit ef is kept
    assert isinstance(ef, ErrorFeedback) and ef.config.momentum == 0.9


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "scheme must be a non-empty string"),
        ("torus2d/fp8", "a dense algorithm takes /fp16 or /bf16"),
        (
            "butterfly/topk",
            "expected STRATEGY\\[\\+local\\]/CODEC with STRATEGY one of allgather, ring, ps, hitopk",
        ),
        ("ring+global/topk", "expected STRATEGY"),
        ("ring/", "a compressed scheme needs /CODEC"),
        ("hitopk/onebit", "hitopk needs a sparsifying codec"),
        ("nosuchcodec", "unknown codec 'nosuchcodec'; available codecs:"),
        ("topk:density=2", "topk: density must be in \\(0, 1\\]"),
        ("auto:candidates=", "expected auto:candidates=A,B,... with compressed schemes"),
        ("auto:choices=topk", "expected auto:candidates=A,B"),
        ("auto:candidates=topk|hierarchical", "candidate 'hierarchical' is not a compressed scheme"),
        ("auto:candidates=topk|topk", "a candidate is listed twice"),
        ("auto:candidates=topk|nosuchcodec", "unknown codec 'nosuchcodec'"),
        ("auto:candidates=topk:density=0.01,ring/onebit:seed=1", "onebit: unknown option 'seed'"),
    ],
)
def test_bad_schemes_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        Scheme.parse(text)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"plan": "sometimes"}, "sync: plan must be one of auto, compress, dense; got 'sometimes'"),
        ({"partitions": -1}, "sync: partitions must be in \\[0, 64\\]"),
        ({"bucket_bytes": 0}, "sync: bucket_bytes must be in \\[1, inf\\)"),
        ({"bucket_timeout_ms": -1.0}, "sync: bucket_timeout_ms must be in \\[0, inf\\)"),
        ({"dense_warmup_steps": 0}, "sync: dense_warmup_steps must be in \\[1, inf\\)"),
        ({"dense_algorithm": "ring"}, "sync: dense_algorithm must be one of auto, flat, hierarchical"),
        ({"timeout_s": 0}, "sync: timeout_s must be in \\(0, inf\\)"),
        ({"scheme": "ring/"}, "a compressed scheme needs /CODEC"),
        ({"large_codec": "topk:k=0"}, "topk: k must be in \\[1, inf\\)"),
        ({"bucket_size": 3}, "sync: unknown option 'bucket_size'; allowed options: scheme, plan"),
        ({"overlap": "maybe"}, "sync: overlap must be true or false"),
    ],
)
def test_bad_sync_options_name_the_field(options, message):
    with pytest.raises(ValueError, match=message):
        SyncConfig.from_options(options)


# -------------------------------------------------------------------------------------- fusion
def _slots(sizes, dtype=torch.float32):
    return [Slot(i, f"p{i}", torch.nn.Parameter(torch.zeros(n, dtype=dtype))) for i, n in enumerate(sizes)]


def test_fusion_closes_buckets_by_size_and_by_ready_time():
    slots = _slots([100, 100, 100, 100, 100])
    order = [4, 3, 2, 1, 0]
    # by size alone: 800 bytes per bucket = two tensors of 400 bytes
    groups = build_groups(slots, order, None, [0] * 5, 800, 0.0)
    assert [g for g, _ in groups] == [[4, 3], [2, 1], [0]]
    # a gap of 10 ms before tensor 1 closes the bucket early (timeout 5 ms)
    ready = [0.0120, 0.0110, 0.0011, 0.0010, 0.0]
    groups = build_groups(slots, order, ready, [0] * 5, 10_000, 0.005)
    assert [g for g, _ in groups] == [[4, 3, 2], [1, 0]]


def test_fusion_keeps_classes_and_dtypes_apart_and_orders_by_completion():
    slots = _slots([10, 100, 10, 100])
    slots.append(Slot(4, "half", torch.nn.Parameter(torch.zeros(100, dtype=torch.float16))))
    classes = [-1, 0, -1, 0, 0]
    groups = build_groups(slots, [3, 2, 4, 1, 0], None, classes, 10_000, 0.0)
    # every group is one class and one dtype; launch order follows each bucket's last member
    assert sorted(sorted(g) for g, _ in groups) == [[0, 2], [1, 3], [4]]
    assert next(g for g, _ in groups) == [4]  # complete first (its only member is third in order)
    for members, cls in groups:
        assert {classes[i] for i in members} == {cls}


def test_bucket_packs_any_layout_and_unpacks_into_missing_gradients():
    a = torch.nn.Parameter(torch.zeros(3, 4))
    b = torch.nn.Parameter(torch.zeros(5))
    a.grad = torch.arange(12.0).view(4, 3).t()  # non-contiguous
    bucket = Bucket(0, [Slot(0, "a", a), Slot(1, "b", b)], "a..b")
    bucket.pack()
    assert torch.equal(bucket.flat[:12], a.grad.reshape(-1)) and torch.equal(bucket.flat[12:], torch.zeros(5))
    bucket.flat.mul_(2)
    bucket.unpack()
    assert torch.equal(a.grad, 2 * torch.arange(12.0).view(4, 3).t()) and torch.equal(b.grad, torch.zeros(5))


def test_candidates_parse_with_commas_or_bars_and_keep_their_own_strategies():
    s = Scheme.parse("auto:candidates=hitopk:density=0.01,powersgd:rank=1")
    assert (s.kind, s.strategy, s.local, s.codec) == ("compressed", "allgather", True, "mstopk:density=0.01")
    assert s.candidates == ("powersgd:rank=1",)
    # a comma piece KEY=VALUE continues the candidate before it; | always separates
    t = Scheme.parse("auto:candidates=topk:density=0.01,compile=false,ring/powersgd:rank=2|ps/onebit")
    assert t.codec == "topk:density=0.01,compile=false"
    assert t.candidates == ("ring/powersgd:rank=2", "ps/onebit")
    alts = t.resolve(2, 2).alternatives(2, 2)
    assert [a.name for a in alts[:2]] == ["ring/powersgd:rank=2", "ps/onebit"]
    # auto adds every other strategy of each candidate's codec, once per route (PowerSGD's rounds
    # are the same under any strategy: only its local aggregation varies)
    topk = "topk:density=0.01,compile=false"
    assert [a.name for a in alts[2:]] == [
        f"allgather/{topk}", f"ring/{topk}", f"ring+local/{topk}", f"ps/{topk}", f"ps+local/{topk}",
        "allgather+local/powersgd:rank=2",
        "allgather/onebit", "allgather+local/onebit", "ring/onebit", "ring+local/onebit", "ps+local/onebit",
    ]  # fmt: skip
    assert Scheme.parse("hitopk:density=0.01").alternatives(2, 2) == []  # not auto: nothing added
    one_per_node = [a.name for a in Scheme.parse("auto").resolve(4, 1).alternatives(4, 1)]
    # plain auto also weighs PowerSGD at rank 4 (AUTO_CODECS), with and without local aggregation
    assert one_per_node == ["allgather/powersgd:rank=4", "ring/mstopk:density=0.01", "ps/mstopk:density=0.01"]
    two_by_two = {a.name for a in Scheme.parse("auto").resolve(2, 2).alternatives(2, 2)}
    assert {"allgather/powersgd:rank=4", "allgather+local/powersgd:rank=4"} <= two_by_two
    # a list of one candidate is that codec alone, on every strategy (no default codec added)
    one = Scheme.parse("auto:candidates=topk:density=0.01").resolve(2, 1)
    only = [a.name for a in one.alternatives(2, 1)]
    assert only == ["ring/topk:density=0.01", "ps/topk:density=0.01"]
    # the canonical name parses back to the same scheme (it is what checkpoints record)
    r = t.resolve(2, 2)
    assert Scheme.parse(r.name).resolve(2, 2).name == r.name
    assert SyncConfig(scheme="auto:candidates=topk|onebit").scheme.startswith("auto:")


# ------------------------------------------------------------------------------------- planner
def _model(intra_bw, inter_bw, alpha=1e-4):
    return CostModel(CostParams(Link(alpha, 1 / intra_bw), Link(alpha, 1 / inter_bw), 1e-10), 2, 2)


def _codec(density=0.01, enc_per_byte=1e-9):
    return CodecCost(Linear(1e-4, enc_per_byte), Linear(1e-4, enc_per_byte / 2), Linear(64, density * 2))


def test_planner_compresses_big_buckets_on_a_slow_network_and_declines_on_a_fast_one():
    scheme = Scheme.parse("hitopk:density=0.01")
    groups = [([0], -1), ([1], 0), ([2], 0)]
    nbytes = [1024, 64 << 10, 64 << 20]
    slow = make_plan(groups, nbytes, scheme, _model(1e9, 12.5e6), {0: _codec()}, "auto", "auto", 0)
    assert [b.compress for b in slow.buckets] == [False, True, True]
    assert slow.buckets[0].dense_algorithm in ("flat", "hierarchical", "torus2d")
    # a network faster than the codec: compressing cannot pay
    fast = make_plan(
        groups, nbytes, scheme, _model(1e11, 1e11), {0: _codec(enc_per_byte=1e-8)}, "auto", "auto", 0
    )
    assert [b.compress for b in fast.buckets] == [False, False, False]
    forced = make_plan(groups, nbytes, scheme, _model(1e11, 1e11), {0: _codec()}, "compress", "auto", 2)
    assert [b.compress for b in forced.buckets] == [False, True, True]
    assert forced.buckets[2].partitions == 2
    never = make_plan(groups, nbytes, scheme, _model(1e9, 12.5e6), {0: _codec()}, "dense", "torus2d", 0)
    assert [(b.compress, b.dense_algorithm) for b in never.buckets] == [(False, "torus2d")] * 3


def test_planner_never_cuts_a_low_rank_bucket_in_parts():
    """PowerSGD factors whole tensors: a bucket in two parts would reduce every tensor twice, so
    even a fixed ``partitions=2`` leaves a low-rank bucket in one part (other codecs take it)."""
    from dataclasses import replace

    scheme = Scheme.parse("powersgd:rank=2")
    groups = [([0], 0), ([1], 0)]
    nbytes = [64 << 10, 64 << 20]
    lowrank = replace(_codec(), lowrank=True)
    plan = make_plan(groups, nbytes, scheme, _model(1e11, 1e11), {0: lowrank}, "compress", "auto", 2)
    assert [(b.compress, b.partitions) for b in plan.buckets] == [(True, 1), (True, 1)]
    topk = make_plan(groups, nbytes, Scheme.parse("hitopk:density=0.01"), _model(1e11, 1e11), {0: _codec()},
                     "compress", "auto", 2)  # fmt: skip
    assert [b.partitions for b in topk.buckets] == [2, 2]


def test_planner_picks_the_cheapest_candidate_per_bucket_and_skips_refused_ones():
    """Two codecs on a 100 Mbit/s network: codec 0 costs 1 ms per call plus 2 ns a byte, codec 1
    20 ms per call and nothing per byte (payloads 1 % for both). By hand: a 1 MiB bucket is
    3.1 ms against 20 ms (codec 0), a 64 MiB one 134 ms against 20 ms (codec 1); dense would take
    about 84 ms and 5.4 s."""
    flat = Scheme.parse("allgather/topk")
    schemes = [flat, flat]
    costs = {
        0: CodecCost(Linear(1e-3, 2e-9), Linear(0.0, 0.0), Linear(0.0, 0.01)),
        1: CodecCost(Linear(20e-3, 0.0), Linear(0.0, 0.0), Linear(0.0, 0.01)),
    }
    model = CostModel(CostParams(Link(0.0, 1e-10), Link(0.0, 8 / 100e6), 0.0), 2, 1)
    groups = [([0], 0), ([1], 0), ([2], -1)]
    nbytes = [1 << 20, 64 << 20, 1024]
    plan = make_plan(groups, nbytes, flat, model, costs, "auto", "auto", 1, schemes=schemes, candidates=[1])
    assert [(b.compress, b.codec_id) for b in plan.buckets] == [(True, 0), (True, 1), (False, -1)]
    by_hand_ms = 20.0 + 64 * 2**20 * 0.01 * 8 / 100e6 * 1e3
    assert plan.buckets[1].compressed_ms == pytest.approx(by_hand_ms, rel=1e-6)
    # without the candidate the big bucket takes codec 0
    alone = make_plan(groups, nbytes, flat, model, costs, "auto", "auto", 1)
    assert [b.codec_id for b in alone.buckets][:2] == [0, 0]
    # a candidate its sizes refuse is skipped; when every candidate refuses, the bucket is dense
    only0 = make_plan(
        groups, nbytes, flat, model, costs, "auto", "auto", 1, schemes=schemes, candidates=[1],
        rejects=lambda cid, slots, parts: "too small" if cid == 1 else None,
    )  # fmt: skip
    assert [(b.compress, b.codec_id) for b in only0.buckets][:2] == [(True, 0), (True, 0)]
    none = make_plan(
        groups, nbytes, flat, model, costs, "auto", "auto", 1, schemes=schemes, candidates=[1],
        rejects=lambda cid, slots, parts: "too small",
    )  # fmt: skip
    assert [(b.compress, b.dense_reason) for b in none.buckets][:2] == [(False, "codec"), (False, "codec")]


def test_planner_fuses_neighbouring_dense_buckets_again():
    scheme = Scheme.parse("hitopk:density=0.01")
    # launch order: small (never compressed), a mid tensor, small, a big one, small, small
    groups = [([0], -1), ([1], 0), ([2], -1), ([3], 0), ([4], -1), ([5], -1)]
    nbytes = [1024, 256 << 10, 1024, 64 << 20, 2048, 4096]
    kinds = ["f32"] * 5 + ["f16"]
    plan = make_plan(groups, nbytes, scheme, _model(1e9, 1e9), {0: _codec(enc_per_byte=1e-8)}, "auto",
                     "auto", 0, fuse_bytes=32 << 20, kinds=kinds)  # fmt: skip
    # a fast network: nothing is compressed; dense neighbours fuse up to 32 MiB and never across
    # dtypes, the 64 MiB tensor stays alone
    assert [(b.slots, b.compress) for b in plan.buckets] == [
        ([0, 1, 2], False),
        ([3], False),
        ([4], False),
        ([5], False),
    ]
    fused = plan.buckets[0]
    assert fused.dense_ms == pytest.approx(
        1e3 * min(getattr(_model(1e9, 1e9), a)(sum(nbytes[:3])) for a in ("flat", "hierarchical", "torus2d"))
    )
    # a dense scheme: every bucket is dense, so all of one dtype fuse by size alone (DDP-like)
    dense = make_plan(groups, nbytes, Scheme.parse("hierarchical"), _model(1e9, 1e9), {}, "auto", "auto", 0,
                      fuse_bytes=128 << 20, kinds=kinds)  # fmt: skip
    assert [b.slots for b in dense.buckets] == [[0, 1, 2, 3, 4], [5]]
    assert {b.dense_algorithm for b in dense.buckets} == {"hierarchical"}
    # a slow network: the compressed buckets split the dense ones apart, and the small dense
    # buckets between them, whose predicted time is mostly start-up, join the next dense bucket
    # of their dtype (one set of collectives instead of three); the f16 one stays apart
    slow = make_plan(groups, nbytes, scheme, _model(1e9, 12.5e6), {0: _codec()}, "auto", "auto", 0,
                     fuse_bytes=32 << 20, kinds=kinds)  # fmt: skip
    assert [(b.slots, b.compress) for b in slow.buckets] == [
        ([1], True),
        ([3], True),
        ([0, 2, 4], False),
        ([5], False),
    ]
    # a dense bucket whose transfer outweighs its start-up keeps its place (it overlaps the
    # backward pass there; 64 kB at 12.5 MB/s against 0.1 ms start-ups), and the small one
    # before it joins it
    big = [1024, 256 << 10, 64 << 10, 64 << 20, 2048, 4096]
    kept = make_plan(groups, big, scheme, _model(1e9, 12.5e6), {0: _codec()}, "auto", "auto", 0,
                     fuse_bytes=32 << 20, kinds=kinds)  # fmt: skip
    assert [(b.slots, b.compress) for b in kept.buckets] == [
        ([1], True),
        ([0, 2], False),
        ([3], True),
        ([4], False),
        ([5], False),
    ]


def test_planner_merges_compressed_buckets_when_start_ups_outweigh_the_later_launch():
    """Two 1 MiB top-k buckets (1 % payload, nothing to encode) on 4 x 1 ranks at 100 Mbit/s,
    a small dense bucket between them. A compressed bucket of S bytes is one fixed-slot
    all-gather: ``c(S) = alpha log2(4) + 3 * 0.01 S * beta``. By hand, with the ready times 0, 1
    and 2 ms and the buckets taken one after another:

    - alpha 5 ms: apart 2 c(S) + d = 25 ms + d; merged (dense first, then 2 MiB at 2 ms) about
      2 ms + d + c(2S) = 17 ms + d: merged;
    - alpha 0 and the second bucket ready at 50 ms: apart 50 ms + c(S) = 52.5 ms, merged
      50 ms + c(2S) = 55 ms: kept apart."""
    scheme = Scheme.parse("allgather/topk")
    codec = CodecCost(Linear(0.0, 0.0), Linear(0.0, 0.0), Linear(0.0, 0.01))
    beta = 8 / 100e6
    groups = [([0], 0), ([1], -1), ([2], 0)]
    mib = 1 << 20
    nbytes = [mib, 1024, mib]

    def plan(alpha, ready, fuse=64 << 20, kinds=None):
        model = CostModel(CostParams(Link(0.0, 1e-10), Link(alpha, beta), 0.0), 4, 1)
        return make_plan(groups, nbytes, scheme, model, {0: codec}, "auto", "auto", 1, fuse_bytes=fuse,
                         kinds=kinds, ready=ready)  # fmt: skip

    def c(size, alpha):
        return alpha * 2 + 3 * 0.01 * size * beta

    merged = plan(5e-3, [0.0, 1e-3, 2e-3])
    assert [(b.slots, b.compress) for b in merged.buckets] == [([1], False), ([0, 2], True)]
    assert merged.buckets[1].compressed_ms == pytest.approx(c(2 * mib, 5e-3) * 1e3)
    d = merged.buckets[0].dense_ms / 1e3
    apart_s, merged_s = 2 * c(mib, 5e-3) + d, max(1e-3 + d, 2e-3) + c(2 * mib, 5e-3)
    assert merged_s < apart_s
    # the span the re-cut minimizes, written out, for both plans
    from gradsync.planner.recut import span

    assert span(merged.buckets, [0.0, 1e-3, 2e-3]) == pytest.approx(merged_s)
    apart = plan(5e-3, None)  # no ready times: no re-cut
    assert [b.slots for b in apart.buckets] == [[0], [1], [2]]
    assert span(apart.buckets, [0.0, 1e-3, 2e-3]) == pytest.approx(apart_s)
    # no start-up to save and a late second bucket: merging would only delay the first
    late = plan(0.0, [0.0, 1e-3, 50e-3])
    assert [b.slots for b in late.buckets] == [[0], [1], [2]]
    assert 50e-3 + c(mib, 0.0) < 50e-3 + c(2 * mib, 0.0)
    # never across dtypes or devices, never past the fusion size
    soon = [0.0, 1e-3, 2e-3]
    assert [b.slots for b in plan(5e-3, soon, kinds=["f32", "f32", "f16"]).buckets] == [[0], [1], [2]]
    assert [b.slots for b in plan(5e-3, soon, fuse=mib + 1024).buckets] == [[0], [1], [2]]
    # many buckets, each merge a small share of the whole span: 40 buckets of 64 kB ready 1 ms
    # apart, each 10 ms of start-up and 0.16 ms of transfer, take about 406 ms one after
    # another; merged, one bucket launched at 39 ms takes 10 ms + 40 x 0.16 ms
    many = [([i], 0) for i in range(40)]
    model = CostModel(CostParams(Link(0.0, 1e-10), Link(5e-3, beta), 0.0), 4, 1)
    sizes = [64 << 10] * 40
    one = make_plan(many, sizes, scheme, model, {0: codec}, "auto", "auto", 1, fuse_bytes=64 << 20,
                    ready=[i * 1e-3 for i in range(40)])  # fmt: skip
    assert [b.slots for b in one.buckets] == [list(range(40))]
    by_hand = 39e-3 + c(40 * (64 << 10), 5e-3)
    assert span(one.buckets, [i * 1e-3 for i in range(40)]) == pytest.approx(by_hand)
    assert by_hand < 40 * c(64 << 10, 5e-3)


def test_the_re_cuts_span_follows_the_engines_two_threads():
    """span() by hand (and a PowerSGD case below): bucket A ready at 0 and B at 1 ms, each one part of
    (encode 4, communicate 10, decode 1) ms, a dense bucket D of 3 ms ready at 2 ms between them. Compute
    thread: A's encode 0-4, B's encode 4-8 (its bucket launches after D's, at 2 ms), A's decode 14-15;
    communication thread: A 4-14, D 14-17, B 17-27; B's decode 27-28. One after another (no overlap) it
    would be 15 + 3 + 15 = 33 ms. With two parts each of half the stages, A's second part is encoded 2-4
    while its first communicates 2-7."""
    from gradsync.planner.plan import BucketPlan
    from gradsync.planner.recut import span

    a = BucketPlan([0], 0, True, 1, compressed_ms=15.0, stages_ms=(4.0, 10.0, 1.0))
    d = BucketPlan([1], -1, False, 1, dense_ms=3.0)
    b = BucketPlan([2], 0, True, 1, compressed_ms=15.0, stages_ms=(4.0, 10.0, 1.0))
    assert span([a, d, b], [0.0, 2e-3, 1e-3]) == pytest.approx(28e-3)
    # without stages (a plan from an older state): one communication each, 15 + 3 + 15
    plain = [BucketPlan(x.slots, x.codec_id, x.compress, 1, dense_ms=x.dense_ms,
                        compressed_ms=x.compressed_ms) for x in (a, d, b)]  # fmt: skip
    assert span(plain, [0.0, 2e-3, 1e-3]) == pytest.approx(33e-3)
    # two parts of (2, 5, 0.5): A enc 0-2, 2-4; comm 2-7, 7-12; decodes 7-7.5, 12-12.5; D 12-15;
    # B (launched at 2 ms) enc 4-6, 6-8 (the compute thread is free before A's first decode);
    # comm 15-20, 20-25; decodes 20-20.5, 25-25.5
    halves = [BucketPlan(x.slots, x.codec_id, True, 2, stages_ms=(2.0, 5.0, 0.5)) for x in (a, b)]
    assert span([halves[0], d, halves[1]], [0.0, 2e-3, 1e-3]) == pytest.approx(25.5e-3)
    # a PowerSGD bucket X (project P 2, all-reduce 3, project Q 2, all-reduce 3, decode 1) ahead of
    # a top-k bucket Y (4, 5, 1), both ready at 0: X's P 0-2; its all-reduce 2-5 while Y encodes
    # 2-6; X's Q waits for the compute thread, 6-8, and the communication thread waits for it (Y's
    # transfer may not pass X's second all-reduce); X's all-reduce 8-11, its decode 11-12 beside
    # Y's transfer 11-16; Y's decode 16-17
    x = BucketPlan([0], 1, True, 1, compressed_ms=11.0, stages_ms=(2.0, 3.0, 2.0, 3.0, 1.0))
    y = BucketPlan([1], 0, True, 1, compressed_ms=10.0, stages_ms=(4.0, 5.0, 1.0))
    assert span([x, y], [0.0, 0.0]) == pytest.approx(17e-3)


def test_the_re_cut_merges_buckets_whose_candidates_differ():
    """auto with a candidate: a 64 kB bucket picks the class codec (no fixed cost, 1 % payload),
    a 4 MiB bucket ready 1 ms later the candidate (3 ms to encode, 0.1 % payload), on 4 x 1 at
    100 Mbit/s with 5 ms start-ups. By hand: apart the second waits for the first,
    ``c0(64 kB) + c1(4 MiB)`` = 24.2 ms; merged, one bucket at 1 ms, ``1 ms + c1(4.06 MiB)`` =
    15.0 ms: merged, and the merged bucket decided afresh takes the candidate."""
    scheme = Scheme.parse("allgather/topk")
    beta, alpha = 8 / 100e6, 5e-3
    plain = CodecCost(Linear(0.0, 0.0), Linear(0.0, 0.0), Linear(0.0, 0.01))
    heavy = CodecCost(Linear(3e-3, 0.0), Linear(0.0, 0.0), Linear(0.0, 0.001))
    model = CostModel(CostParams(Link(0.0, 1e-10), Link(alpha, beta), 0.0), 4, 1)
    small, large = 64 << 10, 4 << 20
    groups = [([0], 0), ([1], 0)]

    def c0(size):
        return 2 * alpha + 3 * 0.01 * size * beta

    def c1(size):
        return 3e-3 + 2 * alpha + 3 * 0.001 * size * beta

    def plan(ready):
        costs = {0: plain, 1: heavy}
        return make_plan(
            groups, [small, large], scheme, model, costs, "compress", "auto", 1,
            fuse_bytes=64 << 20, ready=ready, schemes=[scheme, scheme], candidates=[1],
        )  # fmt: skip

    apart = plan(None)  # no ready times: no re-cut; each bucket its cheapest codec
    assert [(b.slots, b.codec_id) for b in apart.buckets] == [([0], 0), ([1], 1)]
    assert c0(small) < c1(small) and c1(large) < c0(large)
    merged = plan([0.0, 1e-3])
    assert [(b.slots, b.codec_id) for b in merged.buckets] == [([0, 1], 1)]
    assert merged.buckets[0].compressed_ms == pytest.approx(c1(small + large) * 1e3)
    assert 1e-3 + c1(small + large) < c0(small) + c1(large)


def test_each_bucket_takes_the_candidate_that_shortens_the_step():
    """rechoose_candidates by hand: buckets X and Y ready at 0, each with option A (the
    communication thread held 10 ms, nothing else: PowerSGD with local aggregation) or B (encode
    6, communicate 5, decode 1 ms: a sparsifier). A is cheaper per bucket (10 < 12), so the
    per-bucket choice is A, A: the communication thread 0-10, 10-20, span 20 ms. B, B: encodes
    0-6 and 6-12, transfers 6-11 and 12-17, decodes 12-13 and 17-18: 18 ms. A, B: X holds the
    thread 0-10 while Y encodes 0-6; Y's transfer 10-15, decode 15-16: 16 ms. B, A: Y's hold
    waits for X's transfer, 11-21. The planner starts from B, B (shorter than A, A) and swaps X to
    A (2 ms saved, more than a tenth of X's 12); asking a fifth (2.4 ms), it keeps B, B."""
    from gradsync.planner.plan import BucketPlan
    from gradsync.planner.recut import rechoose_candidates, span

    def a(slot):
        return BucketPlan([slot], 1, True, 1, compressed_ms=10.0, stages_ms=(0.0, 10.0, 0.0))

    def b(slot):
        return BucketPlan([slot], 0, True, 1, compressed_ms=12.0, stages_ms=(6.0, 5.0, 1.0))

    def alternatives(x):
        return [b(x.slots[0]) if x.codec_id == 1 else a(x.slots[0])]

    ready = [0.0, 0.0]
    for plan, by_hand in (((a, a), 20e-3), ((b, b), 18e-3), ((a, b), 16e-3), ((b, a), 21e-3)):
        assert span([plan[0](0), plan[1](1)], ready) == pytest.approx(by_hand)
    chosen = rechoose_candidates([a(0), a(1)], ready, alternatives)
    assert [x.codec_id for x in chosen] == [1, 0]
    strict = rechoose_candidates([a(0), a(1)], ready, alternatives, min_gain=0.2)
    assert [x.codec_id for x in strict] == [0, 0]
    # an alternative that is not compressed (the codec refused the bucket) is never taken
    dense = [BucketPlan([0], 0, False, 1, dense_ms=1.0)]
    refused = rechoose_candidates([a(0), a(1)], ready, lambda x: dense)
    assert [x.codec_id for x in refused] == [1, 1]


def test_plans_compare_by_their_step_in_the_engines_order_of_work():
    """plan_seconds with ready times is the span the planner minimizes, by hand: two top-k buckets
    ready at 0, each encode e, transfer c, decode d (c >= e, d <= c): Y's encode e-2e, X's transfer
    e-(e+c), Y's transfer (e+c)-(e+2c), its decode to e+2c+d. Summed, 2(e+c+d)."""
    from gradsync.planner.closed_loop import plan_seconds
    from gradsync.planner.decide import stage_times

    scheme = Scheme.parse("allgather/topk")
    codec = CodecCost(Linear(1e-3, 1e-9), Linear(2e-4, 1e-10), Linear(0.0, 0.01))
    model = CostModel(CostParams(Link(0.0, 1e-10), Link(5e-3, 8 / 100e6), 0.0), 4, 1)
    size = 4 << 20
    plan = make_plan([([0], 0), ([1], 0)], [size, size], scheme, model, {0: codec}, "compress", "auto", 1)
    e, c, d = stage_times(scheme, model, size, codec)
    assert c >= e and d <= c
    args = ([size, size], scheme, model, {0: codec})
    assert plan_seconds(plan, *args) == pytest.approx(2 * (e + c + d))
    assert plan_seconds(plan, *args, ready=[0.0, 0.0]) == pytest.approx(e + 2 * c + d)


def test_plan_round_trips_through_a_tensor_and_a_state():
    scheme = Scheme.parse("hitopk:density=0.01")
    plan = make_plan([([2, 0], 0), ([1], -1)], [4096, 4, 4096], scheme, _model(1e9, 12.5e6),
                     {0: _codec()}, "compress", "auto", 4)  # fmt: skip
    again = Plan.from_tensor(plan.to_tensor())
    assert [(b.slots, b.codec_id, b.compress, b.partitions, b.dense_algorithm) for b in again.buckets] == [
        (b.slots, b.codec_id, b.compress, b.partitions, b.dense_algorithm) for b in plan.buckets
    ]
    assert Plan.from_state(plan.to_state()).buckets == plan.buckets
    table = plan.table(["w", "b", "v"], [4096, 4, 4096], scheme, ["mstopk:density=0.01+ef"])
    assert "dense" in table and "mstopk" in table and "v .. w" in table


# ------------------------------------------------------------------------------- task manager
def _recording_program(log, name, steps, compute_s=0.0, lock=None):
    for i in range(steps):
        time.sleep(compute_s)  # local work
        got = yield lambda i=i: log.append((name, i)) or f"{name}{i}"
        assert got == f"{name}{i}"
    return lambda: log.append((name, "finish"))


def test_task_manager_issues_steps_in_submission_order_and_runs_finishers():
    log = []
    tm = TaskManager("t")
    tasks = [tm.submit(_recording_program(log, n, 3, compute_s=0.002), n) for n in "abc"]
    tm.wait(tasks, timeout=10)
    steps = [e for e in log if e[1] != "finish"]
    assert steps == [(n, i) for n in "abc" for i in range(3)]
    assert all((n, "finish") in log for n in "abc")
    assert all(t.done and t.steps == 3 and t.comm_s >= 0 for t in tasks)
    tm.close()


def test_task_manager_overlaps_one_tasks_compute_with_anothers_communication():
    """While task a's (slow) communication step runs, task b's compute runs."""
    events = []
    in_comm = threading.Event()

    def slow_comm():
        yield lambda: (in_comm.set(), time.sleep(0.2), events.append(("a-comm-end", time.perf_counter())))
        return None

    def compute_then_comm():
        in_comm.wait(5)
        events.append(("b-compute", time.perf_counter()))
        yield lambda: events.append(("b-comm", time.perf_counter()))
        return None

    tm = TaskManager("t")
    tasks = [tm.submit(slow_comm(), "a"), tm.submit(compute_then_comm(), "b")]
    tm.wait(tasks, timeout=10)
    t = dict(events)
    assert t["b-compute"] < t["a-comm-end"] < t["b-comm"]  # overlap, then strict comm order
    tm.close()


def test_task_manager_failure_fails_later_tasks_and_every_call_after():
    def broken():
        yield lambda: 1 / 0
        return None

    errors = []
    tm = TaskManager("t")
    tasks = [tm.submit(broken(), "a"), tm.submit(_recording_program([], "b", 2), "b", on_error=errors.append)]
    with pytest.raises(TaskError, match="ZeroDivisionError"):
        tm.wait(tasks, timeout=10)
    assert isinstance(errors[0], ZeroDivisionError)
    with pytest.raises(TaskError):
        tm.submit(_recording_program([], "c", 1), "c")
    tm.close()


def test_a_last_step_hands_the_network_to_the_next_task_while_the_compute_thread_is_busy():
    """a's last step ends while c's long encode holds the compute thread: b's step must not wait
    for that encode (without the mark it did: a's program had to resume on the compute thread
    before the communication thread knew a was done)."""
    events = []
    stamp = threading.Lock()

    def note(what):
        with stamp:
            events.append((what, time.perf_counter()))

    def a():
        got = yield last(lambda: (time.sleep(0.1), note("a-comm-end"))[1] or "a")
        assert got == "a"
        return lambda: note("a-finish")

    def b():
        yield last(lambda: note("b-comm"))
        return None

    def c():  # a long local step, queued after a's and b's first ones
        time.sleep(0.6)
        note("c-encode-end")
        yield lambda: note("c-comm")
        return None

    tm = TaskManager("t")
    tasks = [tm.submit(a(), "a"), tm.submit(b(), "b"), tm.submit(c(), "c")]
    tm.wait(tasks, timeout=10)
    t = dict(events)
    assert t["a-comm-end"] < t["b-comm"] < t["c-encode-end"] - 0.2, events
    assert t["c-encode-end"] < t["a-finish"]  # the finisher still runs on the compute thread
    assert t["c-encode-end"] < t["c-comm"]
    assert all(task.done and task.comm_done_at is not None for task in tasks)
    tm.close()


def test_a_step_after_the_last_one_is_refused_by_both_drivers():
    def rogue():
        yield last(lambda: 1)
        yield lambda: 2
        return None

    with pytest.raises(ProgramError, match="after the one it marked as its last"):
        run(rogue())
    tm = TaskManager("t")
    tasks = [tm.submit(rogue(), "rogue"), tm.submit(_recording_program([], "b", 1), "b")]
    with pytest.raises(TaskError, match="after the one it marked as its last"):
        tm.wait(tasks, timeout=10)
    with pytest.raises(TaskError):  # the order of collectives is lost: the manager stays failed
        tm.submit(_recording_program([], "c", 1), "c")
    tm.close()
    assert last(len, final=False) is len  # unmarked when something follows


def test_program_driver_runs_steps_then_the_finisher():
    log = []
    run(_recording_program(log, "x", 2))
    assert log == [("x", 0), ("x", 1), ("x", "finish")]
    assert chain(None, None) is None
    out = []
    chain(lambda: out.append(1), None, lambda: out.append(2))()
    assert out == [1, 2]
