"""gradsync in the training scripts people already have, written the way the PyTorch docs write
them: DDP with DistributedSampler and a DataLoader, ``no_sync`` accumulation, ``static_graph``,
``find_unused_parameters``, small ``bucket_cap_mb``, a hook made before the process group,
half-precision models, ranks out of step, uneven inputs under ``Join``; on a GRU text
classifier, a model unlike the project's own. References are plain DDP and PyTorch's own fp16
hook in the same script, plain all-reduces, or values written out here.

Each world runs many checks and reports every failed one (spawning is the slow part).
"""

from __future__ import annotations

import copy
import datetime
import logging
import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gradsync
from gradsync.collectives import MismatchError, Topology, allreduce, compressed_allreduce
from gradsync.integrate.engine_failure import SyncError
from gradsync.sync.sequence import OutOfStepError
from worlds import expect_all, init_world, named_check, run_checks, run_world, same_on_every_rank

pytestmark = pytest.mark.timeout(600)

FAST = {"calibrate": False, "log_plan": False}


# ------------------------------------------------------------------------------ model and data
class GRUClassifier(nn.Module):
    """Tokens -> embedding -> GRU -> class; ``use_aux=False`` leaves ``aux`` unused."""

    def __init__(self, vocab=48, emb=16, hidden=24, classes=3, sparse=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, emb, sparse=sparse)
        self.gru = nn.GRU(emb, hidden, batch_first=True)
        self.head = nn.Linear(hidden, classes)
        self.aux = nn.Linear(hidden, classes)

    def forward(self, tokens, use_aux=True):
        _, h = self.gru(self.embed(tokens))
        logits = self.head(h[-1])
        return logits + self.aux(h[-1]) if use_aux else logits


def text_dataset(n=96, length=10, vocab=48, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, length), generator=g)
    labels = (tokens < vocab // 3).sum(1) % 3  # learnable from the tokens
    return TensorDataset(tokens, labels)


def fresh_model(seed=0, **kw):
    torch.manual_seed(seed)
    return GRUClassifier(**kw)


def ddp_script(make_ddp, epochs=2, accumulate=1, aux=None, batch_size=8):
    """The PyTorch DDP tutorial's loop; ``make_ddp(model)`` returns the DDP model to train.
    ``aux(step)`` says whether this rank uses the aux head at a step (unused parameters)."""
    data = text_dataset()
    sampler = DistributedSampler(data, shuffle=True, seed=7)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    model = make_ddp(fresh_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            use = bool(aux(step)) if aux else True
            if accumulate > 1 and (i + 1) % accumulate:
                with model.no_sync():
                    loss_fn(model(x, use_aux=use), y).backward()
                continue
            loss_fn(model(x, use_aux=use), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
    return model


def params_of(model):
    m = model.module if hasattr(model, "module") else model
    return [p.detach().clone() for p in m.parameters()]


def hooked(spec, opts=None, **ddp_kw):
    """DDP with gradsync's hook registered, made the usual way (``opts``: gradsync options)."""

    def make(model):
        ddp = DDP(model, **ddp_kw)
        # as the docs say: the hook is told what DDP does with unused parameters
        unused = {"find_unused_parameters": True} if ddp_kw.get("find_unused_parameters") else {}
        state, hook = gradsync.ddp_comm_hook(spec, model=model, **unused, **(opts or {}))
        ddp.register_comm_hook(state, hook)
        ddp._gradsync_state = state
        return ddp

    return make


def torch_hook(hook, **ddp_kw):
    def make(model):
        ddp = DDP(model, **ddp_kw)
        ddp.register_comm_hook(None, hook)
        return ddp

    return make


# ---------------------------------------------------------------------------- 1. DDP scripts
SCRIPT_SETUPS = {
    "plain": ({}, {}),
    "find_unused_parameters": (
        {"find_unused_parameters": True},
        {"aux": lambda s: (s + dist.get_rank()) % 2},
    ),
    "static_graph": ({"static_graph": True}, {}),
    "no_sync accumulation": ({}, {"accumulate": 2}),
    "bucket rebuild (bucket_cap_mb=0.002)": ({"bucket_cap_mb": 0.002}, {}),
}


def check_none_hook_is_ddp_bit_for_bit():
    with expect_all() as expect:
        for name, (ddp_kw, script_kw) in SCRIPT_SETUPS.items():
            ref = params_of(ddp_script(lambda m, kw=ddp_kw: DDP(m, **kw), **script_kw))
            ours = ddp_script(hooked("none", **ddp_kw), **script_kw)
            ours._gradsync_state.close()
            with expect(name):
                assert ours._gradsync_state.step > 0
                for a, b in zip(ref, params_of(ours), strict=True):
                    assert torch.equal(a, b), f"differs from DDP by {float((a - b).abs().max())}"


def check_fp16_hook_matches_pytorch_fp16_hook():
    with expect_all() as expect:
        for name, (ddp_kw, script_kw) in SCRIPT_SETUPS.items():
            ref = params_of(ddp_script(torch_hook(default_hooks.fp16_compress_hook, **ddp_kw), **script_kw))
            ours = ddp_script(hooked("fp16", **ddp_kw), **script_kw)
            ours._gradsync_state.close()
            with expect(name):
                for a, b in zip(ref, params_of(ours), strict=True):
                    # both round every gradient to float16 once; gradsync scales by a power of two first
                    torch.testing.assert_close(b, a, rtol=2e-3, atol=2e-3)


def check_compressed_hooks_in_every_setup():
    """No crash, no hang, the same model on every rank, finite, at least 3 steps (2 epochs: 6
    steps, 3 with no_sync accumulation)."""
    with expect_all() as expect:
        for spec in ("topk:density=0.05+ef", "powersgd:rank=2", "onebit", "hitopk:density=0.1"):
            for name, (ddp_kw, script_kw) in SCRIPT_SETUPS.items():
                opts = {"min_compress_bytes": 0, "topology": Topology(nodes=2, per_node=1)}
                model = ddp_script(hooked(spec, opts, **ddp_kw), **script_kw)
                model._gradsync_state.close()
                with expect(f"{spec} / {name}"):
                    same_on_every_rank(params_of(model), "parameters")
                    assert all(torch.isfinite(p).all() for p in params_of(model))
                    assert model._gradsync_state.step >= 3


def check_wrap_in_the_same_script():
    """gradsync.wrap in place of DDP: no_sync, find_unused_parameters, against DDP."""
    with expect_all() as expect:
        for name, (ddp_kw, script_kw) in SCRIPT_SETUPS.items():
            if "static" in name or "bucket" in name:
                continue
            opts = {"find_unused_parameters": bool(ddp_kw.get("find_unused_parameters")), **FAST}
            ref = params_of(ddp_script(lambda m, kw=ddp_kw: DDP(m, **kw), **script_kw))
            ours = ddp_script(lambda m, o=opts: gradsync.wrap(m, "none", **o), **script_kw)
            ours.close()
            with expect(name):
                for a, b in zip(ref, params_of(ours), strict=True):
                    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def scripts_world():
    run_checks(
        check_none_hook_is_ddp_bit_for_bit,
        check_fp16_hook_matches_pytorch_fp16_hook,
        check_compressed_hooks_in_every_setup,
        check_wrap_in_the_same_script,
    )


def test_ddp_scripts_with_gradsync_hooks():
    run_world(2, scripts_world)


# ------------------------------------------------------------- 2. made before the process group
def check_hook_made_before_the_process_group(state, hook, topo_early):
    rank = dist.get_rank()
    with expect_all() as expect:
        with expect("nothing bound yet: no world size frozen"):
            assert state.topo is None
        ref = ddp_script(lambda m: DDP(m), epochs=3)

        def make(model):
            ddp = DDP(model)
            ddp.register_comm_hook(state, hook)
            return ddp

        ours = ddp_script(make, epochs=3)
        state.close()
        with expect("bound at its first call, equal to DDP"):
            same_on_every_rank(params_of(ours), "hook made before init_process_group")
            assert state.topo is not None and state.topo.world == 2 and state.step > 0
            for a, b in zip(params_of(ref), params_of(ours), strict=True):
                assert torch.equal(a, b)
        # a Topology made before the process group is rebuilt for it when wrap() gets it
        model = gradsync.wrap(fresh_model(), "torus2d", topo_early, **FAST)
        with expect("the early Topology rebuilt"):
            assert (topo_early.world, topo_early.rank) == (2, rank)
        x, y = text_dataset()[rank * 8 : rank * 8 + 8]
        nn.functional.cross_entropy(model(x), y).backward()
        model.close()


def check_wrap_made_before_the_process_group_refuses(early):
    x, y = text_dataset()[:8]
    with pytest.raises(RuntimeError, match=r"wrapped before torch.distributed.init_process_group"):
        nn.functional.cross_entropy(early(x), y).backward()


def before_pg_world():
    state, hook = gradsync.ddp_comm_hook("none")  # Lightning's order: the hook first
    topo_early = Topology()
    early = gradsync.wrap(fresh_model(), "none")
    init_world()
    run_checks(
        named_check(check_hook_made_before_the_process_group, state, hook, topo_early),
        named_check(check_wrap_made_before_the_process_group_refuses, early),
    )


def test_hooks_and_topologies_made_before_the_process_group():
    run_world(2, before_pg_world, init=False)


# ---------------------------------------------------------------------- 3. half precision
HALF_SCHEMES = (
    "none", "torus2d/bf16", "hitopk:density=0.05", "allgather/topk:density=0.05", "ring/topk:density=0.1",
    "allgather/mstopk:density=0.05", "allgather/dgc:density=0.05", "allgather/trimmed_topk:density=0.05",
    "allgather/bsearch:density=0.05", "allgather/qrgc:density=0.05", "allgather/graddrop:density=0.05",
    "allgather/randomk:density=0.5", "ps/onebit", "ring/onebit", "ps/tbq:threshold=0.01", "ps/terngrad",
    "powersgd:rank=2", "ps/fp16", "ring/bf16",
)  # fmt: skip


class Mixed(nn.Module):
    """One parameter of each floating dtype."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(16, 32).double()
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 32).to(torch.bfloat16)
        self.d = nn.Linear(32, 4).half()

    def forward(self, x):
        h = self.a(x.double()).relu().float()
        h = self.b(h).relu().to(torch.bfloat16)
        h = self.c(h).relu().half()
        return self.d(h).float()


def half_models():
    def mlp(dtype):
        torch.manual_seed(2)
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(dtype)

    return {"bfloat16": lambda: mlp(torch.bfloat16), "float16": lambda: mlp(torch.float16), "mixed": Mixed}


def check_every_scheme_on_half_precision_models():
    """Every codec and strategy on bf16, fp16 and mixed-dtype models: runs, leaves identical
    gradients on every rank, and the lossless ones equal a plain all-reduce in the same dtype."""
    rank = dist.get_rank()
    topo = Topology(nodes=2, per_node=1)
    problems = []  # errors (not failed assertions) of a model and scheme
    with expect_all() as expect:
        for label, make in half_models().items():
            for scheme in HALF_SCHEMES:
                model = gradsync.wrap(make(), scheme, topo, plan="compress", min_compress_bytes=0, **FAST)
                ref = copy.deepcopy(model.module)
                try:
                    for step in range(3):
                        torch.manual_seed(100 * step + rank)
                        x = torch.randn(8, 16).to(next(ref.parameters()).dtype)  # Mixed casts for itself
                        for m in (model, ref):
                            m.zero_grad()
                            m(x).float().square().mean().backward()
                    grads = [p.grad for p in model.module.parameters()]
                    lossless = scheme in ("none", "ps/fp16", "ring/bf16", "torus2d/bf16")
                    wants = [p.grad.double() for p in ref.parameters()] if lossless else []
                    for want in wants:
                        dist.all_reduce(want)
                    with expect(f"{label} {scheme}"):
                        same_on_every_rank(grads, "gradients")
                        assert model.last_stats is not None and not model.last_stats.dense
                        params = list(model.module.parameters())
                        assert all(g.dtype == p.dtype for g, p in zip(grads, params, strict=True))
                        for g, p, want in zip(grads, ref.parameters(), wants, strict=False):
                            half = p.dtype in (torch.bfloat16, torch.float16) or "16" in scheme
                            tol = 2e-2 if half else 1e-6
                            torch.testing.assert_close(g.double(), want / 2, rtol=tol, atol=tol)
                except Exception as e:
                    problems.append(f"{label} {scheme}: {type(e).__name__}: {e}")
                finally:
                    model.close()
        assert not problems, "\n".join(problems)


def check_hooks_on_half_precision_models():
    rank = dist.get_rank()
    with expect_all() as expect:
        for label, make in half_models().items():
            for spec in ("topk:density=0.05", "powersgd:rank=2", "hitopk:density=0.1", "ps/onebit", "fp16"):
                inner = make()
                model = DDP(inner, bucket_cap_mb=0.01)
                opts = {"min_compress_bytes": 0, "topology": Topology(nodes=2, per_node=1)}
                state = gradsync.register_comm_hook(model, spec, **opts)
                for step in range(3):
                    torch.manual_seed(100 * step + rank)
                    model.zero_grad()
                    model(
                        torch.randn(8, 16).to(next(inner.parameters()).dtype)
                    ).float().square().mean().backward()
                state.close()
                grads = [p.grad for p in inner.parameters()]
                with expect(f"hook {label} {spec}"):
                    same_on_every_rank(grads, "gradients")
                    assert all(g.dtype == p.dtype for g, p in zip(grads, inner.parameters(), strict=True))


def check_half_precision_trains_like_fp32_ddp():
    """Loose: bf16 training with compression reaches where fp32 DDP gets in the same steps."""
    rank = dist.get_rank()
    topo = Topology(nodes=2, per_node=1)

    def train(model, steps=60):
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(32, 16, generator=g)
            y = x[:, :4].argmax(1)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x.to(next(model.parameters()).dtype)).float(), y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        last = torch.tensor([sum(losses[-5:]) / 5])
        dist.all_reduce(last)
        return float(last) / 2

    def mlp(dtype):
        torch.manual_seed(4)
        return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)).to(dtype)

    ref = train(DDP(mlp(torch.float32)))
    worse = {}
    for scheme in (
        "hitopk:density=0.05",
        "ring/topk:density=0.1",
        "powersgd:rank=2",
        "ps/onebit",
        "dgc:density=0.05",
    ):
        model = gradsync.wrap(
            mlp(torch.bfloat16), scheme, topo, plan="compress", min_compress_bytes=0, **FAST
        )
        loss = train(model)
        model.close()
        if not loss < ref + 0.3:
            worse[scheme] = loss
    assert ref < 0.5 and not worse, (ref, worse)


def half_world():
    run_checks(
        check_every_scheme_on_half_precision_models,
        check_hooks_on_half_precision_models,
        check_half_precision_trains_like_fp32_ddp,
    )


def test_half_precision_models_with_every_scheme():
    run_world(2, half_world)


# ---------------------------------------------------------- 4. out of step, bad input, silence
def mlp_model(seed=0, width=32):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, 4))


def check_ranks_out_of_step_are_named_on_every_rank():
    """A forward pass without its backward is no error (DDP trains on; tests/test_wrap_like_ddp.py),
    but ranks whose synchronizing steps differ are: under wrap, a rank that accumulated one more
    micro-batch under no_sync(); under the hook, ranks resumed from checkpoints of different
    iterations. Every rank raises, naming each rank's numbers."""
    rank = dist.get_rank()
    for how in ("wrap", "hook"):
        if how == "wrap":
            model = gradsync.wrap(mlp_model(), "none", **FAST)
            named = r"out of step \(rank 0: step 2, 3 backward passes; rank 1: step 2, 4 backward passes\)"
        else:
            inner = mlp_model()
            model = DDP(inner)
            state, hook = gradsync.ddp_comm_hook("none", model=inner)
            model.register_comm_hook(state, hook)
            named = r"out of step \(rank 0: step 1, 1 backward passes; rank 1: step 2, 2 backward passes\)"
        # DDP hands a hook's error on as a RuntimeError with the same message
        with pytest.raises(OutOfStepError if how == "wrap" else RuntimeError, match=named):
            saved = []
            for step in range(4):
                if how == "wrap" and rank == 1 and step == 2:
                    with model.no_sync():  # one more micro-batch on this rank only
                        model(torch.randn(8, 16)).square().mean().backward()
                model(torch.randn(8, 16)).square().mean().backward()
                if how == "hook":
                    saved.append(state.state_dict())
                    if step == 1:  # rank 0 resumes from iteration 1, rank 1 from iteration 2
                        state.load_state_dict(saved[rank])
        if how == "wrap":
            # the failure sticks: the next step says what happened, not a raw transport error
            with pytest.raises(SyncError, match=r"failed earlier .*out of step"):
                model(torch.randn(8, 16)).square().mean().backward()
            model.close()
        else:
            state.close()  # DDP itself cannot go on after a failed backward pass


def check_different_operations_raise_mismatch():
    rank = dist.get_rank()
    topo = Topology()
    with pytest.raises(
        MismatchError, match=r"different operations: rank 0=allreduce\(.*rank 1=compressed_allreduce"
    ):
        if rank == 0:
            allreduce(torch.ones(10), topo)
        else:
            compressed_allreduce(torch.ones(10), topo, gradsync.build_codec("topk:k=2"))


def check_model_mismatch_names_the_parameter():
    rank = dist.get_rank()
    with pytest.raises(
        MismatchError, match=r"parameter 0: rank 0 has '0.weight \(32, 16\).*rank 1 has '0.weight \(16, 16\)"
    ):
        gradsync.wrap(mlp_model(width=32) if rank == 0 else mlp_model(width=16), "none", **FAST)
    extra = nn.Sequential(mlp_model(), nn.Linear(4, 4)) if rank == 1 else nn.Sequential(mlp_model())
    with pytest.raises(MismatchError, match=r"rank 1 has an extra parameter '1.weight"):
        gradsync.wrap(extra, "none", **FAST)


def check_bad_input_fails_on_every_rank_before_any_collective():
    # sparse embeddings: refused at wrap and at hook creation, naming the module
    with pytest.raises(ValueError, match=r"embed \(Embedding\) use sparse=True"):
        gradsync.wrap(fresh_model(sparse=True), "none", **FAST)
    with pytest.raises(ValueError, match=r"embed \(Embedding\) use sparse=True"):
        gradsync.ddp_comm_hook("none", model=fresh_model(sparse=True))
    # k larger than anything this model can give the codec: at wrap, on every rank
    with pytest.raises(ValueError, match=r"topk: k=100000 exceeds .* elements.*use a density instead of k"):
        gradsync.wrap(mlp_model(), "allgather/topk:k=100000", min_compress_bytes=0, **FAST)
    # a bad option on one rank only: every rank raises, naming it
    rank = dist.get_rank()
    with pytest.raises(
        MismatchError, match=r"rank 1=.invalid: sync: plan must be one of auto, compress, dense"
    ):
        gradsync.ddp_comm_hook("none", model=mlp_model(), plan="auto" if rank == 0 else "always")


def capture_plan_report(model_fn, scheme, steps=2, **opts):
    """Train ``steps`` steps; return (gradsync log records, warnings) of this rank."""
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("gradsync")
    logger.addHandler(handler)
    old = logger.level
    logger.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = gradsync.wrap(model_fn(), scheme, **opts)
            for _ in range(steps):
                model(torch.randn(8, 16)).square().mean().backward()
            model.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
    return [r.getMessage() for r in records if r.levelno >= logging.INFO], [str(w.message) for w in caught]


def check_compression_never_silently_off():
    rank = dist.get_rank()
    with expect_all() as expect:
        # min_compress_bytes excludes every tensor of a small MLP
        logs, warned = capture_plan_report(mlp_model, "topk:density=0.1", plan="compress", calibrate=False)
        with expect("every tensor below min_compress_bytes"):
            assert any(
                "compresses nothing" in w and "smaller than min_compress_bytes=65536" in w for w in warned
            ), warned
            assert any("lower min_compress_bytes" in w for w in warned)
            if rank == 0:
                assert len(logs) == 1 and "compressing 0 of 4 tensors" in logs[0], logs
            else:
                assert logs == []  # one line, on rank 0
        # the cost model declines: said with the reason and what to do
        _, warned = capture_plan_report(
            lambda: mlp_model(width=256), "topk:density=0.5", min_compress_bytes=0, plan="auto",
            calibrate=False, dense_algorithm="flat",
        )  # fmt: skip
        with expect("the cost model declines"):
            declined = [w for w in warned if "compresses nothing" in w]
            assert declined and "the cost model predicts dense synchronization faster" in declined[0], warned
            assert "pass plan='compress'" in declined[0]
        # hitopk on one node compresses nothing (nothing crosses a node)
        _, warned = capture_plan_report(
            mlp_model, "hitopk:density=0.1", plan="compress", min_compress_bytes=0, calibrate=False,
            topology=Topology(nodes=1, per_node=2),
        )  # fmt: skip
        with expect("hitopk on one node"):
            assert any("one node" in w for w in warned), warned
        # a compressing plan is logged with what it compresses
        logs, warned = capture_plan_report(
            mlp_model, "topk:density=0.1", plan="compress", min_compress_bytes=0
        )
        with expect("a compressing plan"):
            assert not any("compresses nothing" in w for w in warned)
            if rank == 0:
                assert len(logs) == 1 and "compressing 4 of 4 tensors" in logs[0]
                assert "topk:density=0.1+ef" in logs[0]


def check_hook_says_what_it_compresses():
    """The DDP hook reports after its first compressed iteration, like wrap's plan."""
    rank = dist.get_rank()
    with expect_all() as expect:
        for spec, opts, warning in (
            ("topk:density=0.1", {}, "compresses nothing"),  # every bucket below min_compress_bytes
            ("allgather/topk:k=6000", {"min_compress_bytes": 0}, "topk: k=6000 exceeds the tensor's"),
            ("topk:density=0.1", {"min_compress_bytes": 0}, None),
        ):
            records = []
            handler = logging.Handler()
            handler.emit = records.append
            logger = logging.getLogger("gradsync")
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    inner = nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 4))
                    model = DDP(inner, bucket_cap_mb=0.01)
                    state = gradsync.register_comm_hook(model, spec, **opts)
                    for _ in range(3):
                        model(torch.randn(8, 16)).square().mean().backward()
                    state.close()
            finally:
                logger.removeHandler(handler)
            with expect(f"{spec} {opts}"):
                said = [str(w.message) for w in caught if "gradsync" in str(w.message)]
                if warning is None:
                    assert not said, said
                else:
                    assert any(warning in w for w in said), said
                lines = [r.getMessage() for r in records if r.getMessage().startswith("gradsync DDP hook")]
                assert len(lines) == (1 if rank == 0 else 0), lines
                if rank == 0 and warning is None:
                    assert re.search(r"compressing (\d+) of \1 DDP buckets", lines[0]), lines


def check_powersgd_reports_what_it_sends_dense():
    torch.manual_seed(0)
    model_fn = lambda: nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 3))  # noqa: E731
    _, warned = capture_plan_report(
        model_fn, "powersgd:rank=4", plan="compress", min_compress_bytes=0, **FAST
    )
    assert any(
        "plan='compress' asked to compress every tensor" in w
        and "PowerSGD rank 4 gains nothing on a (3, 64) matrix" in w
        for w in warned
    ), warned


def check_powersgd_factors_stay_finite_after_an_overflow():
    rank = dist.get_rank()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    model = gradsync.wrap(mlp_model(width=64), "powersgd:rank=2", grad_scaler=scaler, plan="compress",
                          min_compress_bytes=0, **FAST)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    inject = {"on": False}
    if rank == 1:
        model.module[0].weight.register_hook(
            lambda g: torch.full_like(g, float("inf")) if inject["on"] else g
        )
    with expect_all() as expect:
        for step in range(4):
            inject["on"] = step == 2
            opt.zero_grad()
            scaler.scale(model(torch.randn(8, 16)).square().mean()).backward()
            scaler.step(opt)
            scaler.update()
            with expect(f"step {step}"):
                assert model.last_stats.overflow == (step == 2)
                for stream in model.sync_state_dict()["codecs"][0]["codec"]["streams"].values():
                    for name in ("p", "q"):
                        if stream.get(name) is not None:
                            assert torch.isfinite(stream[name]).all(), name
    model.close()


def errors_world():
    run_checks(
        check_ranks_out_of_step_are_named_on_every_rank,
        check_different_operations_raise_mismatch,
        check_model_mismatch_names_the_parameter,
        check_bad_input_fails_on_every_rank_before_any_collective,
        check_compression_never_silently_off,
        check_hook_says_what_it_compresses,
        check_powersgd_reports_what_it_sends_dense,
        check_powersgd_factors_stay_finite_after_an_overflow,
    )


def test_out_of_step_bad_input_and_silent_compression_are_named():
    run_world(2, errors_world)


# ---------------------------------------------------------------------------- 5. uneven inputs
def uneven_script(make, batches, join_kw=None):
    """Every rank trains on its own number of batches, inside Join when ``join_kw`` is given."""
    rank = dist.get_rank()
    model = make(fresh_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    data = text_dataset()
    ctx = Join([model], **join_kw) if join_kw is not None else None
    if ctx is not None:
        ctx.__enter__()
    try:
        for i in range(batches[rank]):
            x, y = data[8 * i + 40 * rank : 8 * i + 40 * rank + 8]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)
    return model


def check_join_trains_uneven_inputs_like_ddp():
    batches = [2, 4]
    with expect_all() as expect:
        for divide in (True, False):
            kw = {"divide_by_initial_world_size": divide}
            ref = params_of(uneven_script(lambda m: DDP(m), batches, kw))
            for name, make in (
                ("wrap none", lambda m: gradsync.wrap(m, "none", **FAST)),
                ("hook none", hooked("none")),
            ):
                if name.startswith("hook") and not divide:
                    continue  # DDP divides the hook's result itself only in its default mode
                got = params_of(uneven_script(make, batches, kw))
                with expect(f"Join {name} divide={divide}"):
                    same_on_every_rank(got, "parameters")
                    for a, b in zip(ref, got, strict=True):
                        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        # compressed, through both paths: runs to the end, one model everywhere
        compressed = {"plan": "compress", "min_compress_bytes": 0, **FAST}
        for name, make in (
            ("wrap topk", lambda m: gradsync.wrap(m, "topk:density=0.2", **compressed)),
            ("hook powersgd", hooked("powersgd:rank=2", {"min_compress_bytes": 0})),
        ):
            model = uneven_script(make, [3, 5], {})
            with expect(f"Join compressed, {name}"):
                same_on_every_rank(params_of(model), "parameters")


def check_uneven_inputs_without_join_say_so():
    rank = dist.get_rank()
    topo = Topology(timeout=datetime.timedelta(seconds=3))
    model = gradsync.wrap(fresh_model(), "none", topo, **FAST)
    if rank == 1:
        with pytest.raises(SyncError, match=r"ran out of data.*uneven inputs.*Join\(\[model\]\)"):
            uneven_script(lambda m: model, [2, 3])
    else:
        uneven_script(lambda m: model, [2, 3])


def uneven_world():
    run_checks(check_join_trains_uneven_inputs_like_ddp, check_uneven_inputs_without_join_say_so)


def test_uneven_inputs():
    run_world(2, uneven_world)


def _dense_algorithm_world():
    """The hook's dense iterations run the dense_algorithm asked for: flat over the world,
    hierarchical and torus2d per level (2 x 2 ranks), seen in the bytes each level carried."""
    levels = {}
    for algorithm in ("flat", "hierarchical", "torus2d"):
        opts = {"min_compress_bytes": 0, "dense_warmup_steps": 2, "dense_algorithm": algorithm,
                "topology": Topology(nodes=2, per_node=2)}  # fmt: skip
        model = ddp_script(hooked("topk:density=0.1", opts), epochs=1, batch_size=48)  # 2 dense steps
        state = model._gradsync_state
        levels[algorithm] = {k for k, v in state.manager.take_traffic().items() if v}
        state.close()
    # every algorithm's set includes "world": the step check and flags are world all-reduces
    with expect_all() as expect, expect("levels per dense algorithm"):
        assert levels["flat"] == {"world"}, levels
        assert "intra" in levels["hierarchical"], levels
        assert {"intra", "inter"} <= levels["torus2d"], levels


def test_the_hook_runs_the_dense_algorithm_asked_for():
    run_world(4, _dense_algorithm_world)
