"""Collectives in real gloo worlds of 1-4 processes. Each world runs many checks (and reports
every one that fails); every rank rebuilds every rank's input from a seed, so each result is
checked against a reference computed independently in the same process (plain sums, torch.topk)."""

import itertools
import math

import pytest
import torch
import torch.distributed as dist

import gradsync
from gradsync.codecs import EncodeContext
from gradsync.codecs.sparse import TopK
from gradsync.collectives import (
    MismatchError,
    Topology,
    TopologyError,
    allreduce,
    compressed_allreduce,
    hitopk,
    record_traffic,
)
from gradsync.collectives.dense import HybridPolicy
from worlds import expect_all, named_check, run_checks, run_world

pytestmark = pytest.mark.timeout(240)

SIZES = [0, 1, 7, 1000, 4099]


def inputs(world, n, seed, integer=True):
    """Every rank's input, identical on every rank."""
    out = []
    for r in range(world):
        g = torch.Generator().manual_seed(seed * 1000 + r)
        x = torch.randint(-8, 9, (n,), generator=g).float() if integer else torch.randn(n, generator=g)
        out.append(x)
    return out


def topologies(world):
    shapes = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 3: [(1, 3), (3, 1)], 4: [(2, 2), (4, 1), (1, 4)]}[world]
    return [Topology(nodes=m, per_node=n) for m, n in shapes]


# ------------------------------------------------------------------------------------------ dense
def check_dense(topo):
    rank, world = topo.rank, topo.world
    with expect_all() as expect:
        for n in SIZES:
            xs = inputs(world, n, seed=n)
            want = torch.stack(xs).sum(0) if n else torch.zeros(0)
            for algorithm in ("flat", "hierarchical", "torus2d", "hybrid"):
                for op in ("sum", "mean"):
                    t = xs[rank].clone()
                    allreduce(t, topo, algorithm, op=op)
                    with expect(f"{algorithm} {op} of {n}"):
                        assert torch.equal(t, want if op == "sum" else want / world)
            # random floats: equal to flat up to rounding, also through a 2-D non-contiguous view
            fx = inputs(world, n, seed=n + 7, integer=False)
            for algorithm in ("hierarchical", "torus2d"):
                t = fx[rank].clone()
                allreduce(t, topo, algorithm)
                with expect(f"{algorithm} of {n} random floats"):
                    torch.testing.assert_close(t, torch.stack(fx).mean(0) if n else t)
            # low-precision communication: within fp16 / bf16 rounding of the largest partial sum
            for comm, eps in (("fp16", 2**-10), ("bf16", 2**-7)):
                t = fx[rank].clone() * 1000.0
                allreduce(t, topo, "torus2d", op="sum", comm_dtype=comm)
                ref = torch.stack(fx).sum(0) * 1000.0
                if n:
                    bound = 2 * world * eps * float(torch.stack(fx).abs().max()) * 1000.0 * world
                    with expect(f"torus2d in {comm} of {n}"):
                        assert float((t - ref).abs().max()) <= bound
        # hybrid with explicit thresholds picks each side
        t = inputs(world, 100, 3)[rank].clone()
        allreduce(t, topo, "hybrid", hybrid=HybridPolicy(threshold=0, large="hierarchical"))
        with expect("hybrid, threshold 0"):
            assert torch.equal(t, torch.stack(inputs(world, 100, 3)).mean(0))
        # non-contiguous input is reduced in place
        m = torch.stack(inputs(world, 12, 4)[rank].chunk(3)).t()
        allreduce(m, topo, "torus2d", op="sum")
        want = torch.stack([torch.stack(x.chunk(3)).t() for x in inputs(world, 12, 4)]).sum(0)
        with expect("non-contiguous, in place"):
            assert torch.equal(m, want)


def check_traffic(topo):
    if topo.world == 1:
        return
    with record_traffic() as tr:
        allreduce(torch.ones(1024), topo, "flat", check=False)
    assert tr.sent == {"world": int(2 * (topo.world - 1) / topo.world * 4096)}


# ------------------------------------------------------------------------------------ compressed
def check_sparse_allgather(topo):
    rank, world = topo.rank, topo.world
    n = 500
    threshold = 1.0
    xs = []
    for r in range(world):
        x = torch.full((n,), 0.5)  # below the threshold: rank 0 selects nothing
        if r % 4 == 1:
            x[(17 * r) % n] = 3.0  # exactly one
        elif r % 4 == 2:
            x[::7] = -2.0  # some, overlapping other ranks' indices
        elif r % 4 == 3:
            x[:] = 5.0  # all
        xs.append(x)
    want = sum(torch.where(x.abs() >= threshold, x, torch.zeros(())) for x in xs) if world > 1 else xs[0]
    codec = gradsync.build_codec(f"graddrop:threshold={threshold}")
    t = xs[rank].clone()
    compressed_allreduce(t, topo, codec, "allgather", op="sum", key="sag")
    assert torch.equal(t, want)


class CorruptTopK(TopK):
    """topk that puts an out-of-range index into rank 1's payload."""

    def _encode(self, x, shape, ctx, stream, out):
        payload = super()._encode(x, shape, ctx, stream, out)
        if dist.get_rank() == 1:
            self.sparse_view(payload)[0][0] = x.numel() + 5
        return payload


def check_bad_peer_index(topo):
    if topo.world < 2:
        return
    codec = CorruptTopK(TopK.Config(k=3))
    with pytest.raises(IndexError, match="sparse index 105 is outside a tensor of 100 elements"):
        compressed_allreduce(torch.randn(100), topo, codec, "allgather", key="bad")


def exact_topk_dense(v, k):
    out = torch.zeros_like(v)
    if k:
        i = torch.topk(v.abs(), k).indices
        out[i] = v[i]
    return out


def check_naive_and_hitopk(topo):
    rank, world = topo.rank, topo.world
    n = 4099
    xs = inputs(world, n, seed=11, integer=False)
    with expect_all() as expect:
        # density 1: hitopk equals a plain all-reduce (integer inputs: exactly)
        ix = inputs(world, n, seed=12)
        t = ix[rank].clone()
        hitopk(t, topo, gradsync.build_codec("topk:density=1.0"), op="sum", key="h1")
        with expect("hitopk at density 1"):
            assert torch.equal(t, torch.stack(ix).sum(0))
        for strategy in ("allgather", "ring", "ps"):  # the mean is decoded directly (scaled decode)
            for local in (False, True):
                t = ix[rank].clone()
                codec = gradsync.build_codec("topk:density=1.0")
                compressed_allreduce(t, topo, codec, strategy, local, key="m")
                with expect(f"{strategy} local={local} at density 1"):
                    torch.testing.assert_close(t, torch.stack(ix).mean(0))
        # naive: the sum of every rank's own top-k
        t = xs[rank].clone()
        compressed_allreduce(t, topo, gradsync.build_codec("topk:k=40"), "allgather", op="sum", key="naive")
        with expect("naive allgather of top-k"):
            torch.testing.assert_close(t, sum(exact_topk_dense(x, 40) for x in xs))
    # hitopk: node sums per shard, top-k of each node's shard, summed over nodes
    t = xs[rank].clone()
    hitopk(t, topo, gradsync.build_codec("topk:density=0.02"), op="sum", key="hi")
    if topo.per_node == 1:
        ref = sum(exact_topk_dense(x, math.ceil(0.02 * n)) for x in xs)
    else:
        per = topo.per_node
        shard = -(-n // per)
        ref = torch.zeros(shard * per)
        for node in range(topo.nodes):
            node_sum = torch.stack(xs[node * per : (node + 1) * per]).sum(0)
            padded = torch.cat([node_sum, torch.zeros(shard * per - n)])
            for j in range(per):
                part = padded[j * shard : (j + 1) * shard]
                if topo.nodes == 1:
                    ref[j * shard : (j + 1) * shard] += part  # one node: nothing is compressed
                else:
                    ref[j * shard : (j + 1) * shard] += exact_topk_dense(part, math.ceil(0.02 * shard))
        ref = ref[:n]
    torch.testing.assert_close(t, ref)


def check_pipelined_hitopk(topo):
    """hitopk in chunks: top-k applies per chunk of every node's shard."""
    import gradsync.collectives.hitopk_pipeline as pipeline

    if topo.nodes < 2 or topo.per_node < 2:  # (with one rank per node there is no local aggregation)
        return
    rank, world, per = topo.rank, topo.world, topo.per_node
    n = 1001
    xs = inputs(world, n, seed=13, integer=False)
    old, pipeline._MIN_CHUNK_BYTES = pipeline._MIN_CHUNK_BYTES, 16
    try:
        t = xs[rank].clone()
        hitopk(t, topo, gradsync.build_codec("topk:density=0.05"), op="sum", key="pipe", pipeline=3)
    finally:
        pipeline._MIN_CHUNK_BYTES = old
    total = -(-n // per) * per
    per_chunk = math.ceil(math.ceil(total / 3) / per) * per
    ref = torch.zeros(total)
    for node in range(topo.nodes):
        node_sum = torch.cat([torch.stack(xs[node * per : (node + 1) * per]).sum(0), torch.zeros(total - n)])
        for start in range(0, total, per_chunk):
            chunk = node_sum[start : start + per_chunk]
            sub = chunk.numel() // per
            for j in range(per):
                part = chunk[j * sub : (j + 1) * sub]
                ref[start + j * sub : start + (j + 1) * sub] += exact_topk_dense(part, math.ceil(0.05 * sub))
    torch.testing.assert_close(t, ref[:n])


def recording_codec(spec):
    """A codec whose encode calls note the element count they were given."""
    codec, seen = gradsync.build_codec(spec), []
    plain_encode = codec.encode

    def encode(x, ctx=None, **kw):
        seen.append(x.numel())
        return plain_encode(x, ctx, **kw)

    codec.encode = encode
    return codec, seen


def check_encode_numels_are_what_the_programs_encode(topo):
    """encode_numels (which wrap and the hook use to refuse a codec before anything runs) lists
    exactly the sizes the strategies hand the codec."""
    import gradsync.collectives.compressed as compressed
    import gradsync.collectives.hitopk_pipeline as pipeline

    old, pipeline._MIN_CHUNK_BYTES = pipeline._MIN_CHUNK_BYTES, 64  # pipelining at these sizes
    try:
        with expect_all() as expect:
            for n in (7, 1001, 4099):
                for local, strategy in itertools.product((False, True), ("allgather", "ring", "ps")):
                    codec, seen = recording_codec("topk:density=0.3")
                    compressed_allreduce(torch.randn(n), topo, codec, strategy, local, pipeline=3)
                    want = compressed.encode_numels(n, strategy, local, topo.nodes, topo.per_node, pipeline=3)
                    # ring and ps also encode merged aggregates (of the same sizes) and empty pieces
                    with expect(f"{strategy} local={local} of {n}"):
                        assert sorted({m for m in seen if m}) == [m for m in want if m], (seen, want)
    finally:
        pipeline._MIN_CHUNK_BYTES = old


def ring_reference(xs, k):
    """The CaSync ring on p simulated ranks with an exact top-k "codec"."""
    p = len(xs)
    chunks = [list(torch.tensor_split(x, p)) for x in xs]
    send = [exact_topk_dense(chunks[r][r], k) for r in range(p)]
    for s in range(p - 1):
        new = []
        for r in range(p):
            idx = (r - s - 1) % p
            new.append(exact_topk_dense(chunks[r][idx] + send[(r - 1) % p], k))
        send = new
    final = [None] * p
    for r in range(p):
        final[(r + 1) % p] = send[r]
    return torch.cat(final)


def ps_reference(xs, k):
    p = len(xs)
    parts = [list(torch.tensor_split(x, p)) for x in xs]
    return torch.cat(
        [exact_topk_dense(sum(exact_topk_dense(parts[r][j], k) for r in range(p)), k) for j in range(p)]
    )


def check_ring_and_ps(topo):
    rank, world = topo.rank, topo.world
    n = 1001
    ix = inputs(world, n, seed=21)
    fx = inputs(world, n, seed=22, integer=False)
    with expect_all() as expect:
        for strategy in ("ring", "ps"):
            for local in (False, True):
                t = ix[rank].clone()
                compressed_allreduce(
                    t, topo, gradsync.build_codec("none"), strategy, local, op="sum", key=f"n{strategy}"
                )
                with expect(f"{strategy} local={local}, none"):
                    assert torch.equal(t, torch.stack(ix).sum(0))
                t = fx[rank].clone()
                compressed_allreduce(
                    t, topo, gradsync.build_codec("fp16"), strategy, local, op="sum", key=f"h{strategy}"
                )
                bound = 4 * world * 2**-11 * float(torch.stack(fx).abs().max()) * world
                with expect(f"{strategy} local={local}, fp16"):
                    assert float((t - torch.stack(fx).sum(0)).abs().max()) <= bound
            # a sparse codec: equal to a single-process run of the same steps
            t = fx[rank].clone()
            compressed_allreduce(
                t, topo, gradsync.build_codec("topk:k=20"), strategy, op="sum", key=f"s{strategy}"
            )
            ref = (ring_reference if strategy == "ring" else ps_reference)(fx, 20) if world > 1 else fx[0]
            with expect(f"{strategy}, topk:k=20"):
                torch.testing.assert_close(t, ref)


def check_lowrank(topo):
    rank, world = topo.rank, topo.world
    g = torch.Generator().manual_seed(5)
    ms = [torch.randn(30, 1, generator=g) @ torch.randn(1, 40, generator=g) for _ in range(world)]
    with expect_all() as expect:
        for strategy in ("ring", "allgather"):
            for local in (False, True):
                t = ms[rank].clone()
                key = f"p-{strategy}-{local}"
                compressed_allreduce(
                    t, topo, gradsync.build_codec("powersgd:rank=4"), strategy, local, op="sum", key=key
                )
                ref = gradsync.build_codec("powersgd:rank=4")
                total = sum(ms)
                across_nodes = not (local and topo.per_node > 1 and topo.nodes == 1)  # one node: exact
                if across_nodes:
                    want = ref.decode(ref.encode(total, EncodeContext(key=f"{key}/lowrank")))
                else:
                    want = total
                with expect(f"{strategy} local={local}"):
                    torch.testing.assert_close(t, want, rtol=1e-4, atol=1e-4)


def check_error_feedback_is_conserved(topo):
    """allgather with error feedback: results + everybody's residuals = the sum of the inputs."""
    rank, world = topo.rank, topo.world
    xs = inputs(world, 300, seed=31, integer=False)
    ef = gradsync.build_codec("topk:k=10+ef")
    t = xs[rank].clone()
    compressed_allreduce(t, topo, ef, "allgather", op="sum", key="ef")
    if world == 1:
        assert torch.equal(t, xs[0])
        return
    residual = ef.residual("ef/allgather")
    total = residual.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(t + total, torch.stack(xs).sum(0), rtol=1e-5, atol=1e-5)


def check_mismatches(topo):
    rank, world = topo.rank, topo.world
    if world == 1:
        return
    with pytest.raises(MismatchError, match=r"numel: rank 0=10, rank 1=11"):
        allreduce(torch.ones(10 + (rank == 1)), topo, "torus2d")
    with pytest.raises(MismatchError, match=r"codec: rank 0='topk:k=3', rank 1='topk:k=4'"):
        compressed_allreduce(torch.ones(10), topo, gradsync.build_codec(f"topk:k={3 + (rank == 1)}"), "ring")
    with pytest.raises(MismatchError, match="algorithm"):
        allreduce(torch.ones(10), topo, "flat" if rank else "hierarchical")


def check_argument_errors(topo):
    with pytest.raises(ValueError, match="algorithm must be one of flat, hierarchical, torus2d, hybrid"):
        allreduce(torch.ones(3), topo, "butterfly")
    with pytest.raises(ValueError, match="op must be 'sum' or 'mean'"):
        allreduce(torch.ones(3), topo, op="max")
    with pytest.raises(ValueError, match="comm_dtype must be None, 'fp16' or 'bf16'"):
        allreduce(torch.ones(3), topo, comm_dtype="fp8")
    with pytest.raises(ValueError, match="strategy must be one of allgather, ring, ps"):
        compressed_allreduce(torch.ones(3), topo, gradsync.build_codec("none"), "tree")
    with pytest.raises(ValueError, match="pipeline must be a positive number of chunks"):
        hitopk(torch.ones(3), topo, gradsync.build_codec("topk"), pipeline=0)
    with pytest.raises(ValueError, match="hitopk needs a sparsifying codec"):
        hitopk(torch.ones(3), topo, gradsync.build_codec("onebit"))
    with pytest.raises(ValueError, match="hybrid threshold must be >= 0"):
        HybridPolicy(threshold=-1)
    with pytest.raises(TopologyError, match="nodes must be a positive integer"):
        Topology(nodes=0, per_node=1)


def check_one_rank_is_identity(topo):
    x = torch.randn(300)
    for codec in ("topk:k=3", "onebit", "powersgd:rank=1", "fp16"):
        for strategy in ("allgather", "ring", "ps"):
            t = x.clone()
            compressed_allreduce(t, topo, gradsync.build_codec(codec), strategy, op="sum")
            assert torch.equal(t, x)


def check_calibration(topo):
    from gradsync.collectives.cost import calibrate

    if (topo.nodes, topo.per_node) != (2, 2):
        return
    params = calibrate(topo, sizes=[1024, 262144, 1048576], reps=2)
    assert params.gather_start is not None and 0 < params.gather_start < 1
    mine = torch.tensor(
        [params.intra.alpha, params.intra.beta, params.inter.beta, params.gamma, params.gather_start],
        dtype=torch.float64,
    )
    same = mine.clone()
    dist.broadcast(same, 0)
    for link in (params.intra, params.inter):
        assert link.alpha >= 0 and link.beta > 0 and math.isfinite(link.alpha + link.beta)
    assert torch.equal(mine, same)  # every rank got the same numbers
    # the node-internal reduce and broadcast, timed at the largest size (1 MiB: the large class)
    # against their formula: within the bounds, the same on every rank
    assert [k for k, _ in params.efficiency] == ["tree/large"], params.efficiency
    tree = torch.tensor([params.efficiency_of("tree", 1 << 20)], dtype=torch.float64)
    theirs_tree = tree.clone()
    dist.broadcast(theirs_tree, 0)
    assert torch.equal(tree, theirs_tree) and 0.1 <= float(tree) <= 100
    # bench whatif's ratio of the node's all-reduce with every node at once over one alone: a
    # positive number, the same on every rank (the timings are the slowest rank's)
    from gradsync.apps.commands.bench.whatif import node_transfer_ratio

    ratio = node_transfer_ratio(topo, reps=1)
    assert ratio is not None and 0 < ratio < 100, ratio
    theirs_ratio = torch.tensor([ratio], dtype=torch.float64)
    dist.broadcast(theirs_ratio, 0)
    assert float(theirs_ratio) == ratio
    # the add rate of one rank alone on 16 MiB: between 1 TB/s and 100 MB/s on any host
    assert 1e-12 < params.gamma < 1e-8, params.gamma
    # world all-gathers against the all-gather formula on these links: one entry per size class,
    # the same on every rank, and the ratio the planner's predict then applies to an all-gather
    from dataclasses import replace

    from gradsync.collectives.cost import CostModel, measure_efficiency
    from gradsync.planner.decide import predict
    from gradsync.sync.scheme import Scheme

    eff = dict(measure_efficiency(topo, params, reps=1))
    keys = [f"{k}/{c}" for k in ("allgather", "sendrecv") for c in ("small", "large")]
    assert sorted(eff) == sorted(keys)
    assert all(0.1 <= v <= 100 for v in eff.values())
    theirs = torch.tensor([eff[k] for k in keys], dtype=torch.float64)
    dist.broadcast(theirs, 0)
    assert theirs.tolist() == [eff[k] for k in keys]
    from gradsync.collectives.cost import CodecCost, Linear

    plain = CodecCost(Linear(0.0, 0.0), Linear(0.0, 0.0), Linear(0.0, 1.0))  # sends its input, free to run
    scheme = Scheme.parse("allgather/topk:density=0.5")
    size = 4 << 20  # a 4 MiB payload per rank: the large class
    base = CostModel(params, 2, 2)
    corrected = CostModel(replace(params, efficiency=tuple(eff.items())), 2, 2)
    assert predict(scheme, corrected, size, plain) == pytest.approx(
        eff["allgather/large"] * predict(scheme, base, size, plain), rel=1e-9
    )


def check_gathers_between_two_ranks_in_slices(topo):
    """Between two gloo ranks a large all-gather runs as concurrent gathers of slices: the
    result is each rank's buffer in rank order, as one all-gather gives (sizes around the slice
    threshold, blocking and in flight; groups of more ranks take one all-gather)."""
    from gradsync.collectives import primitives as P
    from gradsync.collectives.primitives import PAIR_CHUNK_MIN

    group, rank, p = topo.world_group, dist.get_rank(), dist.get_world_size()
    failed = []
    for n in (100, 2 * PAIR_CHUNK_MIN - 1, 2 * PAIR_CHUNK_MIN, 5 * PAIR_CHUNK_MIN + 3):
        mine = torch.arange(n, dtype=torch.int32).to(torch.uint8) + rank
        want = torch.cat([torch.arange(n, dtype=torch.int32).to(torch.uint8) + r for r in range(p)])
        out = torch.empty(p * n, dtype=torch.uint8)
        P.all_gather(out, mine, group, "world")
        if not torch.equal(out, want):
            failed.append(f"all_gather of {n} bytes")
        pending = P.start_all_gather_fixed(mine[: n - 1], n, group, "world")
        got = torch.cat(pending.wait())
        want_fixed = torch.cat(
            [torch.cat([w[: n - 1], torch.zeros(1, dtype=torch.uint8)]) for w in want.view(p, n)]
        )
        if not torch.equal(got, want_fixed):
            failed.append(f"a fixed all-gather in flight of {n} bytes")
    assert not failed, failed


PER_TOPOLOGY = (
    check_dense,
    check_gathers_between_two_ranks_in_slices,
    check_traffic,
    check_sparse_allgather,
    check_bad_peer_index,
    check_naive_and_hitopk,
    check_pipelined_hitopk,
    check_encode_numels_are_what_the_programs_encode,
    check_ring_and_ps,
    check_lowrank,
    check_error_feedback_is_conserved,
    check_mismatches,
    check_calibration,
)


def world_checks():
    if dist.get_world_size() == 1:
        topo = Topology()
        checks = (check_dense, check_one_rank_is_identity, check_argument_errors)
        run_checks(*(named_check(check, topo) for check in checks))
        return
    run_checks(
        *(
            named_check(check, topo, label=f"{topo.nodes}x{topo.per_node}")
            for topo in topologies(dist.get_world_size())
            for check in PER_TOPOLOGY
        ),
        named_check(check_argument_errors, topologies(dist.get_world_size())[0]),
    )


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_collectives_in_a_world(world):
    run_world(world, world_checks)


def bad_layouts():
    world = dist.get_world_size()
    with pytest.raises(TopologyError, match="3 nodes x 2 per node is 6 ranks, but the world has 4"):
        Topology(nodes=3, per_node=2)
    with pytest.raises(TopologyError, match="ranks must be contiguous per node"):
        Topology()  # the environment says rank 1 is on node 1 and rank 2 on node 0
    assert world == 4


def test_bad_topologies_fail_on_every_rank():
    # rank r claims node (r % 2): not contiguous
    run_world(4, bad_layouts, env={"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "{rank}", "LOCAL_RANK": "{rank}"})


def test_topology_sizes_must_be_positive_integers():
    for nodes, per_node in ((0, 1), (True, 1), (1, 2.0), (-1, 1)):
        with pytest.raises(TopologyError, match="must be a positive integer"):
            Topology(nodes=nodes, per_node=per_node)


def test_trivial_topology_without_a_process_group():
    topo = Topology()
    assert (topo.nodes, topo.per_node, topo.world, topo.rank) == (1, 1, 1, 0)
    x = torch.randn(5)
    y = x.clone()
    assert allreduce(y) is y and torch.equal(y, x)
    compressed_allreduce(y, None, gradsync.build_codec("topk:k=1"))
    assert torch.equal(y, x)


def test_result_pieces_round_trip_and_reject_corruption():
    from gradsync.collectives.pieces import Piece as _Piece
    from gradsync.collectives.pieces import pack_pieces as _pack
    from gradsync.collectives.pieces import unpack_pieces as _unpack

    codec = gradsync.build_codec("topk:k=3")
    a, b = codec.encode(torch.randn(10)), codec.encode(torch.randn(6))
    blob = _pack([_Piece(0, a), _Piece(10, b)])
    pieces = _unpack(blob, 16, torch.float32, codec)
    assert [(q.offset, q.payload.numel) for q in pieces] == [(0, 10), (10, 6)]
    assert torch.equal(pieces[1].payload.data, b.data)
    with pytest.raises(ValueError, match="corrupt result pieces from a peer: piece at 10 of 6 elements"):
        _unpack(blob, 15, torch.float32, codec)  # the second piece would overrun a 15-element shard
    with pytest.raises(ValueError, match="trailing bytes"):
        _unpack(torch.cat([blob, torch.zeros(3, dtype=torch.uint8)]), 16, torch.float32, codec)
    bad = blob.clone()
    bad[:8] = torch.tensor([1000], dtype=torch.int64).view(torch.uint8)
    with pytest.raises(ValueError, match="count 1000"):
        _unpack(bad, 16, torch.float32, codec)


def test_packed_pieces_in_a_fixed_slot_are_found_and_checked():
    """A pack in a zero-padded fixed slot (the intra-node all-gather without a size exchange):
    its length comes from its header, within the bound computed from the pieces' sizes alone;
    a header that claims more than the slot holds is refused."""
    from gradsync.collectives.pieces import Piece as _Piece
    from gradsync.collectives.pieces import pack_pieces as _pack
    from gradsync.collectives.pieces import packed_capacity, packed_length
    from gradsync.collectives.pieces import unpack_pieces as _unpack

    codec = gradsync.build_codec("topk:k=3+ef")
    a, b = codec.encode(torch.randn(10)), codec.encode(torch.randn(6), gradsync.codecs.EncodeContext("b"))
    blob = _pack([_Piece(0, a), _Piece(10, b)])
    capacity = packed_capacity([10, 6], codec, torch.float32)
    assert capacity is not None and capacity >= blob.numel()
    slot = torch.zeros(capacity, dtype=torch.uint8)
    slot[: blob.numel()] = blob
    assert packed_length(slot) == blob.numel()
    pieces = _unpack(slot[: packed_length(slot)], 16, torch.float32, codec)
    assert [(q.offset, q.payload.numel) for q in pieces] == [(0, 10), (10, 6)]
    lying = slot.clone()
    head = lying[:56].view(torch.int64)
    head[6] = capacity  # the second piece claims the whole slot
    with pytest.raises(ValueError, match=r"corrupt result pieces from a peer: .* bytes of pieces in a"):
        packed_length(lying)
    with pytest.raises(ValueError, match="corrupt result pieces from a peer: 3 bytes"):
        packed_length(slot[:3])
