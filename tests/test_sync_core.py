"""What the synchronization core guarantees to every front, checked where the fronts used to
differ: state keyed per parameter (never per shape), state that follows the gradient's device
after a load, and a revert guard that survives a checkpoint.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync.codecs import build_codec
from gradsync.codecs.lowrank import PowerSGD
from gradsync.planner.closed_loop import ClosedLoop
from gradsync.planner.plan import BucketPlan, Plan
from gradsync.sync.carry import whole
from gradsync.sync.ledger import Ledger
from gradsync.sync.momentum import SyncMomentum
from worlds import expect_all, named_check, run_checks, run_world

pytestmark = pytest.mark.timeout(300)

TOL = 2e-5  # float32 sums over a few steps, against float64 references


# ------------------------------------------------------------- a hook made without model=
class Repeated(nn.Module):
    """Four blocks of one shape; block 2 is multiplied by zero, so its true gradient is exactly 0
    on every rank and every step (its parameters still get a gradient tensor, of zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = x + (0.0 if i == 2 else 1.0) * torch.tanh(block(x))
        return x


def hook_without_model_world() -> None:
    """The hook as PyTorch's docs make one (no ``model=``), on a model of repeated blocks with a
    bucket per parameter: each parameter keeps its own residual. Block 2 must get exactly zero
    every step (a shared residual leaked other layers' gradients into it), and for every
    parameter, in float64, the mean of the ranks' raw gradients summed over the steps equals the
    synchronized gradients applied plus what the ranks still owe."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    module = Repeated()
    twin = copy.deepcopy(module)
    ddp = DistributedDataParallel(module, bucket_cap_mb=0.0005)  # one bucket per parameter
    state, hook = gradsync.ddp_comm_hook(
        "allgather/topk:density=0.1", plan="compress", min_compress_bytes=0, log_plan=False
    )
    ddp.register_comm_hook(state, hook)
    names = [n for n, _ in module.named_parameters()]
    wanted = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in module.named_parameters()}
    applied = {n: torch.zeros_like(w) for n, w in wanted.items()}
    gen = torch.Generator().manual_seed(100 + rank)
    with expect_all() as expect:
        for step in range(6):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 16, generator=gen)
            nn.functional.mse_loss(twin(x), y).backward()
            nn.functional.mse_loss(ddp(x), y).backward()
            for n, p in twin.named_parameters():
                g = p.grad.double().reshape(-1)
                dist.all_reduce(g)
                wanted[n] += g / world
            for n, p in module.named_parameters():
                applied[n] += p.grad.double().reshape(-1)
                if n.startswith("blocks.2."):
                    with expect(f"step {step}, {n}: got {float(p.grad.abs().max()):.3g}, not exactly 0"):
                        assert float(p.grad.abs().max()) == 0.0
            twin.zero_grad(set_to_none=True)
            ddp.zero_grad(set_to_none=True)
        owed = state.owed_gradients()
        with expect(f"one stream per parameter: owed names {sorted(owed)}"):
            assert len(owed) == len(names)
        # the hook's names are its own (no model given): match them to the model by bucket order
        by_size = {}
        for key, t in owed.items():
            total = t.double().clone()
            dist.all_reduce(total)
            by_size[key] = total
        totals = sorted(by_size.values(), key=lambda t: float(t.abs().sum()))
        left = sum(float(t.abs().sum()) for t in totals)
        with expect("something is owed (the test has teeth)"):
            assert left > 0
        for n in names:
            gap = applied[n] - wanted[n]
            match = [
                k
                for k, t in by_size.items()
                if t.numel() == gap.numel() and torch.allclose(t, -gap, atol=TOL)
            ]
            with expect(f"{n}: applied + owed != the mean of the raw gradients"):
                assert match, f"largest gap {float(gap.abs().max()):.3g}"
    state.close()


def check_a_hook_checkpoint_of_another_setup_is_refused():
    """A hook's state saved by another rank, or for another model, is refused naming the
    difference (with ``reset_compression_state=True``: a warning, and the state starts afresh);
    a state of the same setup loads."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    ddp = DistributedDataParallel(module)
    opts = dict(plan="compress", min_compress_bytes=0, log_plan=False)
    state = gradsync.register_comm_hook(ddp, "allgather/topk:density=0.1", **opts)
    for _ in range(2):
        ddp(torch.randn(8, 16)).square().mean().backward()
    saved = state.state_dict()
    with expect_all() as expect:
        with (
            expect("another rank's state is refused, naming the rank"),
            pytest.raises(ValueError, match=r"rank: saved"),
        ):
            state.load_state_dict({**saved, "rank": 1 - rank})
        other = nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
        other_state = gradsync.register_comm_hook(
            DistributedDataParallel(other), "allgather/topk:density=0.1", **opts
        )
        with (
            expect("another model's state is refused, naming the parameters"),
            pytest.raises(ValueError, match=r"params: saved"),
        ):
            other_state.load_state_dict(saved)
        with expect("reset_compression_state=True: a warning, nothing loaded"):
            with pytest.warns(UserWarning, match="resetting the compression state"):
                other_state.load_state_dict(saved, reset_compression_state=True)
            assert not other_state.owed_gradients()
        with expect("the same setup loads"):
            state.load_state_dict(saved)
            assert state.step == 2
    other_state.close()
    state.close()


def check_the_hook_trains_on_after_a_forward_without_backward():
    """One rank runs an extra training-mode forward pass without backward (a look at the
    predictions): with plain DDP training goes on, and with gradsync's hook (given ``model=``,
    which counts forward passes) it does too, with the same parameters and one warning."""
    import warnings

    rank = dist.get_rank()

    def run(hooked: bool) -> tuple[nn.Module, list[str]]:
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
        ddp = DistributedDataParallel(module)
        state = gradsync.register_comm_hook(ddp, "none", log_plan=False) if hooked else None
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        gen = torch.Generator().manual_seed(rank)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in range(4):
                x = torch.randn(8, 16, generator=gen)
                if rank == 1 and step == 1:
                    ddp(x)  # a look at the predictions, no backward
                ddp(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
        if state is not None:
            state.close()
        return module, [str(w.message) for w in seen]

    ref, _ = run(False)
    ours, said = run(True)
    with expect_all() as expect:
        with expect("the same parameters as DDP"):
            for a, b in zip(ref.parameters(), ours.parameters(), strict=True):
                assert torch.equal(a, b)
        with expect("one warning that the forward counts differ"):
            assert sum("different numbers of training-mode forward" in m for m in said) == 1, said


def core_world() -> None:
    run_checks(
        named_check(hook_without_model_world),
        named_check(check_a_hook_checkpoint_of_another_setup_is_refused),
        named_check(check_the_hook_trains_on_after_a_forward_without_backward),
    )


def test_a_hook_keeps_each_layers_residual_and_refuses_foreign_checkpoints():
    run_world(2, core_world)


# ----------------------------------------------------------- state follows the gradient's device
def test_state_loaded_elsewhere_follows_the_gradient_on_first_use():
    """State loaded with ``map_location="cpu"`` must follow a CUDA gradient on first use. Here the
    ``meta`` device stands for the GPU (this machine has none; tests/test_gpu.py runs a resumed
    CUDA run): every holder of state is handed a gradient on another device than its state and
    must move its state there, keeping what it held."""
    other = torch.device("meta")
    # error feedback: residual and momentum
    ef = build_codec("topk:density=0.5+ef:momentum=0.9")
    ef.encode(torch.randn(64), loss_scale=1.0)
    loaded = build_codec("topk:density=0.5+ef:momentum=0.9")
    loaded.load_state_dict(ef.state_dict())
    loaded.accumulate(torch.randn(64, device=other))
    stream = loaded._streams[""]
    assert stream.residual is not None and stream.residual.device == other
    assert stream.momentum is not None and stream.momentum.device == other
    # the ledger's carry (owed gradient of ended streams), both shares
    ledger = Ledger([])
    ledger.load_state_dict(
        {"codecs": [], "carry": {"local": {"w": torch.ones(8)}, "mean": {"w": torch.ones(8)}}}
    )
    grad = torch.zeros(8, device=other)
    ledger.inject(grad, whole([("w", 8)]), 1.0)
    ledger.carry.apply_mean("w", grad, 1.0)
    assert ledger.carry.local["w"].device == other and ledger.carry.mean["w"].device == other
    with pytest.raises(ValueError, match="'w' has 8 elements, the parameter 4"):
        ledger.inject(torch.zeros(4, device=other), whole([("w", 4)]), 1.0)
    # momentum correction's sync momentum
    momentum = SyncMomentum(0.9, False)
    momentum.dense(["w"], [torch.ones(8)])
    resumed = SyncMomentum(0.9, False)
    resumed.load_state_dict(momentum.state_dict())
    resumed.dense(["w"], [torch.ones(8, device=other)])
    assert resumed.velocity["w"].device == other
    # PowerSGD's warm start
    psgd = build_codec("powersgd:rank=2")
    psgd.encode(torch.randn(8, 6))
    again = build_codec("powersgd:rank=2")
    again.load_state_dict(psgd.state_dict())
    stream = again.stream("")
    assert isinstance(again, PowerSGD)
    again.project(torch.randn(8, 6, device=other), stream)
    assert stream.q is not None and stream.q.device == other


# ------------------------------------------------------------------- the closed loop's guard
def test_the_revert_guard_survives_a_checkpoint():
    """A run saved between a re-plan and its check keeps the plan to go back to and its
    measured span, readable with ``weights_only=True``."""
    plan = Plan([BucketPlan([0, 1], 0, compress=True), BucketPlan([2], -1)])
    loop = ClosedLoop(replan=2, steps=3, gain=0.1, replans=1, before=(plan, 0.25))
    buf = io.BytesIO()
    torch.save(loop.state_dict(), buf)
    buf.seek(0)
    resumed = ClosedLoop(replan=2, steps=3, gain=0.1)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert resumed.before is not None and resumed.before[1] == 0.25
    assert resumed.before[0].to_state() == plan.to_state()
    assert resumed.worse_than_before(0.3) and not resumed.worse_than_before(0.26)


# ------------------------------------------------------------------- the ledger's geometry
def test_the_ledger_traces_padded_chunks_and_gives_back_what_a_skipped_round_took():
    """FSDP's geometry through the ledger, against a reference written out by hand: a stream's
    input is two rows of padded dim-0 chunks (``w``: 5 elements in chunks of 3, ``v``: 2 in
    chunks of 2), worth 0.5 each in the carry's units. Ending the stream puts exactly the
    residual's elements of each parameter, times 0.5, on it (the padding on nothing); injecting
    with the loss scale over the factor gives the residual back in the input's units; a rolled
    back round returns what it took; a state in a front's older format (one ``codec``) loads."""
    from gradsync.codecs import EncodeContext
    from gradsync.sync.carry import Layouts, Piece

    pieces = [
        Piece("w", 5, 0, 3), Piece("v", 2, 0, 2),  # row 0
        Piece("w", 5, 3, 2), Piece("", 0, 0, 1), Piece("", 0, 0, 2),  # row 1: w's tail, padding
    ]  # fmt: skip
    codec = build_codec("topk:density=0.3+ef")
    ledger = Ledger([codec])
    x = torch.arange(1.0, 11.0) * torch.tensor([1, -1] * 5)
    ledger.begin_round()
    payload = codec.encode(x, EncodeContext(key="m/rs/send", offset=0))
    residual = x - codec.decode(payload)
    saved = ledger.state_dict()
    layouts = Layouts().add("m/rs", pieces, factor=0.5)
    assert ledger.owed_gradients(layouts, 1)["w"].tolist() == (0.5 * residual[[0, 1, 2, 5, 6]]).tolist()
    assert ledger.end_streams(lambda key: False, layouts) == ["m/rs/send"]
    assert not codec.owed()
    w, v = ledger.carry.local["w"], ledger.carry.local["v"]
    assert w.tolist() == (0.5 * residual[[0, 1, 2, 5, 6]]).tolist()
    assert v.tolist() == (0.5 * residual[[3, 4]]).tolist()
    # the next round takes the carry into its input (loss scale 4 over the factor 0.5)...
    ledger.begin_round()
    flat = torch.zeros(10)
    ledger.inject(flat, pieces, 4.0 / 0.5, take=True)
    expected = torch.zeros(10)
    expected[:7] = 4.0 * residual[:7]
    assert flat.tolist() == expected.tolist() and not ledger.carry.local
    # ...and an overflow on some rank gives it back
    ledger.rollback_round()
    assert ledger.carry.local["w"].tolist() == w.tolist() and ledger.carry.local["v"].tolist() == v.tolist()
    # a front's older state (one "codec" instead of "codecs") restores the stream
    again = Ledger([build_codec("topk:density=0.3+ef")])
    again.load_state_dict({"codec": saved["codecs"][0], "carry": None})
    assert again.owed_gradients(layouts, 1)["v"].tolist() == v.tolist()
    with pytest.raises(ValueError, match="2 codec states, this synchronization has 1"):
        again.load_state_dict({"codecs": [saved["codecs"][0]] * 2})
