"""The alpha-beta formulas against hand-computed values."""

import pytest

from gradsync.collectives.cost import CodecCost, CostModel, CostParams, Linear, Link

INTRA = Link(alpha=1e-5, beta=1e-9)
INTER = Link(alpha=1e-3, beta=8e-8)  # 12.5 MB/s, 100 Mbit/s
PARAMS = CostParams(INTRA, INTER)
S = 64 * 2**20


def codec(ratio=0.02, enc=1e-9, dec=1e-10, summable=False, lowrank=False, bounded=True):
    return CodecCost(Linear(0.0, enc), Linear(0.0, dec), Linear(0.0, ratio), summable, lowrank, bounded)


def test_linear_fit_recovers_a_line():
    f = Linear.fit([1.0, 2.0, 3.0, 4.0], [3.0, 5.0, 7.0, 9.0])
    assert f.a == pytest.approx(1.0) and f.b == pytest.approx(2.0)
    assert Linear.fit([5.0], [2.0]) == Linear(2.0, 0.0)


def test_parallel_tensor_op_takes_the_measured_gather_start():
    # largest share 30 % of 10 ms of norms, 54 values per rank gathered over 4 ranks
    bare = CostModel(PARAMS, nodes=2, per_node=2)
    assert bare.parallel_tensor_op(0.010, 0.3, 54) == pytest.approx(
        0.003 + 2 * INTER.alpha + 3 * 54 * 4 * INTER.beta
    )
    measured = CostModel(CostParams(INTRA, INTER, gather_start=0.004), nodes=2, per_node=2)
    assert measured.parallel_tensor_op(0.010, 0.3, 54) == pytest.approx(
        0.003 + 0.004 + 3 * 54 * 4 * INTER.beta
    )


def test_dense_formulas_on_two_by_two():
    m = CostModel(PARAMS, nodes=2, per_node=2)
    # flat: ring over 4 ranks on the inter link: 2*3 alpha + 2*3/4 S beta
    assert m.flat(S) == pytest.approx(6 * INTER.alpha + 1.5 * S * INTER.beta)
    # torus2d: intra RS + AG (each 1 alpha + S/2 beta) and a 2-rank all-reduce of the cable bytes
    intra = INTRA.alpha + S / 2 * INTRA.beta
    assert m.torus2d(S) == pytest.approx(2 * intra + 2 * INTER.alpha + S * INTER.beta)
    # hierarchical: reduce + broadcast trees (log2 2 = 1 step of S each) + leaders' all-reduce
    assert m.hierarchical(S) == pytest.approx(
        2 * (INTRA.alpha + S * INTRA.beta) + 2 * INTER.alpha + S * INTER.beta
    )
    # the cable carries 1.5 S for flat and S for the hierarchical schemes: 1.5x is the bound
    assert 1.4 < m.flat(S) / m.torus2d(S) < 1.5


def test_sparse_formulas():
    m = CostModel(PARAMS, nodes=2, per_node=2)
    c = codec()
    # paper 01 Eq. 3 with B-byte payloads
    assert m.allgather(1000, 4, INTER) == pytest.approx(INTER.alpha * 2 + 3 * 1000 * INTER.beta)
    # naive: payloads of a bounded size in fixed slots (one start-up per step), four decodes
    naive = c.encode(S) + INTER.alpha * 2 + 3 * c.payload(S) * INTER.beta + 4 * c.decode(S)
    assert m.naive(S, c) == pytest.approx(naive)
    # a codec without a bound sends the sizes first: two start-ups per step
    loose = codec(bounded=False)
    assert m.naive(S, loose) == pytest.approx(naive + INTER.alpha * 2)
    # Eq. 7-10: two local indices share the cable, each gathering one shard payload from 1 peer;
    # then each rank forwards its 2 payloads to the other local rank (Eq. 10's sparse all-gather)
    t1 = INTRA.alpha + S / 2 * INTRA.beta
    t3 = INTER.alpha + c.payload(S / 2) * INTER.beta * 2
    t4 = INTRA.alpha + 2 * c.payload(S / 2) * INTRA.beta
    assert m.hitopk(S, c) == pytest.approx(t1 + c.encode(S / 2) + t3 + t4 + 4 * c.decode(S / 2))
    assert m.hitopk(S, loose) == pytest.approx(m.hitopk(S, c) + INTER.alpha + INTRA.alpha)
    assert m.hitopk(S, c) < m.naive(S, c) < m.flat(S)


def test_every_collective_call_pays_the_call_cost():
    """The cost of one call (the engine's software, a busy host's scheduling) is paid once per
    collective: one for a flat ring, three for torus2d and hierarchical on 2 x 2 (intra, inter,
    intra), three for hitopk in one chunk (reduce-scatter, inter all-gather, intra all-gather),
    one more per chunk's pair, two for an unbounded codec's every all-gather."""
    call = 2e-3
    bare = CostModel(PARAMS, nodes=2, per_node=2)
    paid = CostModel(CostParams(INTRA, INTER, call=call), nodes=2, per_node=2)
    c, loose = codec(), codec(bounded=False)
    for name, calls in (("flat", 1), ("torus2d", 3), ("hierarchical", 3)):
        assert getattr(paid, name)(S) == pytest.approx(getattr(bare, name)(S) + calls * call), name
    assert paid.hitopk(S, c) == pytest.approx(bare.hitopk(S, c) + 3 * call)
    assert paid.naive(S, c) == pytest.approx(bare.naive(S, c) + call)
    assert paid.naive(S, loose) == pytest.approx(bare.naive(S, loose) + 2 * call)
    # four chunks: the chunks' transfers dominate the pipeline (c + 3 max(c, x) + x: 4 transfer
    # calls, 1 compute call), plus the intra all-gather
    c4 = codec(enc=1e-12, dec=1e-12)
    assert paid.hitopk(S, c4, chunks=4) == pytest.approx(bare.hitopk(S, c4, chunks=4) + 6 * call)
    one = CostModel(CostParams(INTRA, INTER, call=call), nodes=1, per_node=1)
    assert one.flat(S) == 0.0 and one.torus2d(S) == 0.0  # nothing to call on one rank


def test_casync_table_3():
    m = CostModel(PARAMS, nodes=4, per_node=1)
    q = codec(ratio=1 / 32)
    assert m.casync_steps(True, q, 4, 4) == (6, 4, 4)
    assert m.casync_steps(False, q, 4, 4) == (6, 5, 5)  # K + 1 encodes, N + 1 decodes
    assert m.casync_steps(True, codec(lowrank=True), 4, 4) == (6, 1, 1)
    part = S / 4
    want = 6 * INTER.send(q.payload(part)) + 4 * q.encode(part) + 4 * q.decode(part)
    assert m.casync(True, S, q) == pytest.approx(want)
    two = 6 * (2 * INTER.alpha + q.payload(part) * INTER.beta) + 4 * q.encode(part) + 4 * q.decode(part)
    assert m.casync(True, S, q, messages=2) == pytest.approx(two)
    ps = 6 * INTER.send(q.payload(part)) + 5 * q.encode(part) + 5 * q.decode(part)
    assert m.casync(False, S, q) == pytest.approx(ps)


def test_one_rank_costs_nothing_to_communicate():
    m = CostModel(PARAMS, nodes=1, per_node=1)
    assert m.flat(S) == 0.0 and m.torus2d(S) == 0.0


def test_pipelined_hitopk_overlaps_compute_and_transfer():
    m = CostModel(PARAMS, nodes=2, per_node=2)
    c = codec(enc=1e-8)
    one, four = m.hitopk(S, c), m.hitopk(S, c, chunks=4)
    assert four < one
    part = S / 4
    compute = INTRA.alpha + part / 2 * INTRA.beta + c.encode(part / 2)
    transfer = INTER.alpha + c.payload(part / 2) * INTER.beta * 2  # fixed slots: one start-up
    tail = INTRA.alpha + 2 * 4 * c.payload(part / 2) * INTRA.beta + 16 * c.decode(part / 2)
    assert four == pytest.approx(compute + 3 * max(compute, transfer) + transfer + tail)


def test_local_aggregation_without_peers_is_predicted_as_the_engine_runs_it():
    """hitopk (``allgather+local``) with one rank per node: compressed_program runs the plain
    all-gather over the world, one encode and one all-gather per part, no chunks, so the planner
    predicts paper 04's packed all-gather (naive), not the chunked pipeline. On one node nothing
    crosses a node: a dense intra-node reduce-scatter and all-gather."""
    from gradsync.planner.decide import predict
    from gradsync.sync.scheme import Scheme

    c = codec(enc=1e-8)
    hitopk = Scheme.parse("hitopk:density=0.01").resolve(2, 1)
    assert hitopk.local and hitopk.strategy == "allgather"
    two_by_one = CostModel(PARAMS, nodes=2, per_node=1)
    want = c.encode(S) + INTER.alpha + c.payload(S) * INTER.beta + 2 * c.decode(S)
    assert predict(hitopk, two_by_one, S, c) == pytest.approx(want)
    one_node = CostModel(PARAMS, nodes=1, per_node=4)
    rs = 3 * INTRA.alpha + 3 / 4 * S * INTRA.beta
    assert predict(hitopk, one_node, S, c) == pytest.approx(2 * rs)
