"""The fault-tolerant outer loop (gradsync.outer.ft, over torchft) with nodes that die.

Three nodes of one process each meet through a lighthouse in the test process. One node is
SIGKILLed, mid-exchange (between its header and its payload) or between two meetings, and
started again. Checked, from what the test itself observes (parameters before a meeting,
anchors after it) and not from the loop's own reports:

- the survivors never restart (the processes the test started are the ones that finish);
- the restarted node heals (its first inner step is the one after the survivors' meeting it
  joined, taken from the healed data position; the steps in between are skipped, none repeated);
- every node ends with the same anchors and parameters, bit for bit, and every exchange was
  applied identically by everyone who applied it (never half applied);
- the error-feedback books: for every applied exchange, what the contributing nodes fed in
  (their pseudo-gradients, anchor minus parameters) minus what was applied (the contributors
  times the mean, from the anchors' movement under a plain-average outer step) is what their
  residuals owe now, summed over the live nodes, plus what the dead node owed at its last
  applied exchange (which died with it).

Also: nodes of two ranks each (every rank carries its slice; dense, the result is the float64
DiLoCo reference of tests/test_outer_loop.py), ``gradsync train --fault-tolerant`` with a node
that kills itself and comes back, and the option errors.

Skipped when torchft is not installed (it is the optional extra gradsync[ft]).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("RUST_LOG", "warn")  # (torchft logs every quorum otherwise; set before its import)
pytest.importorskip("torchft")

from gradsync.outer import ft as ft_module
from gradsync.outer.ft import FaultTolerance, FaultTolerantOuterLoop, start_lighthouse
from worlds import process_context

NODES = ["n0", "n1", "n2"]
EVERY = 4
STEPS = 36
CODEC = "topk:density=0.3"  # biased: error feedback keeps what it leaves out


class Net(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)  # every node differently: the first meeting takes node 0's
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def data(node: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Node ``node``'s batch at data position ``step`` (its own shard)."""
    g = torch.Generator().manual_seed(1000 * node + step)
    x = torch.randn(8, 6, generator=g)
    return x, torch.tanh(x @ torch.linspace(-1, 1, 18).view(6, 3))


def flat(ts) -> torch.Tensor:
    return torch.cat([t.detach().double().reshape(-1) for t in ts])


def _replica(cfg: dict) -> None:
    """One node: trains STEPS inner steps under the fault-tolerant loop, logging what it sees."""
    torch.set_num_threads(1)
    name, node, life = cfg["name"], NODES.index(cfg["name"]), cfg["life"]
    out = Path(cfg["dir"]) / f"{name}-life{life}.pt"
    log: dict = {"pid": os.getpid(), "trained": [], "meetings": [], "healed_position": None}
    position = {"next": 1}  # the data position: the inner step whose batch comes next

    def save_position():
        return {"next": position["next"]}

    def load_position(state):
        position["next"] = int(state["next"])
        log["healed_position"] = position["next"]

    def write():
        tmp = out.with_suffix(".tmp")
        torch.save(log, tmp)
        os.replace(tmp, out)

    loop: list[FaultTolerantOuterLoop] = []
    if cfg.get("kill") == "exchange" and life == 1:
        gather = ft_module._gather

        def dying_gather(pg, t):  # the payload of the meeting after kill_at: die between header and payload
            if loop and t.dtype == torch.uint8 and loop[0].inner_steps == cfg["kill_at"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return gather(pg, t)

        ft_module._gather = dying_gather

    net = Net(seed=100 + node + 10 * life)
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    fault = FaultTolerance(
        lighthouse=cfg["lighthouse"], replica_id=name, nodes=len(NODES), timeout_s=10.0,
        quorum_timeout_s=60.0, join_timeout_s=60.0, max_retries=5,
    )  # fmt: skip
    outer = FaultTolerantOuterLoop(
        net, fault_tolerance=fault, every=EVERY, codec=CODEC, outer_lr=1.0, outer_momentum=0.0,
        extra_state={"data": (load_position, save_position)},
    )  # fmt: skip
    loop.append(outer)
    log["joined_at"] = outer.inner_steps
    log["recoveries_at_join"] = outer.recoveries
    write()
    while outer.inner_steps < STEPS:
        t = position["next"]
        assert t == outer.inner_steps + 1, (t, outer.inner_steps)
        log["trained"].append(t)
        x, y = data(node, t)
        opt.zero_grad()
        F.mse_loss(net(x), y).backward()
        opt.step()
        position["next"] = t + 1
        write()
        if cfg.get("kill") == "between" and life == 1 and t == cfg["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)
        meeting = outer.due(0, t)
        if meeting:
            anchors, params = flat(outer.anchors), flat(net.parameters())
            recoveries = outer.recoveries
        outer.step()
        if meeting:
            contributed = outer.recoveries == recoveries
            log["meetings"].append(
                {
                    "t": t,
                    "step": outer.manager.current_step(),  # the exchange applied: its number + 1
                    "contributed": contributed,
                    "d": anchors - params if contributed else None,  # this node's pseudo-gradient
                    "m": anchors - flat(outer.anchors),  # the applied mean (outer lr 1, no momentum)
                    "anchors": flat(outer.anchors),
                    "owed": outer.owed()[0].clone(),
                    "at": time.time(),
                }
            )
            write()
        time.sleep(cfg["pace"])
    log["final_anchors"] = flat(outer.anchors)
    log["final_params"] = flat(net.parameters())
    log["owed"] = outer.owed()[0].clone()
    log["recoveries"] = outer.recoveries
    log["heal_seconds"] = list(outer.heal_seconds)
    log["failed_exchanges"] = outer.failed_exchanges
    write()
    outer.close()


def run_nodes(tmp_path: Path, kill: str, kill_at: int) -> dict[str, dict]:
    """Start the lighthouse and the nodes, SIGKILL (through the victim itself) and restart
    ``n2``; return every life's log."""
    lighthouse = start_lighthouse(min_nodes=1, join_timeout_s=30.0, heartbeat_timeout_s=1.0)
    ctx = process_context()
    procs: dict[str, object] = {}
    base = {"dir": str(tmp_path), "lighthouse": lighthouse.address, "pace": 0.08}
    try:
        for name in NODES:
            cfg = {**base, "name": name, "life": 1}
            if name == "n2":
                cfg.update(kill=kill, kill_at=kill_at)
            procs[name] = ctx.Process(target=_replica, args=(cfg,), daemon=True)
            procs[name].start()
        started = {name: p.pid for name, p in procs.items()}
        deadline = time.monotonic() + 150
        restarted = False
        while time.monotonic() < deadline:
            if not restarted and procs["n2"].exitcode is not None:
                assert procs["n2"].exitcode == -signal.SIGKILL, procs["n2"].exitcode
                procs["n2-life2"] = ctx.Process(target=_replica, args=({**base, "name": "n2", "life": 2},),
                                                daemon=True)  # fmt: skip
                procs["n2-life2"].start()
                restarted = True
            if restarted and all(p.exitcode is not None for p in procs.values()):
                break
            time.sleep(0.05)
        codes = {name: p.exitcode for name, p in procs.items()}
        assert restarted and codes == {"n0": 0, "n1": 0, "n2": -signal.SIGKILL, "n2-life2": 0}, codes
    finally:
        for p in procs.values():
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                p.join(5)
        lighthouse.close()
    logs = {f.stem: torch.load(f, weights_only=False) for f in tmp_path.glob("*.pt")}
    for name in ("n0", "n1"):  # the survivors are the processes started first: no restart
        assert logs[f"{name}-life1"]["pid"] == started[name]
    return logs


def check_run(logs: dict[str, dict], kill_at: int) -> None:
    survivors = [logs["n0-life1"], logs["n1-life1"]]
    dead, back = logs["n2-life1"], logs["n2-life2"]
    finals = [*survivors, back]
    # equal models at the end, bit for bit
    for log in finals[1:]:
        assert torch.equal(log["final_anchors"], finals[0]["final_anchors"])
        assert torch.equal(log["final_params"], finals[0]["final_params"])
    # every exchange applied identically by whoever applied it
    by_step: dict[int, list[dict]] = {}
    for log in [*finals, dead]:
        for m in log["meetings"]:
            by_step.setdefault(m["step"], []).append(m)
    mean = {}
    for step, ms in by_step.items():
        for m in ms[1:]:
            assert torch.equal(m["anchors"], ms[0]["anchors"]), step
        moved = [m["m"] for m in ms if m["contributed"]]
        assert all(torch.equal(x, moved[0]) for x in moved), step
        mean[step] = (len(moved), moved[0])  # (contributors, the mean they applied)
    # the survivors applied every exchange, one after the other
    for log in survivors:
        steps = [m["step"] for m in log["meetings"]]
        assert steps == list(range(steps[0], steps[0] + len(steps))) and len(steps) == STEPS // EVERY
    # the restarted node healed in the survivors' meeting right after its start
    assert back["recoveries_at_join"] == 1 and back["heal_seconds"], back
    healed = back["healed_position"]
    assert healed is not None and back["joined_at"] == healed - 1 and (healed - 1) % EVERY == 0
    assert back["trained"] == list(range(healed, STEPS + 1))
    # ... so the data of the steps it was away (if any: it may make the survivors' retry of the
    # meeting it died in) is skipped, and nothing is trained twice
    assert dead["trained"] == list(range(1, kill_at + 1))
    assert healed >= kill_at + 1
    # the books of error feedback
    fed = sum(m["d"] for log in [*finals, dead] for m in log["meetings"] if m["contributed"])
    applied = sum(count * m for count, m in mean.values())
    owed_live = sum(log["owed"] for log in finals)
    owed_dead = dead["meetings"][-1]["owed"] if dead["meetings"] else 0.0
    torch.testing.assert_close(fed - applied, owed_live + owed_dead, atol=1e-5, rtol=1e-5)
    assert float(owed_live.abs().sum()) > 0  # the codec did leave things out


@pytest.mark.timeout(240)
def test_a_node_killed_mid_exchange_is_dropped_then_heals(tmp_path):
    """n2 dies between its header and its payload in the meeting after step 8: the survivors'
    exchange fails and is retried without it, never half applied."""
    logs = run_nodes(tmp_path, "exchange", kill_at=8)
    assert logs["n0-life1"]["failed_exchanges"] >= 1  # the interrupted exchange was discarded
    check_run(logs, kill_at=8)


@pytest.mark.timeout(240)
def test_a_node_killed_between_meetings_is_dropped_then_heals(tmp_path):
    """n2 dies after inner step 10, between two meetings: the next quorum goes on without it."""
    logs = run_nodes(tmp_path, "between", kill_at=10)
    check_run(logs, kill_at=10)


def test_bad_fault_tolerance_options_are_refused():
    with pytest.raises(ValueError, match="min_nodes must be at most nodes"):
        FaultTolerance("http://127.0.0.1:1", "n0", nodes=2, min_nodes=3)
    with pytest.raises(ValueError, match="nodes must be an integer >= 1"):
        FaultTolerance("http://127.0.0.1:1", "n0", nodes=0)
    with pytest.raises(ValueError, match="replica_id must be a non-empty string"):
        FaultTolerance("http://127.0.0.1:1", "")
    with pytest.raises(ValueError, match="timeout_s must be a positive number of seconds"):
        FaultTolerance("http://127.0.0.1:1", "n0", timeout_s=0)
    fault = FaultTolerance("http://127.0.0.1:1", "n0")
    with pytest.raises(ValueError, match="needs whole matrices"):
        FaultTolerantOuterLoop(Net(0), fault_tolerance=fault, codec="powersgd:rank=1")
    with pytest.raises(TypeError, match="fault_tolerance must be"):
        FaultTolerantOuterLoop(Net(0), fault_tolerance="http://x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="extra_state maps a key"):
        FaultTolerantOuterLoop(Net(0), fault_tolerance=fault, extra_state={"data": 3})  # type: ignore[dict-item]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--fault-tolerant"], "--fault-tolerant needs --outer H"),
        (["--outer", "4", "--fault-tolerant"], "--fault-tolerant needs --nodes N and --per-node P"),
        (["--outer", "4", "--min-nodes", "2"], "--min-nodes need --fault-tolerant"),
        (["--outer", "4", "--lighthouse", "http://127.0.0.1:1"], "--lighthouse need --fault-tolerant"),
    ]
    + [
        (["--outer", "4", "--nodes", "2", "--per-node", "1", "--fault-tolerant", *more], message)
        for more, message in [
            (["--outer-delay", "1"], "--fault-tolerant with --outer-delay 1"),
            (["--outer-codec", "powersgd:rank=2"], "needs whole matrices"),
            (["--min-nodes", "3"], "--min-nodes must be at most --nodes (2), got 3"),
            (["--node-index", "2"], "--node-index must be in [0, --nodes) = [0, 2), got 2"),
            (["--checkpoint-dir", "ckpt"], "--fault-tolerant with --checkpoint-dir: not offered yet"),
            (["--trace", "t.json"], "--fault-tolerant with --trace: not offered yet"),
        ]
    ],
)
def test_train_refuses_bad_fault_tolerant_options_before_any_work(extra, message, capsys):
    from gradsync.apps.commands import main

    assert main(["train", "--epochs", "1", *extra]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_gradsync_train_fault_tolerant_heals_a_killed_node(tmp_path, monkeypatch, capfd):
    """`gradsync train --fault-tolerant`: a lighthouse here and each node under a torchrun of its
    own. Node 1 kills itself after step 10; its torchrun restarts it, and it heals from node 0 in
    node 0's next meeting (--min-nodes 2: node 0 waits there for it) and the run ends on both
    nodes with the same model (the same validation figures)."""
    import json

    from gradsync.apps.commands import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "s.json"
    argv = ["train", "--nodes", "2", "--per-node", "1", "--data", "digits", "--model", "vgg-small",
            "--batch-size", "48", "--epochs", "2", "--quiet", "--outer", "4", "--outer-codec",
            "chunktopk:density=0.1,chunk=64", "--fault-tolerant", "--min-nodes", "2", "--crash-at-step", "10",
            "--max-restarts", "1", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    err = capfd.readouterr().err
    assert "kills itself at step 10" in err
    assert "node 1 healed from a live peer" in err and "goes on at epoch 1, step 12" in err
    epochs = [line for line in err.splitlines() if line.startswith("epoch 2:")]
    assert len(epochs) == 2 and len({line.split("val acc ")[1].split(",")[0] for line in epochs}) == 1, epochs
    s = json.loads(out.read_text())
    assert s["final"]["val_accuracy"] > 0.3 and s["final"]["bytes_per_step_inter"] > 0


def _node_rank(cfg: dict) -> None:
    """Rank ``cfg['rank']`` of node ``cfg['node']``: the node a world of two of its own (a
    FileStore per node), DDP inside it, the fault-tolerant loop across nodes."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from test_outer_loop import INNER_LR, Net, data, reference

    torch.set_num_threads(1)
    node, rank = cfg["node"], cfg["rank"]
    store = dist.FileStore(cfg["store"], 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        net = Net()
        fault = FaultTolerance(lighthouse=cfg["lighthouse"], replica_id=f"n{node}", nodes=2, timeout_s=10.0,
                               quorum_timeout_s=60.0, join_timeout_s=60.0)  # fmt: skip
        outer = FaultTolerantOuterLoop(net, fault_tolerance=fault, every=3, codec=cfg["codec"])
        model = DDP(net, process_group=outer.inner_group)
        opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
        for t in range(1, 8):
            x, y = data(node * 2 + rank, t)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            outer.step()
        got = [p.detach().double() for p in net.parameters()]
        if cfg["codec"] is None:  # lossless: DiLoCo written out in float64 (tests/test_outer_loop.py)
            for p, want in zip(got, reference(7, 3, [[0, 1, 2, 3]], 0, 0.0)[node], strict=True):
                torch.testing.assert_close(p, want, atol=2e-5, rtol=1e-4)
        torch.save({"anchors": flat(outer.anchors), "sent": outer.traffic.sent}, cfg["out"])
        outer.close()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("codec", [None, CODEC])
def test_two_ranks_per_node_each_carry_a_slice(tmp_path, codec):
    """Nodes of two ranks: each rank carries its slice of the pseudo-gradient across nodes and
    the node gathers the slices. Dense, the result is DiLoCo's (the float64 reference of
    tests/test_outer_loop.py); with a codec, every rank of both nodes ends with the same anchors."""
    lighthouse = start_lighthouse(min_nodes=1, join_timeout_s=30.0, heartbeat_timeout_s=1.0)
    ctx = process_context()
    procs = []
    try:
        for node in range(2):
            for rank in range(2):
                cfg = {"node": node, "rank": rank, "store": str(tmp_path / f"store{node}"), "codec": codec,
                       "lighthouse": lighthouse.address}  # fmt: skip
                cfg["out"] = str(tmp_path / f"out{node}{rank}.pt")
                procs.append(ctx.Process(target=_node_rank, args=(cfg,), daemon=True))
                procs[-1].start()
        for p in procs:
            p.join(150)
        assert [p.exitcode for p in procs] == [0] * 4
    finally:
        for p in procs:
            if p.pid is not None and p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
        lighthouse.close()
    outs = [torch.load(tmp_path / f"out{n}{r}.pt", weights_only=False) for n in range(2) for r in range(2)]
    for out in outs[1:]:
        assert torch.equal(out["anchors"], outs[0]["anchors"])
    assert all(out["sent"].get("inter", 0) > 0 and out["sent"].get("intra", 0) > 0 for out in outs)
