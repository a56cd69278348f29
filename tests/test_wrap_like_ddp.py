"""gradsync.wrap against torch DDP on the same training scripts, written as the PyTorch docs write
them (DistributedSampler, no_sync, find_unused_parameters): frozen layers, parameters no rank
uses, buffers, a forward pass without backward on one rank, and parameters used only in the
micro-batches of gradient accumulation. One 2-rank gloo world runs every check."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import gradsync
from gradsync.sync.sequence import OutOfStepError
from worlds import expect_all, named_check, run_checks, run_world, same_on_every_rank

pytestmark = pytest.mark.timeout(600)

FAST = {"calibrate": False, "log_plan": False}
TOPK = "allgather/topk:density=0.1+ef"  # error feedback: something is owed every step
COMPRESS = {"plan": "compress", "min_compress_bytes": 0, **FAST}


class Net(nn.Module):
    """A small classifier: ``aux`` is a second head only some steps use (none, by default)."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(16, 32)
        self.norm = nn.BatchNorm1d(32) if norm else nn.Identity()
        self.mid = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.aux = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, aux: bool = False) -> torch.Tensor:
        h = F.relu(self.mid(F.relu(self.norm(self.body(x)))))
        out = self.head(h)
        return out + self.aux(h) if aux else out


def data(batch_size: int = 8) -> tuple[DataLoader, DistributedSampler]:
    """The same 128 samples on every rank; the DistributedSampler gives each rank its share."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=g)
    dataset = TensorDataset(x, x[:, :4].argmax(1))
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler), sampler


def ddp(**kw):
    """``DDP(model, **kw)`` as a factory (the deprecated ``broadcast_buffers`` warns on 2.13)."""

    def make(model: nn.Module) -> nn.Module:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            return DDP(model, **kw)

    return make


def ours(scheme: str = "none", **kw):
    return lambda model: gradsync.wrap(model, scheme, **{**FAST, **kw})


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.module.named_parameters()}


def close(model: nn.Module) -> None:
    if isinstance(model, gradsync.GradSync):
        model.close()


# ------------------------------------------------------------------- 1. a layer frozen mid-way
def freezing_script(make, optimizer, freeze_at: int = 1):
    """Train two epochs; the first layer is frozen when the second epoch starts (fine-tuning)."""
    model = make(Net())
    opt = optimizer(model.parameters())
    loader, sampler = data()
    frozen_at = owed_at_freeze = None
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for x, y in loader:
            if epoch == freeze_at and frozen_at is None:
                model.module.body.requires_grad_(False)
                frozen_at = params(model)
                if isinstance(model, gradsync.GradSync):
                    owed_at_freeze = model.owed_gradients()
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
    return model, frozen_at, owed_at_freeze


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def check_a_frozen_layer_stays_put_as_with_ddp():
    """DDP needs find_unused_parameters=True for a layer frozen after construction (without it,
    the forward pass after the freeze raises); wrap needs nothing. The frozen layer gets no
    gradient (None, not zeros), so momentum, weight decay and AdamW leave it where it was."""
    with expect_all() as expect:
        for name, optimizer in OPTIMIZERS.items():
            ref, _, _ = freezing_script(ddp(find_unused_parameters=True), optimizer)
            for kw in ({}, {"grad_as_bucket_view": True}, {"find_unused_parameters": True}):
                model, frozen_at, _ = freezing_script(ours(**kw), optimizer)
                with expect(f"{name} {kw}"):
                    assert model.module.body.weight.grad is None
                    assert model.module.body.bias.grad is None
                    for n, p in model.module.named_parameters():
                        if n.startswith("body."):
                            assert torch.equal(p, frozen_at[n]), f"{n} moved after it was frozen"
                        torch.testing.assert_close(p, ref.module.get_parameter(n), msg=n)
                close(model)


def check_a_frozen_layer_keeps_what_error_feedback_owes_it():
    """Compressed: while the layer is frozen nothing of its residual is lost (what the codec sent
    of it goes back); it is reported by owed_gradients() and the layer does not move."""
    sgd = OPTIMIZERS["sgd"]
    with expect_all() as expect:
        model, frozen_at, owed = freezing_script(ours(TOPK, **COMPRESS), sgd)
        after = model.owed_gradients()
        with expect("the frozen layer"):
            assert model.module.body.weight.grad is None
            assert torch.equal(model.module.body.weight, frozen_at["body.weight"])
            assert owed["body.weight"].abs().sum() > 0, "nothing was owed: the check proves nothing"
            torch.testing.assert_close(after["body.weight"], owed["body.weight"], rtol=1e-5, atol=1e-6)
        model.close()


# --------------------------------------------------------------- 2. parameters no rank uses
def unused_script(make, optimizer, aux_steps=()):
    """Train one epoch; the ``aux`` head is used at ``aux_steps`` only."""
    model = make(Net())
    opt = optimizer(model.parameters())
    loader, sampler = data()
    sampler.set_epoch(0)
    grads = []
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        F.cross_entropy(model(x, aux=step in aux_steps), y).backward()
        grads.append(model.module.aux.weight.grad is None)
        opt.step()
    return model, grads


def check_parameters_no_rank_uses_stay_none_as_with_ddp():
    adamw = OPTIMIZERS["adamw"]
    start = Net().aux.weight.detach().clone()
    with expect_all() as expect:
        # plain DDP refuses a parameter without gradient: the forward pass after it raises
        model = DDP(Net())
        model(torch.randn(4, 16)).sum().backward()
        raises = pytest.raises(RuntimeError, match="find_unused_parameters=True")
        with expect("DDP without find_unused_parameters raises"), raises:
            model(torch.randn(4, 16))
        ref, _ = unused_script(ddp(find_unused_parameters=True), adamw)
        for kw in ({}, {"find_unused_parameters": True}, {"grad_as_bucket_view": True}):
            model, none = unused_script(ours(**kw), adamw)
            with expect(f"never used, {kw}"):
                assert all(none), f"aux got a gradient in steps {[i for i, n in enumerate(none) if not n]}"
                assert torch.equal(model.module.aux.weight, start), "AdamW moved the unused head"
                for n, p in model.module.named_parameters():
                    torch.testing.assert_close(p, ref.module.get_parameter(n), msg=n)
            close(model)
        # used in the first steps, then no more: without find_unused_parameters the first step
        # without it counts as zero (with a warning); the ranks agree from the next step on
        ref, ref_none = unused_script(ddp(find_unused_parameters=True), adamw, aux_steps=(0, 1))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model, none = unused_script(ours(), adamw, aux_steps=(0, 1))
        with expect("unused from step 2 on"):
            assert ref_none[3:] == none[3:] and all(none[3:]), none
            assert any("got no gradient" in str(w.message) for w in seen)
        close(model)


# ----------------------------------------------------------------------------- 3. buffers
def buffers_script(make, evaluate: torch.Tensor):
    """Train with BatchNorm on each rank's own data, then evaluate and return the outputs."""
    model = make(Net(norm=True))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader, sampler = data()
    sampler.set_epoch(0)
    for x, y in loader:
        opt.zero_grad()
        F.cross_entropy(model(x, aux=True), y).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        out = model(evaluate, aux=True)
    model.train()
    return model, out


def check_buffers_are_rank_zeros_as_with_ddp():
    evaluate = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))  # every rank's
    with expect_all() as expect:
        for broadcast in (True, False):
            ref, want = buffers_script(ddp(broadcast_buffers=broadcast), evaluate)
            model, got = buffers_script(ours(broadcast_buffers=broadcast), evaluate)
            with expect(f"broadcast_buffers={broadcast}: evaluation as DDP's"):
                torch.testing.assert_close(got, want)
                for n, b in model.module.named_buffers():
                    torch.testing.assert_close(b, ref.module.get_buffer(n), msg=n)
            if broadcast:  # the saved model is the same on every rank
                same_on_every_rank([b.float() for b in model.module.buffers()], "buffers")
            close(model)
        refused = pytest.raises(ValueError, match=r"broadcast_buffers must be true or false, got 'maybe'")
        with expect("a bad broadcast_buffers is refused with the allowed values"), refused:
            gradsync.wrap(Net(), "none", broadcast_buffers="maybe", **FAST)


# --------------------------------------------------- 4. a look at the predictions on one rank
def peeking_script(make, norm: bool = False):
    """One rank looks at its predictions now and then (train mode, no backward)."""
    model = make(Net(norm=norm))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader, sampler = data()
    sampler.set_epoch(0)
    for step, (x, y) in enumerate(loader):
        opt.zero_grad()
        out = model(x, aux=True)
        if dist.get_rank() == 1 and step % 3 == 1:
            model(x[:2], aux=True).argmax(1)  # a quick look, as one does in a notebook
        F.cross_entropy(out, y).backward()
        opt.step()
        if dist.get_rank() == 1 and step == 4:
            model(x, aux=True)  # and once after the step
    return model


def check_a_forward_pass_without_backward_trains_on():
    with expect_all() as expect:
        ref = peeking_script(ddp())
        for kw in ({}, {"find_unused_parameters": True}):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                model = peeking_script(ours(**kw))
            with expect(f"as DDP, {kw}"):
                for n, p in model.module.named_parameters():
                    torch.testing.assert_close(p, ref.module.get_parameter(n), msg=n)
            with expect(f"one warning on every rank that the forward counts differ, {kw}"):
                said = [w for w in seen if "different numbers of training-mode forward" in str(w.message)]
                assert len(said) == 1, [str(w.message) for w in seen]
            model.close()
        # with BatchNorm the extra forward pass changes the buffers of one rank only: the
        # broadcast after the next step makes them rank 0's again (DDP's own broadcast before
        # every forward pass would go out of step with the other rank's here)
        model = peeking_script(ours(TOPK, **COMPRESS), norm=True)
        same_on_every_rank([*model.module.parameters(), *(b.float() for b in model.module.buffers())], "peek")
        model.close()


def check_ranks_at_different_steps_are_still_caught():
    """A rank that accumulates one micro-batch more than the other is out of step."""
    rank = dist.get_rank()
    model = gradsync.wrap(Net(), "none", **FAST)
    loader, sampler = data()
    sampler.set_epoch(0)
    with pytest.raises(
        OutOfStepError, match=r"rank 0: step 1, 2 backward passes; rank 1: step 1, 3 backward"
    ):
        for step, (x, y) in enumerate(loader):
            if rank == 1 and step == 1:
                with model.no_sync():
                    F.cross_entropy(model(x), y).backward()
            F.cross_entropy(model(x), y).backward()
    model.close()


# --------------------------------------------------- 5. used only in the no_sync micro-batches
def accumulating_script(make, accumulate: int = 3):
    """Gradient accumulation under no_sync(); the aux head is used in the first micro-batch of
    every step only (never in the one that synchronizes)."""
    model = make(Net())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader, sampler = data(batch_size=4)
    sampler.set_epoch(0)
    grads = []
    for i, (x, y) in enumerate(loader):
        micro = i % accumulate
        if micro < accumulate - 1:
            with model.no_sync():
                (F.cross_entropy(model(x, aux=micro == 0), y) / accumulate).backward()
            continue
        (F.cross_entropy(model(x), y) / accumulate).backward()
        grads.append(model.module.aux.weight.grad.clone())
        opt.step()
        opt.zero_grad()
    return model, grads


def check_used_in_no_sync_micro_batches_counts_as_used():
    with expect_all() as expect:
        ref, want = accumulating_script(ddp(find_unused_parameters=True))
        for kw in ({"find_unused_parameters": True}, {}, {"grad_as_bucket_view": True}):
            model, got = accumulating_script(ours(**kw))
            with expect(f"the mean, as DDP's, {kw}"):
                assert len(got) == len(want)
                for a, b in zip(want, got, strict=True):
                    torch.testing.assert_close(b, a)
                for n, p in model.module.named_parameters():
                    torch.testing.assert_close(p, ref.module.get_parameter(n), msg=n)
            model.close()


def world():
    run_checks(
        named_check(check_a_frozen_layer_stays_put_as_with_ddp),
        named_check(check_a_frozen_layer_keeps_what_error_feedback_owes_it),
        named_check(check_parameters_no_rank_uses_stay_none_as_with_ddp),
        named_check(check_buffers_are_rank_zeros_as_with_ddp),
        named_check(check_a_forward_pass_without_backward_trains_on),
        named_check(check_ranks_at_different_steps_are_still_caught),
        named_check(check_used_in_no_sync_micro_batches_counts_as_used),
    )


def test_wrap_trains_like_ddp():
    run_world(2, world)
