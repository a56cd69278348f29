"""What PyTorch's PowerSGD hook sends, as the simulator models it, against the hook itself.

The reference is PyTorch's hook running under DDP on a world of one rank (gloo, FileStore): the
sizes of the three all-reduces it issues in a compressed step, and its own compression counters.
The tensors are those of a small CIFAR ResNet (3 x 3 convolutions of 16-64 channels, every one
below 2^16 elements), where the simulator used to send everything dense."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.collectives.cost import powersgd_hook_split
from gradsync.observe.hook_costs import powersgd_hook_sent
from worlds import run_world

SHAPES = [(16, 3, 3, 3), (16,), (16,), (64, 16, 3, 3), (64,), (64, 64, 3, 3), (4, 3), (10, 64), (10,)]


class Shapes(nn.Module):
    """One parameter per shape; the loss touches every element, so every one gets a gradient."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.ps = nn.ParameterList(nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * p).sum() * x for p in self.ps)


def hook_world(rank: int, expected: list[float], fraction: float) -> None:
    model = DDP(Shapes(), bucket_cap_mb=64)  # one bucket: the hook sees every tensor at once
    state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2)
    model.register_comm_hook(state, psgd.powerSGD_hook)
    sizes: list[int] = []
    real = dist.all_reduce

    def recording(t: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
        sizes.append(t.numel() * t.element_size())
        return real(t, *args, **kwargs)

    for step in range(4):
        sizes.clear()
        dist.all_reduce = recording
        try:
            model(torch.ones(())).backward()
        finally:
            dist.all_reduce = real
        model.zero_grad(set_to_none=True)
        if step < 2:  # the hook's dense warm-up (start_powerSGD_iter): the whole bucket at once
            assert sizes == [4 * sum(p.numel() for p in model.parameters())]
    # a compressed step: the uncompressed tensors, then P, then Q, one all-reduce each
    assert sizes == expected
    numel = sum(p.numel() for p in model.parameters())
    sent = powersgd_hook_sent(state, numel)
    assert sent["compressed_steps"] == pytest.approx(2.0)
    assert sent["sent_fraction"] == pytest.approx(fraction, rel=1e-12)


def written_out(rank: int) -> tuple[list[float], float]:
    """The hook's rule by hand: view each tensor as shape[0] rows; with r = min(rows, cols, rank),
    send P (rows r) and Q (cols r) iff (rows + cols) r 2 < rows cols, else the tensor."""
    dense = p = q = 0
    for s in SHAPES:
        numel = 1
        for d in s:
            numel *= d
        rows, cols = s[0], numel // s[0]
        r = min(rows, cols, rank)
        if (rows + cols) * r * 2 < rows * cols:
            p, q = p + rows * r, q + cols * r
        else:
            dense += numel
    total = sum(torch.Size(s).numel() for s in SHAPES)
    return [4.0 * dense, 4.0 * p, 4.0 * q], (dense + p + q) / total


@pytest.mark.parametrize("rank", [1, 4])
def test_the_split_is_what_the_hook_sends(rank):
    expected, fraction = written_out(rank)
    split = powersgd_hook_split(SHAPES, rank)
    assert [split.dense, split.p, split.q] == expected
    assert split.dense + split.matrices == 4.0 * sum(torch.Size(s).numel() for s in SHAPES)
    # every tensor here is below 2^16 elements, and still the hook compresses most of the bytes
    assert split.dense < 0.01 * (split.dense + split.matrices)
    run_world(1, hook_world, rank, expected, fraction)


def test_vectors_and_small_matrices_stay_dense():
    """Spot values: a bias never passes; 4 x 3 at rank 1 does not ((4 + 3) 2 = 14 >= 12); 16 x 27
    does ((16 + 27) 2 = 86 < 432), as 64 x 576 at rank 4 ((64 + 576) 4 2 = 5120 < 36864)."""
    assert powersgd_hook_split([(4096,)], 1) == powersgd_hook_split([(4096,)], 1, min_compression_rate=1.0)
    assert powersgd_hook_split([(4096,)], 1).dense == 4 * 4096
    assert powersgd_hook_split([(4, 3)], 1).dense == 4 * 12
    s = powersgd_hook_split([(16, 3, 3, 3)], 1)
    assert (s.dense, s.p, s.q, s.matrices) == (0.0, 4 * 16, 4 * 27, 4 * 432)
    s = powersgd_hook_split([(64, 64, 3, 3)], 4, itemsize=2)
    assert (s.dense, s.p, s.q) == (0.0, 2 * 64 * 4, 2 * 576 * 4)
    assert psgd._should_compress(64, 576, 4, 2)[0] and not psgd._should_compress(4, 3, 1, 2)[0]
