"""Zero-copy buckets (``grad_as_bucket_view``): the gradients are views into the buckets' flat
buffers, and every step gives bit for bit what the copying path gives (dense and compressed
schemes, ``no_sync`` accumulation, ``zero_grad`` with and without ``set_to_none``, a parameter
left out of the forward pass, a re-plan that rebuilds the buckets), on 2 ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.collectives import Topology
from gradsync.sync import SyncConfig
from worlds import named_check, run_checks, run_world

pytestmark = pytest.mark.timeout(300)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 256)
        self.b = nn.Linear(256, 256)
        self.spare = nn.Linear(256, 256)  # used on some steps only
        self.head = nn.Linear(256, 8)

    def forward(self, x: torch.Tensor, spare: bool) -> torch.Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        if spare:
            h = h + self.spare(h)
        return self.head(h)


def _pair(scheme: str, **options):
    """The same model wrapped twice: with zero-copy buckets and with the copying path."""
    out = []
    for view in (True, False):
        torch.manual_seed(0)
        out.append(
            gradsync.wrap(
                Net(), topology=Topology(nodes=2, per_node=1), scheme=scheme, grad_as_bucket_view=view,
                min_compress_bytes=4096, bucket_bytes=150_000, log_plan=False, **options,
            )
        )  # fmt: skip
    return out


def _same_everywhere(scheme: str, **options) -> list[str]:
    """Eight steps of both models on the same data; what differed, step by step."""
    zero, copying = _pair(scheme, **options)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (zero, copying)]
    failed = []
    for step in range(8):
        g = torch.Generator().manual_seed(100 * dist.get_rank() + step)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
        spare = step % 3 != 1
        for model in (zero, copying):
            if step == 4:  # a micro-batch accumulated locally first
                with model.no_sync():
                    nn.functional.mse_loss(model(x[:8], spare), y[:8]).backward()
                nn.functional.mse_loss(model(x[8:], spare), y[8:]).backward()
            else:
                nn.functional.mse_loss(model(x, spare), y).backward()
        for (name, p), q in zip(zero.module.named_parameters(), copying.module.parameters(), strict=True):
            if (p.grad is None) != (q.grad is None) or (
                p.grad is not None and not torch.equal(p.grad, q.grad)
            ):
                failed.append(f"{scheme}, step {step}: the gradient of {name} differs")
        engine = zero.engine  # (after step 0 the first plan rebuilt the buckets: re-attached next)
        held = [b.holds(j, s.param.grad) for b in engine._buckets for j, s in enumerate(b.slots)
                if s.param.grad is not None]  # fmt: skip
        if step > 0 and not all(held):
            failed.append(f"{scheme}, step {step}: {held.count(False)} gradients are not bucket views")
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=step % 2 == 0)
    for (name, p), q in zip(zero.module.named_parameters(), copying.module.parameters(), strict=True):
        if not torch.equal(p, q):
            failed.append(f"{scheme}: after 8 steps the parameter {name} differs")
    zero.close()
    copying.close()
    return failed


def check_dense():
    failed = _same_everywhere("hierarchical")
    assert not failed, "\n".join(failed)


def check_compressed():
    failed = _same_everywhere("allgather/topk:density=0.05", plan="compress")
    assert not failed, "\n".join(failed)


def check_across_a_replan():
    """The first plan (after step 0) rebuilds the buckets: the gradients move to the new ones."""
    failed = _same_everywhere("allgather/topk:density=0.05", calibrate=False, replan=0)
    assert not failed, "\n".join(failed)


def zero_copy_world():
    run_checks(named_check(check_dense), named_check(check_compressed), named_check(check_across_a_replan))


def test_zero_copy_buckets_equal_the_copying_path_on_two_ranks():
    run_world(2, zero_copy_world)


def test_the_option_is_a_sync_option():
    assert SyncConfig.from_options({"grad_as_bucket_view": "true"}).grad_as_bucket_view is True
    with pytest.raises(ValueError, match="grad_as_bucket_view"):
        SyncConfig.from_options({"grad_as_bucket_view": "maybe"})
