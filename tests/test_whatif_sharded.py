"""whatif's FSDP2, HSDP and replicate contenders against step formulas written out here."""

from dataclasses import replace

import pytest

from gradsync.collectives.cost import CodecCost, CostParams, Linear, Link
from gradsync.whatif.codec_costs import CodecTable
from gradsync.whatif.network import Network
from gradsync.whatif.predict import Point, predict_point
from gradsync.whatif.sharded import shard_units, sharded_contender, sharded_step, unit_of
from gradsync.whatif.simulate import Cpu
from gradsync.whatif.workload import Tensor, Workload

MB = 1 << 20
FWD, BWD, OPT = 0.030, 0.060, 0.008


def lm_workload():
    """A root (embedding 2 MiB, ready last) and two blocks of 4 MiB, the second ready first."""
    ts = (
        Tensor("embed.weight", 2 * MB // 4, 4, True, 0.060),
        Tensor("blocks.0.w", 4 * MB // 4, 4, True, 0.045),
        Tensor("blocks.1.w", 4 * MB // 4, 4, True, 0.020),
        Tensor("frozen.weight", 1024, 4, True, None),
    )
    return Workload("lm", 8, ts, 0.0, FWD, BWD, OPT, "test")


def params(inter_beta, intra_beta=0.0, alpha=0.0, gamma=0.0):
    return CostParams(Link(0.0, intra_beta), Link(alpha, inter_beta), gamma)


def onebit_table():
    one = CodecCost(Linear(2e-3, 1e-9), Linear(5e-4, 0.0), Linear(8.0, 1 / 32))
    return CodecTable(entries={"onebit+ef": one})


def test_units_follow_numbered_containers():
    names = [
        "embed.weight",
        "blocks.0.attn.w",
        "blocks.0.mlp.b",
        "blocks.1.attn.w",
        "features.10.weight",
        "head.w",
    ]
    assert [unit_of(n) for n in names] == ["", "blocks.0", "blocks.0", "blocks.1", "features.10", ""]
    assert shard_units(names) == ["", "blocks.0", "blocks.1", "features.10"]


def test_fsdp_on_a_cpu_is_compute_plus_every_collective():
    """4 ranks on 2 nodes, serial (CPU, gloo): forward all-gathers of every unit, backward
    all-gathers of the two blocks (the root stays gathered), a reduce-scatter per unit (gloo's:
    a ring all-reduce), optimizer on 1/4."""
    beta, alpha, gamma = 1 / 1.25e8, 1e-4, 1e-10
    p = 4
    sizes = {"root": 2 * MB, "b0": 4 * MB, "b1": 4 * MB}

    def ring(s):  # a ring all-gather / reduce-scatter over the 4 ranks, limited by the cable
        return (p - 1) * alpha + (p - 1) / p * s * beta

    gathers = sum(ring(s) + 2 * gamma * s for s in sizes.values())
    back_gathers = sum(ring(s) + 2 * gamma * s for k, s in sizes.items() if k != "root")
    reduces = sum(
        2 * (p - 1) * alpha + 2 * (p - 1) / p * s * (beta + gamma / 2) + 2 * gamma * s for s in sizes.values()
    )
    want = FWD + BWD + OPT / p + gathers + back_gathers + reduces
    got = sharded_step(
        "fsdp", lm_workload(), params(beta, 0.0, alpha, gamma), 2, 2, onebit_table(), backend="gloo"
    )
    assert got.step_s == pytest.approx(want, rel=1e-9)
    cable = (p - 1) / p * (10 + 8 + 2 * 10) * MB  # forward gathers, backward gathers, all-reduces
    assert got.cable_bytes == pytest.approx(cable, rel=1e-9)


def test_hsdp_gathers_inside_the_node_and_all_reduces_the_shard_across():
    """2 x 2, serial: all-gathers and reduce-scatters on the node's links (2 ranks), then each
    rank's half-shard all-reduced over the 2 nodes, both ranks' rings sharing the cable:
    2 (m - 1) / m x S / n x n bytes at the cable's rate."""
    intra, inter = 1 / 1e9, 1 / 1.25e8
    w = lm_workload()
    s_all = 10 * MB
    in_node = (2 - 1) / 2  # a ring step of the node's 2 ranks
    gathers = in_node * s_all * intra + in_node * 8 * MB * intra  # forward all, backward the blocks
    reduces = 2 * in_node * s_all * intra  # gloo's reduce-scatter: an all-reduce
    across = sum(2 * (2 - 1) / 2 * (s / 2) * (inter * 2) for s in (2 * MB, 4 * MB, 4 * MB))
    want = FWD + BWD + OPT / 2 + gathers + reduces + across
    got = sharded_step("hsdp", w, params(inter, intra), 2, 2, onebit_table(), backend="gloo")
    assert got.step_s == pytest.approx(want, rel=1e-9)
    assert got.cable_bytes == pytest.approx(s_all, rel=1e-9)  # 2 (m-1)/m S = S across the 2 nodes


def test_compressed_hsdp_runs_the_codec_on_the_shard_across_nodes():
    """hsdp/onebit on 2 x 2: the reduced half-shard through onebit's strategy, CaSync-PS, over the
    2 nodes (the ranks' streams share the cable): 2 (N - 1) sends of a partition's payload, K + 1
    encodes and N + 1 decodes of a partition (the HiPress paper's Table 3), N = K = 2."""
    inter = 1 / 1.25e8
    w = lm_workload()
    dense = sharded_step("hsdp", w, params(inter), 2, 2, onebit_table(), backend="gloo")
    got = sharded_step("hsdp/onebit", w, params(inter), 2, 2, onebit_table(), backend="gloo")
    across_dense = sum(2 * (2 - 1) / 2 * (s / 2) * (inter * 2) for s in (2 * MB, 4 * MB, 4 * MB))
    coded = sum(
        2 * (8 + s / 4 / 32) * inter * 2 + 3 * (2e-3 + 1e-9 * s / 4) + 3 * 5e-4
        for s in (2 * MB, 4 * MB, 4 * MB)
    )  # each rank's shard is s / 2, a partition s / 4
    assert got.step_s == pytest.approx(dense.step_s - across_dense + coded, rel=1e-9)


def test_compressed_fsdp_is_an_all_to_all_of_encoded_shards():
    """fsdp/onebit on 2 x 1: each rank encodes its whole unit gradient, sends the other rank's
    half (one piece), decodes the one it got and sums; no reduce-scatter of dense bytes."""
    beta = 1 / 1.25e8
    w = lm_workload()
    dense = sharded_step("fsdp", w, params(beta), 2, 1, onebit_table(), backend="gloo")
    got = sharded_step("fsdp/onebit", w, params(beta), 2, 1, onebit_table(), backend="gloo")
    sizes = (2 * MB, 4 * MB, 4 * MB)
    dense_rs = sum(s * beta for s in sizes)  # gloo's reduce-scatter: an all-reduce, 2 (p - 1) / p S
    coded = sum(2e-3 + 1e-9 * s + (8 + s / 2 / 32) * beta + 5e-4 for s in sizes)
    assert got.step_s == pytest.approx(dense.step_s - dense_rs + coded, rel=1e-9)


def test_replicate_all_reduces_each_unit_and_keeps_the_optimizer_whole():
    beta = 1 / 1.25e8
    w = lm_workload()
    got = sharded_step("replicate", w, params(beta), 2, 1, onebit_table(), backend="gloo")
    assert got.step_s == pytest.approx(FWD + BWD + OPT + 10 * MB * beta, rel=1e-9)  # 2(p-1)/p S, p = 2


def test_nccl_overlaps_and_reduce_scatters_in_a_ring():
    """On GPUs (nccl) with no compute, the step is the channel's work: the ring all-gathers and
    ring reduce-scatters one after another, then the optimizer on the shard; with compute, the
    collectives hide behind it in part but the step never beats either."""
    beta = 1 / 1.25e9
    ts = tuple(replace(t, ready=None if t.ready is None else 0.0) for t in lm_workload().tensors)
    idle = Workload("lm", 8, ts, 0.0, 0.0, 0.0, OPT, "test")  # no compute at all
    sizes = (2 * MB, 4 * MB, 4 * MB)
    gathers = sum(s / 2 * beta for s in sizes) + sum(s / 2 * beta for s in sizes[1:])
    reduces = sum(s / 2 * beta for s in sizes)
    got = sharded_step("fsdp", idle, params(beta), 2, 1, onebit_table(), backend="nccl")
    assert got.step_s == pytest.approx(gathers + reduces + OPT / 2, rel=1e-9)
    busy = sharded_step("fsdp", lm_workload(), params(beta), 2, 1, onebit_table(), backend="nccl")
    assert max(FWD + BWD + OPT / 2, busy.comm_s) - 1e-12 <= busy.step_s < FWD + BWD + OPT / 2 + busy.comm_s


def test_fsdp_own_work_stretches_the_compute():
    """FSDP2's hooks and copies, measured on one rank: on the training thread, serial on a CPU."""
    w = lm_workload()
    plain = sharded_step("hsdp", w, params(1 / 1.25e8), 2, 2, onebit_table(), backend="gloo")
    more = sharded_step("hsdp", w, params(1 / 1.25e8), 2, 2, onebit_table(), 1.5, "gloo", own_work_s=0.012)
    slow = sharded_step("hsdp", w, params(1 / 1.25e8), 2, 2, onebit_table(), 1.5, "gloo")
    assert more.step_s == pytest.approx(slow.step_s + 1.5 * 0.012, rel=1e-9)
    assert slow.step_s > plain.step_s
    with pytest.raises(ValueError, match="backend must be one of nccl, gloo"):
        sharded_step("hsdp", w, params(1 / 1.25e8), 2, 2, onebit_table(), backend="mpi")


def test_predict_point_takes_sharded_contenders_and_one_node_sends_nothing_across():
    net = Network(params(1 / 1.25e8, 1 / 1e9), "test")
    names = ["fsdp", "hsdp", "replicate", "hsdp/onebit"]
    rows = predict_point(lm_workload(), Point(1, 2, net), names, onebit_table(), Cpu(2, 2.0))
    assert all(r["cable_mb"] == 0.0 for r in rows)
    assert all(r["step_ms"] > (FWD + BWD) * 1e3 for r in rows)


@pytest.mark.parametrize(
    "name, words",
    [
        ("fsdp/hitopk:density=0.01", "hierarchical"),
        ("hsdp/auto", "auto"),
        ("replicate/powersgd:rank=4", "low-rank"),
        ("fsdp/", "give a scheme"),
        ("zero3", None),
    ],
)
def test_bad_sharded_contenders_are_refused_by_name(name, words):
    if words is None:
        from gradsync.whatif.sharded import is_sharded

        assert not is_sharded(name)
        return
    with pytest.raises(ValueError) as e:
        sharded_contender(name)
    assert name in str(e.value) and words in str(e.value)
