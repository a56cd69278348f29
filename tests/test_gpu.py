"""The GPU tier: gradsync with CUDA tensors, end to end. Without CUDA every test here skips (the CPU
paths of the same calls are tested in test_sync_engine, test_real_clients and test_train); on a
GPU machine run them with ``pytest tests/test_gpu.py`` (or the whole suite).

- NCCL, one rank per GPU (a world of one rank on any GPU machine, of two where there are two):
  ``gradsync.wrap`` and the DDP comm hook against plain DDP on the same GPUs for the lossless
  scheme ``none``; the lossy schemes leave finite gradients, identical on every rank (and, with
  one rank, nothing to synchronize: the local gradients); fp16 autocast with a CUDA GradScaler.
- gloo, two ranks sharing ``cuda:0``: the model and its gradients on the GPU, the collectives on
  gloo (gradsync stages them through the CPU): the same checks, against plain all-reduces of
  the gradients on the CPU too, the compressed paths at density 1 against the exact mean, and
  the planner timing its codecs on the gradients' device (cuda).
- ``gradsync train`` for one epoch, on ``cuda:0`` (and ``cuda:1``), plain and with ``--amp``.

The world functions take the device type, so the same code runs on the CPU (how it was written:
``run_world(2, gloo_world, "cpu")``).
"""

from __future__ import annotations

import copy
import inspect
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
from gradsync.apps.commands import main
from gradsync.collectives import Topology
from worlds import expect_all, named_check, run_checks, run_world, same_on_every_rank

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0

pytestmark = [
    pytest.mark.skipif(
        GPUS == 0,
        reason="needs CUDA: the GPU tier runs wrap, the DDP hook and gradsync train on a GPU "
        "(torch.cuda.is_available() is False here)",
    ),
    pytest.mark.timeout(600),
]

FAST = {"calibrate": False, "log_plan": False}  # no link sweep: nothing here measures links
STEPS = 4
# wrap: sparse (flat, ring and hierarchical), quantized, low-rank, dense in fp16
LOSSY = (
    "hitopk:density=0.1",
    "allgather/topk:density=0.1",
    "ring/topk:density=0.1",
    "ps/onebit",
    "powersgd:rank=2",
    "torus2d/fp16",
)
HOOK_LOSSY = ("topk:density=0.1", "hitopk:density=0.1", "ps/onebit", "powersgd:rank=2", "fp16")
# compressed paths that lose nothing: density 1 (exact top-k of everything, no residual)
EXACT = ("allgather/topk:density=1.0", "hitopk/topk:density=1.0", "ring/topk:density=1.0")


# --------------------------------------------------------------------------------- helpers
def mlp(seed=0, width=64):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 4)
    )


def batch(step, rank, device, n=32):
    """A separable problem (the class is the argmax of the first 4 features), made on the CPU."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 16, generator=g)
    return x.to(device), x[:, :4].argmax(1).to(device)


def device_of(device_type):
    """This rank's device: its current GPU, or the CPU (the same code checked without a GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")


def ddp(module, device):
    return DDP(module, device_ids=[device.index] if device.type == "cuda" else None)


def train(model, device, steps=STEPS, start=0):
    """SGD on this rank's batches (from step ``start``); the gradients of the last step."""
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(start, start + steps):
        x, y = batch(step, rank, device)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.grad.detach().clone() for p in model.parameters()]


def local_grads(base, device, steps=STEPS):
    """The gradients of a model trained alone on this rank's batches (a world of one rank)."""
    model = copy.deepcopy(base).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = batch(step, 0, device)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return [p.grad.detach().clone() for p in model.parameters()]


def on_device_and_finite(grads, device):
    for g in grads:
        assert g.device == device, f"a gradient on {g.device}, not {device}"
        assert torch.isfinite(g).all(), "a non-finite gradient"


def topology():
    """One emulated node per rank: compressed schemes compress between every pair of ranks."""
    return Topology(nodes=dist.get_world_size(), per_node=1)


# -------------------------------------------------------------------------- lossless: none
def check_none_equals_ddp(device):
    """wrap(model, "none") and gradsync's "none" hook give DDP's gradients at every step."""
    base = mlp(seed=1)
    topo = topology()
    with expect_all() as expect:
        for how in ("wrap", "hook"):
            ref = ddp(copy.deepcopy(base).to(device), device)
            if how == "wrap":
                ours = gradsync.wrap(copy.deepcopy(base).to(device), "none", topo, **FAST)
                state = ours
            else:
                ours = ddp(copy.deepcopy(base).to(device), device)
                state = gradsync.register_comm_hook(ours, "none", topo)
            opt_a = torch.optim.SGD(ref.parameters(), lr=0.1)
            opt_b = torch.optim.SGD(ours.parameters(), lr=0.1)
            for step in range(STEPS):
                x, y = batch(step, dist.get_rank(), device)
                for model, opt in ((ref, opt_a), (ours, opt_b)):
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                with expect(f"{how} none, step {step}"):
                    grads = [p.grad for p in ours.parameters()]
                    on_device_and_finite(grads, device)
                    for a, b in zip(ref.parameters(), grads, strict=True):
                        torch.testing.assert_close(b, a.grad)
                opt_a.step()
                opt_b.step()
            state.close()


def check_none_equals_an_all_reduce_on_the_cpu(device):
    """The reference without DDP: every rank's local gradients (computed on the same device, by
    the same kernels), all-reduced on the CPU (gloo)."""
    base = mlp(seed=2)
    world = dist.get_world_size()
    model = gradsync.wrap(copy.deepcopy(base).to(device), "none", topology(), **FAST)
    ref = copy.deepcopy(base).to(device)  # not synchronized
    with expect_all() as expect:
        for step in range(STEPS):
            x, y = batch(step, dist.get_rank(), device)
            for m in (model, ref):
                m.zero_grad()
                nn.functional.cross_entropy(m(x), y).backward()
            want = [p.grad.cpu() for p in ref.parameters()]
            for w in want:
                dist.all_reduce(w)
            with expect(f"step {step}"):
                for p, w in zip(model.parameters(), want, strict=True):
                    assert p.grad.device == device
                    torch.testing.assert_close(p.grad.cpu(), w / world, rtol=1e-5, atol=1e-6)
        model.close()


def check_exact_compressed_paths_equal_the_mean(device):
    """Top-k of everything through each compressed path: the mean of the local gradients."""
    base = mlp(seed=3)
    world = dist.get_world_size()
    with expect_all() as expect:
        for scheme in EXACT:
            model = gradsync.wrap(copy.deepcopy(base).to(device), scheme, topology(), plan="compress",
                                  min_compress_bytes=0, **FAST)  # fmt: skip
            ref = copy.deepcopy(base).to(device)  # not synchronized
            for step in range(2):
                x, y = batch(step, dist.get_rank(), device)
                for m in (model, ref):
                    m.zero_grad()
                    nn.functional.cross_entropy(m(x), y).backward()
                want = [p.grad.cpu() for p in ref.parameters()]
                for w in want:
                    dist.all_reduce(w)
                with expect(f"{scheme}, step {step}"):
                    assert step == 0 or not model.last_stats.dense  # step 0 is dense (the plan follows it)
                    for p, w in zip(model.parameters(), want, strict=True):
                        assert p.grad.device == device
                        torch.testing.assert_close(p.grad.cpu(), w / world, rtol=1e-5, atol=1e-6)
            model.close()


# ------------------------------------------------------------------------------------ lossy
def check_lossy_schemes_with_wrap(device):
    """Finite gradients on the GPU, identical on every rank, buckets compressed; with one rank
    nothing is synchronized: the local gradients."""
    base = mlp(seed=4)
    world = dist.get_world_size()
    alone = local_grads(base, device) if world == 1 else None
    with expect_all() as expect:
        for scheme in LOSSY:
            model = gradsync.wrap(copy.deepcopy(base).to(device), scheme, topology(), plan="compress",
                                  min_compress_bytes=0, **FAST)  # fmt: skip
            grads = train(model, device)
            model.close()
            with expect(scheme):
                same_on_every_rank(grads, "gradients")
                on_device_and_finite(grads, device)
                assert all(torch.isfinite(p).all() for p in model.parameters())
                if world == 1:
                    for g, a in zip(grads, alone, strict=True):
                        torch.testing.assert_close(g, a)
                else:  # compressed where the scheme compresses (torus2d/fp16 is dense, in fp16)
                    s = model.last_stats
                    compressed = gradsync.sync.Scheme.parse(scheme).kind == "compressed"
                    assert not s.dense and s.compressed_buckets == (s.buckets if compressed else 0), s


def check_lossy_schemes_with_the_hook(device):
    base = mlp(seed=5)
    world = dist.get_world_size()
    alone = local_grads(base, device) if world == 1 else None
    with expect_all() as expect:
        for spec in HOOK_LOSSY:
            model = ddp(copy.deepcopy(base).to(device), device)
            state = gradsync.register_comm_hook(model, spec, topology(), min_compress_bytes=0)
            grads = train(model, device)
            state.close()
            with expect(spec):
                same_on_every_rank(grads, "gradients")
                on_device_and_finite(grads, device)
                assert state.step == STEPS
                if world == 1:
                    for g, a in zip(grads, alone, strict=True):
                        torch.testing.assert_close(g, a)


def check_autocast_with_a_grad_scaler(device):
    """fp16 autocast and a GradScaler on the GPU (bf16 on the CPU), error feedback told the
    scale: finite parameters, identical on every rank, overflowing steps skipped everywhere."""
    dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16)
    model = gradsync.wrap(mlp(seed=6).to(device), "topk:density=0.1", topology(), grad_scaler=scaler,
                          plan="compress", min_compress_bytes=0, **FAST)  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    skipped = []
    for step in range(8):
        x, y = batch(step, dist.get_rank(), device)
        opt.zero_grad()
        with torch.autocast(device.type, dtype=dtype):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        stats = model.last_stats
        skipped.append(bool(stats.overflow) if stats is not None else None)
    model.close()
    params = [p.detach() for p in model.parameters()]
    flags = torch.tensor([s is True for s in skipped] + [scaler.get_scale()], dtype=torch.float64)
    same_on_every_rank([*params, flags], "parameters, skipped steps and the loss scale")
    assert all(torch.isfinite(p).all() for p in params)
    assert all(p.dtype == torch.float32 for p in params)


# ---------------------------------------------------------------------------------- planner
def check_planner_times_codecs_on_the_gradients_device(device):
    """The plan (made on rank 0 after the first step) timed its codecs on the gradients' device."""
    from gradsync.planner import decide as planner

    real = planner.measure_codec
    signature = inspect.signature(real)
    timed = []

    def spy(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        timed.append((torch.device(bound.arguments["device"] or "cpu"), bound.arguments["dtype"]))
        return real(*args, **kwargs)

    planner.measure_codec = spy
    try:
        model = gradsync.wrap(mlp(seed=7, width=256).to(device), "allgather/topk:density=0.1", topology(),
                              plan="auto", min_compress_bytes=0, **FAST)  # fmt: skip
        train(model, device, steps=2)
        model.close()
    finally:
        planner.measure_codec = real
    if dist.get_rank() == 0:
        assert timed, "no codec was timed"
        assert all(d.type == device.type and t == torch.float32 for d, t in timed), timed
    else:
        assert timed == [], timed  # rank 0 decides alone


def check_the_threads_work_on_this_ranks_gpu(device):
    """gradsync's compute and communication threads (wrap's and the DDP hook's) have this rank's
    GPU as their current device: a new thread starts on cuda:0, where every rank of a node would
    otherwise allocate and stage."""
    seen = []

    def probe():
        seen.append(torch.cuda.current_device())  # the compute thread
        yield lambda: seen.append(torch.cuda.current_device())  # the communication thread

    model = gradsync.wrap(mlp().to(device), "topk:density=0.1", topology(), **FAST)
    train(model, device, steps=1)
    model.engine.manager.wait([model.engine.manager.submit(probe(), "probe")], timeout=30)
    model.close()
    net = ddp(mlp().to(device), device)
    state = gradsync.register_comm_hook(net, "topk:density=0.1", topology(), **FAST)
    train(net, device, steps=1)
    state.manager.wait([state.manager.submit(probe(), "probe")], timeout=30)
    state.close()
    assert seen == [device.index] * 4, f"current devices {seen}, this rank's GPU is {device.index}"


# --------------------------------------------------------------------- resume from the CPU
RESUME = ("topk:density=0.1", "dgc:density=0.1+ef:momentum=0.9", "powersgd:rank=2")


def _through_the_cpu(state):
    """``state`` saved and read back as a trainer or Lightning reads it: onto the CPU."""
    import io

    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, map_location="cpu", weights_only=True)


def check_state_loaded_on_the_cpu_resumes_on_the_device(device):
    """A run stopped after 3 steps and resumed from compression state loaded with
    ``map_location="cpu"`` (residuals, carried gradient, momentum correction, PowerSGD's warm
    start) trains on the device: with wrap it ends where the uninterrupted run ends; the hook
    (whose first iteration after a load is dense) leaves finite gradients, the same on every rank."""
    base = mlp(seed=7)
    topo = topology()
    with expect_all() as expect:
        for scheme in RESUME:
            for how in ("wrap", "hook"):
                if how == "hook" and "ef:momentum" in scheme:
                    continue  # the hook refuses momentum correction

                def make(module, how=how, scheme=scheme):
                    module = copy.deepcopy(module).to(device)
                    if how == "wrap":
                        m = gradsync.wrap(module, scheme, topo, plan="compress", min_compress_bytes=0, **FAST)
                        return m, m, m.sync_state_dict, m.load_sync_state_dict
                    d = ddp(module, device)
                    st = gradsync.register_comm_hook(d, scheme, topo, min_compress_bytes=0, log_plan=False)
                    return d, st, st.state_dict, st.load_state_dict

                whole, closer, _, _ = make(base)
                train(whole, device, steps=3)
                train(whole, device, steps=3, start=3)
                closer.close()
                first, closer, save, _ = make(base)
                train(first, device, steps=3)
                saved = _through_the_cpu(save())
                closer.close()
                second, closer, _, load = make(first.module)
                load(saved)
                grads = train(second, device, steps=3, start=3)
                closer.close()
                with expect(f"{how} {scheme}: resumed on {device} from state loaded on the CPU"):
                    on_device_and_finite(grads, device)
                    same_on_every_rank(grads, "gradients")
                    if how == "wrap":
                        for a, b in zip(whole.parameters(), second.parameters(), strict=True):
                            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------- worlds
def nccl_world(device_type):
    device = device_of(device_type)
    planned = dist.get_world_size() > 1  # one rank makes no plan
    run_checks(
        named_check(check_none_equals_ddp, device),
        named_check(check_lossy_schemes_with_wrap, device),
        named_check(check_lossy_schemes_with_the_hook, device),
        named_check(check_autocast_with_a_grad_scaler, device),
        named_check(check_the_threads_work_on_this_ranks_gpu, device),
        named_check(check_state_loaded_on_the_cpu_resumes_on_the_device, device),
        *([named_check(check_planner_times_codecs_on_the_gradients_device, device)] if planned else []),
    )


def gloo_world(device_type):
    if device_type == "cuda":
        torch.cuda.set_device(0)  # both ranks share the one GPU
    device = device_of(device_type)
    run_checks(
        named_check(check_none_equals_ddp, device),
        named_check(check_none_equals_an_all_reduce_on_the_cpu, device),
        named_check(check_exact_compressed_paths_equal_the_mean, device),
        named_check(check_lossy_schemes_with_wrap, device),
        named_check(check_lossy_schemes_with_the_hook, device),
        named_check(check_autocast_with_a_grad_scaler, device),
        named_check(check_planner_times_codecs_on_the_gradients_device, device),
        named_check(check_resident_wrap_makes_no_host_read_with_cuda_gradients, device),
    )


def test_one_nccl_rank():
    run_world(1, nccl_world, "cuda", backend="nccl")


@pytest.mark.skipif(GPUS < 2, reason=f"needs two GPUs (NCCL takes one GPU per rank); this machine has {GPUS}")
def test_two_nccl_ranks():
    run_world(2, nccl_world, "cuda", backend="nccl")


def test_two_gloo_ranks_with_cuda_gradients():
    run_world(2, gloo_world, "cuda")


# ------------------------------------------------------------------------------ gradsync train
@pytest.mark.parametrize("amp", [False, True], ids=["fp32", "amp"])
def test_gradsync_train_runs_an_epoch_on_the_gpu(amp, tmp_path, monkeypatch, capfd):
    """torchrun's workers pick NCCL and their GPU (LOCAL_RANK) by themselves; the banner says
    which device they train on."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    nproc = min(GPUS, 2)
    out = tmp_path / "summary.json"
    argv = ["train", "--nproc", str(nproc), "--data", "digits", "--model", "vgg-small", "--epochs", "1",
            "--batch-size", "48", "--scheme", "topk:density=0.05", "--plan", "compress", "--sync-option",
            "calibrate=false", "--json", str(out), *(["--amp"] if amp else [])]  # fmt: skip
    assert main(argv) == 0
    err = capfd.readouterr().err
    assert "device cuda:0" in err, err[-3000:]
    s = json.loads(out.read_text())
    assert s["world"] == nproc and len(s["history"]) == 1
    assert s["steps"] == (1438 // nproc) // 48  # digits: 1438 training images, whole batches only
    last = s["history"][-1]
    assert last["train_loss"] == last["train_loss"] and last["train_loss"] < float("inf")  # finite
    assert last["val_accuracy"] > 0.2, last  # one epoch learns something (chance: 0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_lars_and_lamb_on_cuda_equal_the_cpu_step_without_host_synchronization(dtype):
    """The optimizers' CUDA step matches their CPU step (norms and ratios in float32 on both),
    and asks the device for nothing: CUDA's sync debug mode turns any host synchronization into
    an error."""
    from gradsync.optim import LAMB, LARS, layerwise_param_groups

    for cls, kw in ((LARS, {"lr": 0.5, "trust_coefficient": 0.02}), (LAMB, {"lr": 0.01})):
        torch.manual_seed(0)
        cpu = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 8)).to(dtype)
        gpu = copy.deepcopy(cpu).cuda()
        opts = [cls(layerwise_param_groups(m, 1e-3), **kw) for m in (cpu, gpu)]
        g = torch.Generator().manual_seed(1)
        for step in range(3):
            grads = [torch.randn(p.shape, generator=g).to(dtype) for p in cpu.parameters()]
            for m in (cpu, gpu):
                for p, gr in zip(m.parameters(), grads, strict=True):
                    p.grad = gr.to(p.device)
            opts[0].step()
            if step:  # the first step allocates state; after it nothing may synchronize
                torch.cuda.set_sync_debug_mode("error")
            try:
                opts[1].step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
        for a, b in zip(cpu.parameters(), gpu.parameters(), strict=True):
            torch.testing.assert_close(b.detach().cpu(), a.detach(), rtol=tol, atol=tol)


# ------------------------------------------------------------------------------ resident mode
RESIDENT_CODECS = (
    "topk:density=0.01", "chunktopk:density=0.01", "mstopk:density=0.01", "trimmed_topk:density=0.01",
    "bsearch:density=0.01", "dgc:density=0.01", "graddrop:density=0.01", "randomk:density=0.01",
    "onebit", "tbq:threshold=0.01", "terngrad", "fp16", "bf16", "none", "powersgd:rank=4",
    "dgc:density=0.01+ef", "onebit+ef", "powersgd:rank=4+ef",
)  # fmt: skip


@pytest.mark.parametrize("spec", RESIDENT_CODECS)
def test_a_resident_codec_never_synchronizes_with_the_host_on_cuda(spec):
    """Encode, decode and a peer's payload, on CUDA, under the sync debug mode "error": any host
    synchronization (a count read back, a tensor built on the host) raises. The decoded tensor
    equals the CPU's resident decode where the codec is deterministic."""
    codec = gradsync.build_codec(spec)
    codec.set_resident(True)
    shape = (1024, 1024) if spec.startswith("powersgd") else (1 << 20,)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    xc = x.cuda()
    codec.encode(xc)  # first call: streams and generators (PowerSGD's first Q comes from the host)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        payload = codec.encode(xc)
        out = torch.empty_like(xc)
        codec.decode(payload, out=out)
        peer = codec.payload_from_bytes(payload.data.clone(), shape, xc.dtype)
        codec.decode(peer, out=out, accumulate=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert payload.nbytes == codec.max_nbytes(x.numel(), shape)
    if spec.split(":")[0] in ("topk", "chunktopk", "trimmed_topk", "onebit", "fp16", "bf16", "none"):
        cpu = gradsync.build_codec(spec)
        cpu.set_resident(True)
        torch.testing.assert_close(out.cpu() / 2, cpu.decode(cpu.encode(x)), rtol=1e-5, atol=1e-6)


def check_resident_wrap_makes_no_host_read_with_cuda_gradients(device):
    """The audit of host reads over two steps of wrap and of the hook with CUDA gradients (gloo
    stages its transfers through the CPU in C++, which the audit does not count): nothing but
    the per-step reads (step check, flags)."""
    from gradsync.sync.host_reads import audit_host_reads

    with expect_all() as expect:
        for scheme in ("allgather/dgc:density=0.05+ef", "ring/chunktopk:density=0.05", "powersgd:rank=2"):
            model = gradsync.wrap(mlp().to(device), scheme, topology(), plan="compress", min_compress_bytes=0,
                                  resident=True, check_overflow=True, **FAST)  # fmt: skip
            train(model, device, steps=2)
            with audit_host_reads() as audit:
                train(model, device, steps=2, start=2)
            model.close()
            with expect(f"wrap {scheme}"):
                assert not audit.unexpected, audit.summary()


@pytest.mark.skipif(GPUS < 2, reason=f"needs two GPUs (NCCL takes one GPU per rank); this machine has {GPUS}")
def test_resident_steps_synchronize_with_the_host_once_per_step_on_nccl():
    run_world(2, _count_syncs_world, backend="nccl")


def _count_syncs_world():
    """Two NCCL ranks: count CUDA's synchronization warnings over two steps of wrap with the
    step check off and the overflow flags on. Target: one per step (the flags)."""
    import warnings

    device = torch.device("cuda", dist.get_rank())
    for scheme in ("allgather/topk:density=0.05", "allgather/dgc:density=0.05+ef", "powersgd:rank=2"):
        model = gradsync.wrap(mlp().to(device), scheme, plan="compress", min_compress_bytes=0, resident=True,
                              check_overflow=True, check_steps=False, **FAST)  # fmt: skip
        train(model, device, steps=2)
        batches = [batch(step, dist.get_rank(), device) for step in (2, 3)]  # on the GPU first
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                for x, y in batches:  # the loop itself reads nothing back
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        model.close()
        syncs = [w for w in seen if "synchroniz" in str(w.message)]
        assert len(syncs) <= 2, f"{scheme}: {len(syncs)} synchronizations in 2 steps: " + "; ".join(
            str(w.message)[:200] for w in syncs
        )


# ------------------------------------------------------------------------------ CUDA graphs
GRAPHED = (
    "topk:density=0.01", "chunktopk:density=0.01", "mstopk:density=0.01", "bsearch:density=0.01,reuse=3",
    "dgc:density=0.01", "randomk:density=0.01", "onebit", "tbq:threshold=0.01", "terngrad", "fp16",
    "none", "topk:density=0.01+ef", "chunktopk:density=0.01+ef:momentum=0.9", "dgc:density=0.01+ef",
    "onebit+ef", "terngrad+ef", "fp16+ef",
)  # fmt: skip


@pytest.mark.parametrize("spec", GRAPHED)
def test_a_replayed_codec_equals_its_eager_path_on_cuda(spec, monkeypatch):
    """The resident encode and decode captured as CUDA graphs and replayed (gradsync.codecs.graphs)
    send the bytes, decode the tensor and keep the residual the eager path does, step after
    step (a non-finite step among them), from a bucket that stays at one address as the
    engine's do; after the captures every call is a replay, and no replay waits for the host."""
    n = 1 << 20
    eager, replayed = gradsync.build_codec(spec), gradsync.build_codec(spec)
    for c in (eager, replayed):
        c.set_resident(True)
    bucket = torch.empty(n, device="cuda")
    out = torch.empty(n, device="cuda")
    for step in range(8):
        g = torch.randn(n, generator=torch.Generator().manual_seed(step)).cuda()
        if step == 3:
            g[7] = float("nan")
        monkeypatch.setenv("GRADSYNC_CUDA_GRAPHS", "0")
        want = eager.encode(g, gradsync.codecs.EncodeContext(key="b"))
        want_decoded = eager.decode(want)
        monkeypatch.delenv("GRADSYNC_CUDA_GRAPHS")
        bucket.copy_(g)
        if step >= 4:  # captured by now: replays only, none waits for the host
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            got = replayed.encode(bucket, gradsync.codecs.EncodeContext(key="b"))
            replayed.decode(got, out=out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(got.data, want.data), (spec, step)
        assert torch.equal(out.nan_to_num(7.0), want_decoded.nan_to_num(7.0)), (spec, step)
        if "+ef" in spec:
            assert torch.equal(replayed.residual("b"), eager.residual("b")), (spec, step)
    plain = replayed.plain
    assert plain.replayer.captured <= (6 if spec.startswith("bsearch") else 4), plain.replayer.captured
    assert plain.replayer.replayed >= 2 * 8 - 2 - plain.replayer.captured, plain.replayer.replayed
    assert eager.plain.replayer.captured == 0
