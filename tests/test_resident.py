"""Resident mode (``Compressor.set_resident``): payloads of a fixed size, statistics and flags on
the device, nothing read back by the host. On the CPU the same code runs, so here it is checked
against independent references (``torch.topk``, per-chunk loops, float64 sums), for inf/NaN,
for corrupt input, and with the audit of host reads: no codec, no strategy and neither front
(wrap, the DDP hook) reads a device value on the host per bucket."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
from gradsync.codecs import build_codec
from gradsync.sync.host_reads import audit_host_reads
from worlds import expect_all, named_check, run_checks, run_world

N, K = 100_000, 1000  # density 0.01

SPARSE = {
    "topk": "topk:density=0.01",
    "chunktopk": "chunktopk:density=0.01,chunk=4096",
    "mstopk": "mstopk:density=0.01",
    "trimmed_topk": "trimmed_topk:density=0.01",
    "bsearch": "bsearch:density=0.01",
    "dgc": "dgc:density=0.01",
    "graddrop": "graddrop:density=0.01",
    "randomk": "randomk:density=0.01",
}
DENSE = [
    "onebit",
    "onebit:scales=1",
    "tbq:threshold=0.5",
    "terngrad",
    "terngrad:bits=4,clip=2.5",
    "fp16",
    "bf16",
    "none",
]
EVERY = [*SPARSE.values(), *DENSE, "powersgd:rank=4"]


def resident(spec: str):
    codec = build_codec(spec)
    codec.set_resident(True)
    assert codec.resident and codec.host_free, spec
    return codec


def sample(seed: int = 0, n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def sent(decoded: torch.Tensor) -> torch.Tensor:
    return decoded.nonzero().view(-1)


def top_set(x: torch.Tensor, count: int) -> set[int]:
    return set(x.abs().topk(count).indices.tolist())


# ------------------------------------------------------------------- sparse: what is selected
@pytest.mark.parametrize("name", SPARSE)
def test_a_resident_sparsifier_sends_what_its_rule_says(name):
    x = sample()
    codec = resident(SPARSE[name])
    payload = codec.encode(x)
    assert payload.nbytes == codec.estimate_nbytes(N) == codec.max_nbytes(N)
    decoded = codec.decode(payload)
    idx = sent(decoded)
    assert torch.equal(decoded[idx], x[idx]), "sent values are the input's"
    count = idx.numel()
    assert payload.header.count == count
    if name in ("topk", "trimmed_topk"):  # exact
        assert set(idx.tolist()) == top_set(x, K)
    elif name == "mstopk":  # exactly k, all from the top 2k
        assert count == K and set(idx.tolist()) <= top_set(x, 2 * K)
    elif name == "chunktopk":
        want = set()
        for start in range(0, N, 4096):
            chunk = x[start : start + 4096]
            keep = math.ceil(0.01 * chunk.numel())
            want |= {start + i for i in chunk.abs().topk(keep).indices.tolist()}
        assert set(idx.tolist()) == want
    elif name == "randomk":
        assert count == K
        again = sent(codec.decode(codec.encode(x)))
        assert set(again.tolist()) != set(idx.tolist()), "a new draw every call"
    else:  # threshold rules: the largest `count` elements, as many as the capacity allows
        cap = {"bsearch": 2 * K, "graddrop": 2 * K, "dgc": K}[name]
        assert 1 <= count <= cap
        assert set(idx.tolist()) == top_set(x, count)
        if name == "bsearch":
            assert count >= K


def test_resident_padding_slots_add_nothing_and_the_size_never_reads_the_header():
    x = torch.zeros(N)
    x[[5, 77, 900]] = torch.tensor([3.0, -2.0, 1.0])  # far fewer non-zeros than the capacity
    codec = resident("dgc:density=0.01")
    payload = codec.encode(x)
    decoded = codec.decode(payload)
    assert torch.equal(decoded[[5, 77, 900]], x[[5, 77, 900]])
    assert torch.equal(decoded, x * (decoded != 0))
    # a peer's payload: its size follows from the shape alone, whatever its header says
    data = payload.data.clone()
    data[:8].view(torch.int64).fill_(123456789)
    again = codec.payload_from_bytes(data, (N,), torch.float32)
    assert torch.equal(codec.decode(again), decoded)


def test_a_corrupt_index_from_a_peer_fails_loudly():
    codec = resident("topk:density=0.01")
    payload = codec.encode(sample())
    idx, _ = codec.sparse_view(payload)
    idx[3] = N + 5
    with pytest.raises(RuntimeError, match="outside a tensor of"):
        codec.decode(payload)


# ------------------------------------------------------------------- dense codecs
@pytest.mark.parametrize("spec", ["onebit", "onebit:scales=1", "tbq:threshold=0.5", "fp16", "bf16", "none"])
def test_a_resident_quantizer_decodes_as_the_host_path_does(spec):
    x = sample(1) * 3
    want = build_codec(spec).decode(build_codec(spec).encode(x))
    got = resident(spec).decode(resident(spec).encode(x))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec", ["terngrad", "terngrad:bits=4,clip=2.5"])
def test_resident_terngrad_stays_within_one_level_and_is_unbiased(spec):
    x = sample(2)
    codec = resident(spec)
    levels = codec.levels
    scale = (
        x.abs().max().item()
        if "clip" not in spec
        else min(x.abs().max().item(), 2.5 * x.square().mean().sqrt().item())
    )
    total = torch.zeros(N, dtype=torch.float64)
    draws = 64
    for _ in range(draws):
        d = codec.decode(codec.encode(x))
        assert (d - x.clamp(-scale, scale)).abs().max().item() <= scale / levels * (1 + 1e-5)
        total += d.double()
    # the mean of the draws approaches x (clipped): far closer than one level
    err = (total / draws - x.clamp(-scale, scale).double()).abs().mean().item()
    assert err < 0.25 * scale / levels


def test_resident_powersgd_is_one_power_step_as_the_host_path_takes_it():
    torch.manual_seed(0)
    m = torch.randn(64, 48)
    codec = resident("powersgd:rank=4")
    payload = codec.encode(m)
    p, _ = codec.factors(payload)
    # P is orthonormal and P Q^T is M projected onto span(P), written out
    torch.testing.assert_close(p.T @ p, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(codec.decode(payload), p @ (p.T @ m), atol=1e-4, rtol=1e-4)
    # the same Q from the same seeded stream: the host path's answer, up to rounding
    host = build_codec("powersgd:rank=4")
    torch.testing.assert_close(codec.decode(payload), host.decode(host.encode(m)), atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------- inf/NaN, error feedback
@pytest.mark.parametrize("spec", EVERY)
def test_a_non_finite_input_is_flagged_and_decodes_to_nan(spec):
    x = sample(3)
    x[17] = math.nan
    shape = (400, 250) if spec.startswith("powersgd") else (N,)
    codec = resident(spec)
    payload = codec.encode(x.view(shape))
    assert payload.nonfinite
    assert codec.decode(payload).isnan().all()


@pytest.mark.parametrize("spec", [*SPARSE.values(), "onebit", "tbq:threshold=0.5", "fp16"])
def test_resident_error_feedback_owes_exactly_what_was_not_sent(spec):
    codec = resident(spec + "+ef")
    total = torch.zeros(N, dtype=torch.float64)
    delivered = torch.zeros(N, dtype=torch.float64)
    for step in range(4):
        g = sample(10 + step)
        total += g.double()
        delivered += codec.decode(codec.encode(g)).double()
    residual = codec.residual("").double()
    torch.testing.assert_close(delivered + residual, total, atol=1e-4, rtol=0)
    # a non-finite step leaves the residual as it was
    before = residual.clone()
    bad = sample(20)
    bad[0] = math.inf
    assert codec.encode(bad).nonfinite
    torch.testing.assert_close(codec.residual("").double(), before, atol=0, rtol=0)


@pytest.mark.parametrize(
    "spec",
    [
        "topk:density=0.1+ef:momentum=0.9,masking=false",
        "mstopk:density=0.1+ef:momentum=0.9,masking=false",
        "topk:density=0.1+ef:momentum=0.9,nesterov=true",
    ],
)
def test_a_non_finite_first_round_with_momentum_is_discarded_as_on_the_host_path(spec):
    """The stream's first gradient holds a NaN: no momentum existed before it, so what is kept is
    zero momentum (the host path discards the step); before the fix the resident path kept the
    NaN momentum, and every later payload of the stream decoded to NaN."""
    first = sample(30, 1000)
    first[3] = math.nan
    later = [sample(31 + i, 1000) for i in range(3)]
    host = build_codec(spec)
    device = resident(spec)
    for codec in (host, device):
        assert codec.encode(first, loss_scale=1.0).nonfinite
    for g in later:
        want = host.decode(host.encode(g))
        got = device.decode(device.encode(g))
        assert torch.isfinite(got).all(), spec
        # the same elements and values as the host path, which discarded the first round
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(device.residual(""), host.residual(""), atol=1e-6, rtol=0)


# ------------------------------------------------------------------- the audit
@pytest.mark.parametrize("spec", [*EVERY, "dgc:density=0.01+ef", "powersgd:rank=4+ef"])
def test_resident_encode_and_decode_read_nothing_on_the_host(spec):
    shape = (400, 250) if spec.startswith("powersgd") else (N,)
    x = sample(4).view(shape)
    codec = resident(spec)
    codec.encode(x)  # first call: streams, generators
    with audit_host_reads() as audit:
        for _ in range(2):
            payload = codec.encode(x)
            out = torch.empty_like(x)
            codec.decode(payload, out=out)
            peer = codec.payload_from_bytes(payload.data.clone(), shape, x.dtype)
            codec.decode(peer, out=out, accumulate=True)
    assert not audit.unexpected, audit.summary()


def test_codecs_without_a_device_version_still_work_when_resident():
    for spec in ["qrgc:density=0.01", "graddrop:threshold=1.5"]:
        codec = build_codec(spec)
        codec.set_resident(True)
        assert codec.resident and not codec.host_free
        x = sample(5)
        host = build_codec(spec)
        torch.testing.assert_close(codec.decode(codec.encode(x)), host.decode(host.encode(x)))


@pytest.mark.parametrize("spec", ["topk:density=0.01+ef", "powersgd:rank=2", "fp16"])
def test_resident_mode_is_chosen_once_at_build_or_before_the_first_encode(spec):
    from gradsync.sync.scheme import Scheme

    built = build_codec(spec, resident=True)
    assert built.resident
    via_scheme = Scheme.parse(f"allgather/{spec}" if "powersgd" not in spec else spec).build(resident=True)
    assert via_scheme is not None and via_scheme.resident
    codec = build_codec(spec)
    assert not codec.resident
    codec.set_resident(True)  # before any encode: still open
    codec.set_resident(False)
    x = sample(3, 4096).view(64, 64)
    codec.decode(codec.encode(x))
    codec.set_resident(False)  # the same choice again is fine
    with pytest.raises(RuntimeError, match="resident mode is chosen once"):
        codec.set_resident(True)
    assert not codec.resident


def test_a_front_chooses_resident_mode_once_for_all_its_codecs():
    from gradsync.sync.codec_set import CodecSet
    from gradsync.sync.config import SyncConfig
    from gradsync.sync.scheme import Scheme

    config = SyncConfig(scheme="allgather/topk:density=0.01", large_codec="onebit")
    codecs = CodecSet(config, Scheme.parse(config.scheme))  # built before the device is known
    assert codecs.resident is None and len(codecs) == 2
    assert codecs.choose_resident(torch.device("meta")) is True
    assert all(c.resident for c in codecs.codecs)
    assert codecs.choose_resident(torch.device("meta")) is True
    with pytest.raises(RuntimeError, match="resident mode is chosen once"):
        codecs.choose_resident(torch.device("cpu"))


def test_the_audit_sees_reads_on_the_host_and_names_the_line():
    x = torch.ones(4)
    with audit_host_reads() as audit:
        x.sum().item()
        torch.nonzero(x)
        torch.tensor([1.0, 2.0])
    ops = [r.op for r in audit.unexpected]
    assert ops == ["item", "nonzero", "tensor"], audit.summary()
    assert "test_resident.py" in audit.unexpected[0].where


# ------------------------------------------------------------------- the fronts, in a world
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(32, 256)
        self.b = nn.Linear(256, 256)
        self.c = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.relu(self.b(F.relu(self.a(x)))))


OPTS = {"calibrate": False, "log_plan": False, "replan": 0, "plan": "compress", "min_compress_bytes": 1024}
AUDITED = [
    "allgather/topk:density=0.05",
    "allgather/dgc:density=0.05+ef",
    "ring/chunktopk:density=0.05",
    "ps/onebit",
    "hitopk:density=0.05",
    "allgather/fp16",
    "fp16",
    "powersgd:rank=2",
    "allgather/tbq:threshold=0.01+ef",
]


def _steps(model, opt, n, seed=0):
    g = torch.Generator().manual_seed(seed + dist.get_rank())
    for _ in range(n):
        x = torch.randn(16, 32, generator=g)
        loss = F.cross_entropy(model(x), x[:, :8].argmax(1))
        opt.zero_grad()
        loss.backward()
        opt.step()


def check_every_scheme_runs_without_host_reads_in_wrap():
    with expect_all() as expect:
        for scheme in AUDITED:
            # two nodes of one rank: every scheme crosses a node (hitopk compresses only there)
            topo = gradsync.Topology(nodes=2, per_node=1)
            model = gradsync.wrap(Net(), scheme, topo, resident=True, check_overflow=True, **OPTS)
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            _steps(model, opt, 2)
            with audit_host_reads() as audit:
                _steps(model, opt, 2, seed=5)
            model.close()
            with expect(scheme):
                assert not audit.unexpected, audit.summary()
                assert "the step's flags" in {r.expected for r in audit.reads}, audit.summary()


def check_the_hook_runs_without_host_reads():
    with expect_all() as expect:
        for scheme in ["allgather/dgc:density=0.05+ef", "powersgd:rank=2", "fp16"]:
            net = Net()
            model = DDP(net, bucket_cap_mb=0.1)
            gradsync.register_comm_hook(
                model, scheme, resident=True, check_overflow=True, min_compress_bytes=1024
            )
            opt = torch.optim.SGD(model.parameters(), lr=0.05)
            _steps(model, opt, 2)
            with audit_host_reads() as audit:
                _steps(model, opt, 2, seed=5)
            with expect(f"hook {scheme}"):
                assert not audit.unexpected, audit.summary()


def check_resident_lossless_equals_ddp():
    ref, ours = DDP(Net()), gradsync.wrap(Net(), "none", resident=True, **OPTS)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, ours)]
    for m, o in zip((ref, ours), opts, strict=True):
        _steps(m, o, 3)
    for (n, a), b in zip(ref.module.named_parameters(), ours.module.parameters(), strict=True):
        torch.testing.assert_close(b, a, msg=n)
    ours.close()


def check_resident_topk_is_the_mean_of_each_ranks_top_k():
    """One tensor, one bucket: the synchronized gradient is the mean over the ranks of each
    rank's own top-k, computed here with torch.topk and a plain all-reduce."""
    torch.manual_seed(0)
    net = nn.Linear(128, 64, bias=False)
    ref = nn.Linear(128, 64, bias=False)
    ref.load_state_dict(net.state_dict())
    model = gradsync.wrap(net, "allgather/topk:k=300", resident=True, dense_warmup_steps=1, **OPTS)
    g = torch.Generator().manual_seed(dist.get_rank())
    for step in range(2):
        x = torch.randn(8, 128, generator=g)
        net.zero_grad()
        ref.zero_grad()
        model(x).square().sum().backward()
        ref(x).square().sum().backward()
        local = ref.weight.grad.view(-1)
        if step == 0:  # the dense warm-up step
            want = local.clone()
        else:
            want = torch.zeros_like(local)
            top = local.abs().topk(300).indices
            want[top] = local[top]
        dist.all_reduce(want)
        want /= dist.get_world_size()
        torch.testing.assert_close(net.weight.grad.view(-1), want, atol=1e-6, rtol=1e-5)
        with torch.no_grad():  # the same update on both copies
            ref.weight.copy_(net.weight - 0.1 * net.weight.grad)
            net.weight.copy_(ref.weight)
    model.close()


def check_fsdp_resident_runs_without_host_reads_and_agrees_with_the_host_path():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync.fsdp import compress_fsdp

    mesh = init_device_mesh("cpu", (2,))
    runs = {}
    for resident in (False, True):
        net = Net()
        for block in (net.a, net.b, net.c):
            fully_shard(block, mesh=mesh)
        fully_shard(net, mesh=mesh)
        compress_fsdp(net, "topk:density=0.05", min_compress_bytes=0, resident=resident)
        opt = torch.optim.SGD(net.parameters(), lr=0.05)
        _steps(net, opt, 2)
        with audit_host_reads() as audit:
            _steps(net, opt, 2, seed=5)
        if resident:
            assert not audit.unexpected, audit.summary()
        else:
            assert audit.unexpected, "the host path reads sizes (the audit must see them)"
        runs[resident] = torch.cat([p.full_tensor().reshape(-1) for p in net.parameters()])
    torch.testing.assert_close(runs[True], runs[False], atol=1e-5, rtol=1e-5)


def _world():
    run_checks(
        named_check(check_fsdp_resident_runs_without_host_reads_and_agrees_with_the_host_path),
        named_check(check_every_scheme_runs_without_host_reads_in_wrap),
        named_check(check_the_hook_runs_without_host_reads),
        named_check(check_resident_lossless_equals_ddp),
        named_check(check_resident_topk_is_the_mean_of_each_ranks_top_k),
    )


@pytest.mark.timeout(600)
def test_resident_fronts_in_a_world():
    run_world(2, _world)


def test_resident_none_passes_an_integer_tensor_without_a_host_read():
    codec = resident("none")
    x = torch.arange(1000, dtype=torch.int64)
    with audit_host_reads() as audit:
        payload = codec.encode(x)
        out = codec.decode(payload)
    assert not audit.unexpected, audit.summary()
    assert torch.equal(out, x) and not payload.nonfinite
