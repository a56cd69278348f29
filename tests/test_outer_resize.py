"""Resuming the outer loop with another number of nodes (OuterLoop.load_resized): 2 nodes as 3,
3 as 2, and 2 nodes of 2 ranks as 3 nodes of 1. Checked in float64 here, from the saved states
and what the test observes: the anchors and the outer momentum carry over unchanged, the total
that error feedback owed (every old rank's residuals, placed at their elements and summed)
carries over exactly, split evenly over the new ranks, and the first meeting after the resume
spends it: what the new ranks feed in (their pseudo-gradients plus the carried total) is what
was applied (the world size times the mean, solved from the outer step) plus what they owe
after it."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync.collectives import Topology
from gradsync.outer import OuterLoop
from worlds import run_world

EVERY, SAVED_AT, MORE = 3, 7, 3  # saved one step after the meeting of step 6; the next meets at 9
KW = {"every": EVERY, "codec": "topk:density=0.3", "outer_lr": 0.8, "outer_momentum": 0.5, "nesterov": True}
LR, MOMENTUM = KW["outer_lr"], KW["outer_momentum"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 6, generator=g)
    return x, torch.tanh(x @ torch.linspace(-1, 1, 18).view(6, 3))


def numels() -> list[int]:
    return [p.numel() for p in Net().parameters()]


def owed_in(state: dict) -> torch.Tensor:
    """What one saved rank owed, placed at its elements of the (single) fragment, in float64:
    written out here from the stream table (key, offset, residual), not with the library's helper."""
    total = torch.zeros(sum(numels()), dtype=torch.float64)
    (codec,) = state["ledger"]["codecs"]
    for stream in codec["streams"].values():
        r = stream["residual"].reshape(-1).double()
        start = int(stream["offset"])
        n = min(r.numel(), total.numel() - start)
        total[start : start + n] += r[:n]
    return total


def _train(nodes: int, per_node: int, steps: int, start: int, outer: OuterLoop, net: nn.Module) -> None:
    model = DDP(net, process_group=outer.inner_group) if per_node > 1 else net
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for t in range(start + 1, start + steps + 1):
        x, y = data(dist.get_rank(), t)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
        outer.step()


def _save(folder: str, nodes: int, per_node: int) -> None:
    net = Net()
    outer = OuterLoop(net, topology=Topology(nodes=nodes, per_node=per_node), **KW)
    _train(nodes, per_node, SAVED_AT, 0, outer, net)
    torch.save(outer.state_dict(), os.path.join(folder, f"outer-{dist.get_rank()}.pt"))
    outer.close()


def _resume(folder: str, nodes: int, per_node: int, old_world: int) -> None:
    states = [torch.load(os.path.join(folder, f"outer-{r}.pt"), weights_only=True) for r in range(old_world)]
    world = dist.get_world_size()
    net = Net()
    outer = OuterLoop(net, topology=Topology(nodes=nodes, per_node=per_node), **KW)
    outer.load_resized(states)
    # the shared state, unchanged
    for a, saved in zip(outer.anchors, states[0]["anchors"], strict=True):
        assert torch.equal(a, saved)
    buffers = [states[0]["outer"]["state"][i]["momentum_buffer"].double() for i in range(len(outer.anchors))]
    for i, b in enumerate(buffers):
        assert torch.equal(outer.outer.state[outer.anchors[i]]["momentum_buffer"].double(), b)
    assert outer.inner_steps == SAVED_AT and outer.meetings == states[0]["meetings"]
    # the owed total: every old rank's, summed, is what the new ranks hold, each an equal share
    saved_total = sum(owed_in(s) for s in states)
    assert float(saved_total.abs().sum()) > 0
    mine = outer.owed()[0]
    torch.testing.assert_close(mine, saved_total / world, rtol=1e-6, atol=1e-7)
    total = mine.clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, saved_total, rtol=1e-6, atol=1e-7)
    # every node starts from the shared model; train on to the next meeting and past it
    with torch.no_grad():
        for p, a in zip(net.parameters(), outer.anchors, strict=True):
            p.copy_(a)
    anchors = torch.cat([a.double().reshape(-1) for a in outer.anchors])
    _train(nodes, per_node, EVERY - SAVED_AT % EVERY - 1, SAVED_AT, outer, net)  # up to the step before it
    model = DDP(net, process_group=outer.inner_group) if per_node > 1 else net
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    t = outer.inner_steps + 1
    assert outer.due(0, t)
    x, y = data(dist.get_rank(), t)
    F.mse_loss(model(x), y).backward()
    opt.step()
    fed = anchors - torch.cat([p.detach().double().reshape(-1) for p in net.parameters()])
    outer.step()
    moved = anchors - torch.cat([a.double().reshape(-1) for a in outer.anchors])
    # Nesterov SGD: moved = lr (m + mu (mu buf + m)), so the applied mean is
    buf = torch.cat([b.reshape(-1) for b in buffers])
    mean = (moved / LR - MOMENTUM**2 * buf) / (1 + MOMENTUM)
    fed_all = fed.clone()
    dist.all_reduce(fed_all)  # every rank's pseudo-gradient (the ranks of a node hold the same)
    owed_after = outer.owed()[0].clone()
    dist.all_reduce(owed_after)
    # per node the ranks' copies are summed before one rank encodes each shard: world x mean
    torch.testing.assert_close(fed_all + saved_total, world * mean + owed_after, rtol=1e-4, atol=1e-5)
    assert not outer.ledger.carry.local  # spent at the meeting
    _train(nodes, per_node, EVERY, t, outer, net)  # and on, through another meeting
    flat = torch.cat([a.double().reshape(-1) for a in outer.anchors])
    ref = flat.clone()
    dist.broadcast(ref, 0)
    assert torch.equal(flat, ref) and torch.isfinite(flat).all()
    outer.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("before", "after"),
    [((2, 1), (3, 1)), ((3, 1), (2, 1)), ((2, 2), (3, 1))],
    ids=["2x1-as-3x1", "3x1-as-2x1", "2x2-as-3x1"],
)
def test_a_resume_with_another_number_of_nodes_keeps_the_outer_state_and_owed(tmp_path, before, after):
    run_world(before[0] * before[1], _save, str(tmp_path), *before)
    run_world(after[0] * after[1], _resume, str(tmp_path), *after, before[0] * before[1])


def _refusals(folder: str) -> None:
    states = [torch.load(os.path.join(folder, f"outer-{r}.pt"), weights_only=True) for r in range(2)]
    outer = OuterLoop(Net(), topology=Topology(nodes=2, per_node=1), **KW)
    with pytest.raises(ValueError, match="needs the state_dict"):
        outer.load_resized([])
    with pytest.raises(ValueError, match="states of all 2 ranks"):
        outer.load_resized(states[:1])
    other = [{**s, "config": {**s["config"], "every": 5}} for s in states]
    with pytest.raises(ValueError, match=r"another configuration \(every: saved 5 vs now 3\)"):
        outer.load_resized(other)
    forged = [states[0], {**states[1], "anchors": [a + 1 for a in states[1]["anchors"]]}]
    with pytest.raises(ValueError, match="disagree on the shared model"):
        outer.load_resized(forged)
    outer.close()


@pytest.mark.timeout(120)
def test_load_resized_refuses_bad_states_on_every_rank(tmp_path):
    run_world(2, _save, str(tmp_path), 2, 1)
    run_world(2, _refusals, str(tmp_path))


@pytest.mark.timeout(400)
def test_gradsync_train_outer_resumes_on_another_number_of_nodes(tmp_path, monkeypatch, capfd):
    """A run of 2 nodes that died after its checkpoint of step 8 goes on as 3 nodes: the shared
    model and what error feedback owed carry over, and the data position keeps the samples the
    epoch had consumed (8 batches of 48 on 2 ranks: 768 samples, 5 whole batches of 48 on 3)."""
    import json

    from gradsync.apps.commands import main
    from gradsync.apps.train import checkpoint

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["train", "--data", "digits", "--model", "vgg-small", "--batch-size", "48", "--epochs", "2",
            "--quiet", "--outer", "4", "--outer-codec", "chunktopk:density=0.1,chunk=64",
            "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    two = ["--nproc", "2", "--nodes", "2", "--per-node", "1", "--checkpoint-every", "8"]
    two += ["--crash-at-step", "10"]
    assert main([*base, *two]) == 1  # the last rank died at step 10, no restarts
    folder = checkpoint.latest(tmp_path / "ckpt")
    assert folder is not None and folder.name == "step-00000008"
    out = tmp_path / "s.json"
    three = ["--nproc", "3", "--nodes", "3", "--per-node", "1", "--resume", "--json", str(out)]
    assert main([*base, *three]) == 0
    err = capfd.readouterr().err
    assert "saved by 2 ranks (2 nodes), on 3 (3 nodes)" in err, err[-3000:]
    assert "epoch 1, batch 5, step 5" in err, err[-3000:]
    s = json.loads(out.read_text())
    assert s["nodes"] == 3 and s["final"]["val_accuracy"] > 0.3
