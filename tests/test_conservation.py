"""One conservation harness for the three fronts: ``gradsync.wrap``, the DDP comm hook and FSDP2.

The same scenarios run through every front, through the public API only, on one spawned gloo
world of 4 ranks (2 nodes x 2 for wrap and the hook; a 2 x 2 replicate x shard mesh for FSDP2).
After every step, per parameter name, in float64:

    sum over steps of the mean over ranks of the raw local gradient
        == sum over applied steps of the synchronized gradient left in p.grad (/ the loss scale)
           + sum over ranks of front.owed_gradients()[name]

The left side is independent of gradsync: an untouched twin of the model (given the front's
current parameters before each step) computes each rank's raw gradient, and a plain
``dist.all_reduce`` averages it. The scenarios:

1. ``unused``: a branch unused on every rank at some steps, on one rank only at another;
2. ``overflow``: under a GradScaler one rank's loss is multiplied by inf at one step: every rank
   skips it (its gradients are not finite, its scale drops, its parameters stay), what is owed
   is unchanged by it, and the step counts as neither computed nor applied;
3. ``resume``: the state saved at step k (through ``torch.save`` / ``weights_only`` load) goes
   into a fresh front around a fresh model with the same weights, and the run goes on;
4. ``layout``: what changes a front's layout or plan, around a resume at step 4: wrap: a
   parameter frozen for two steps and ``dense_from_step`` (after which nothing is owed); the
   hook: the resume goes into a new DDP model with other buckets (its first iteration is dense:
   nothing owed after it), then ``dense_from_step``; FSDP2: a parameter frozen for two steps
   (its module's flat layout changes).

Each (front, scenario) is one check of the world and one parametrization here, so a failure
names its front and scenario and the others still run.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import gradsync
from gradsync.collectives import Topology
from gradsync.fsdp import compress_fsdp
from worlds import WorldFailed, expect_all, named_check, run_checks, run_world

pytestmark = pytest.mark.timeout(300)

WORLD = 4
REL_TOL = 2e-5  # float32 models (wrap, hook): relative to the largest reference element
ABS_TOL = 1e-10  # float64 model (FSDP2)
LR = 0.1
SCALE = 2.0**10


# ------------------------------------------------------------------------------------ the model
class Block(nn.Module):
    """A layer and a side branch that a step may leave out (a parameter unused in that step,
    inside one FSDP module)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.side = nn.Linear(width, width)

    def forward(self, h: torch.Tensor, side: bool) -> torch.Tensor:
        h = torch.tanh(self.lin(h))
        return h + self.side(h) if side else h


class Net(nn.Module):
    """The model of every front. The width is odd so that FSDP pads dim 0 of its shards."""

    def __init__(self, width: int = 31) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.trunk = nn.Linear(16, width)
        self.body = Block(width)
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor, side: bool = True) -> torch.Tensor:
        return self.head(self.body(torch.tanh(self.trunk(x)), side))


FROZEN = "body.lin.bias"  # the parameter the layout scenario freezes


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + step)
    x = torch.randn(8, 16, generator=g)
    return x.to(dtype), torch.tanh(x @ torch.linspace(-1.0, 1.0, 64).view(16, 4)).to(dtype)


def fresh_net(params: dict[str, torch.Tensor], dtype: torch.dtype) -> Net:
    """A new model with these (full) parameters."""
    net = Net().to(dtype)
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(params[n].view_as(p))
    return net


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """A state as a checkpoint gives it back: saved, then loaded with ``weights_only``."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------------------- the scenarios
@dataclasses.dataclass(frozen=True)
class Scenario:
    name: str
    steps: int
    unused: tuple[tuple[int, int | None], ...] = ()  # (step, rank): side branch unused; None: all
    overflow: tuple[int, int] | None = None  # (step, rank): that rank's loss times inf
    resume_after: int | None = None  # save after this step, go on in a fresh front
    rebucket: bool = False  # ... whose layout differs (the hook: other DDP buckets)
    frozen: tuple[int, ...] = ()  # steps at which FROZEN has requires_grad=False
    dense_from: int | None = None  # dense_from_step

    def side(self, step: int, rank: int) -> bool:
        return not any(s == step and r in (None, rank) for s, r in self.unused)

    def events(self) -> set[str]:
        asked = {
            "unused": bool(self.unused),
            "overflow": self.overflow is not None,
            "resume": self.resume_after is not None,
            "rebucket": self.rebucket,
            "freeze": bool(self.frozen),
            "dense_from": self.dense_from is not None,
        }
        return {k for k, v in asked.items() if v}


SCENARIOS = {
    s.name: s
    for s in (
        Scenario("unused", steps=8, unused=((2, None), (5, 1), (6, None))),
        Scenario("overflow", steps=6, overflow=(3, 2)),
        Scenario("resume", steps=8, unused=((5, 1),), resume_after=3),
        Scenario("layout", steps=10, resume_after=4, rebucket=True, frozen=(2, 3), dense_from=7),
    )
}


# ------------------------------------------------------------------------------------- the fronts
class Front:
    """One front behind the harness's calls: build around a model, train steps, say what it
    applied and what it owes, save and resume into a fresh model."""

    name = ""
    dtype = torch.float32
    events: frozenset[str] = frozenset()  # the scenario events this front has
    dense_after_load = False  # its first iteration after a load is dense (nothing owed after it)

    def __init__(self, shared: Shared, scenario: Scenario) -> None:
        self.shared = shared
        self.scenario = scenario
        self.scaler: torch.amp.GradScaler | None = None
        if scenario.overflow is not None:
            self.scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=1000)
        self.module: nn.Module = nn.Module()
        self.opt: torch.optim.Optimizer | None = None

    # ---- what each front implements
    def build(self, net: Net, resumed: bool) -> None:
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        raise NotImplementedError

    def params(self) -> dict[str, torch.Tensor]:
        """Full parameters, detached (collective under FSDP)."""
        return {n: p.detach().clone() for n, p in self.module.named_parameters()}

    def grads(self) -> dict[str, torch.Tensor]:
        """The synchronized gradient left in each p.grad (full, flat, float64, as it is)."""
        return {
            n: p.grad.double().reshape(-1) for n, p in self.module.named_parameters() if p.grad is not None
        }

    def owed(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def save(self) -> dict[str, Any]:
        raise NotImplementedError

    def load(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass

    # ---- common
    def start(self) -> None:
        self.build(Net().to(self.dtype), resumed=False)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR)

    def resume(self) -> None:
        """Save, close, and go on in a fresh front around a fresh model with the same weights."""
        state = roundtrip(self.save())
        net = fresh_net(self.params(), self.dtype)
        self.close()
        self.build(net, resumed=True)
        self.opt = torch.optim.SGD(self.module.parameters(), lr=LR)
        self.load(state)

    def backward(self, x: torch.Tensor, y: torch.Tensor, side: bool, factor: float) -> None:
        loss = nn.functional.mse_loss(self(x, side), y) * factor
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> None:
        assert self.opt is not None
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0


class Shared:
    """What every check of the world shares (process groups are slow to make)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.topo = Topology(nodes=2, per_node=2)
        self.mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


WRAP_SCHEME = "allgather/topk:density=0.1+ef"
FSDP_SCHEME = "topk:density=0.2+ef"


class WrapFront(Front):
    name = "wrap"
    events = frozenset({"unused", "overflow", "resume", "freeze", "dense_from"})

    def build(self, net: Net, resumed: bool) -> None:
        options: dict[str, Any] = {}
        if self.scenario.dense_from is not None:
            options["dense_from_step"] = self.scenario.dense_from
        self.gs = gradsync.wrap(
            net, WRAP_SCHEME, self.shared.topo, plan="compress", min_compress_bytes=0, bucket_bytes=6000,
            calibrate=False, log_plan=False, find_unused_parameters=True, grad_scaler=self.scaler, **options,
        )  # fmt: skip
        self.module = self.gs.module

    def __call__(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        return self.gs(x, side)

    def owed(self) -> dict[str, torch.Tensor]:
        return self.gs.owed_gradients()

    def save(self) -> dict[str, Any]:
        return self.gs.sync_state_dict()

    def load(self, state: dict[str, Any]) -> None:
        self.gs.load_sync_state_dict(state)

    def close(self) -> None:
        self.gs.close()


class HookFront(Front):
    name = "hook"
    events = frozenset({"unused", "overflow", "resume", "rebucket", "dense_from"})
    dense_after_load = True

    def build(self, net: Net, resumed: bool) -> None:
        options: dict[str, Any] = {}
        if self.scenario.dense_from is not None:
            options["dense_from_step"] = self.scenario.dense_from
        cap = 25.0 if resumed and self.scenario.rebucket else 0.004  # one bucket, or one per layer or so
        self.ddp = DistributedDataParallel(net, find_unused_parameters=True, bucket_cap_mb=cap)
        self.state = gradsync.register_comm_hook(
            self.ddp, WRAP_SCHEME, self.shared.topo, grad_scaler=self.scaler, plan="compress",
            min_compress_bytes=0, log_plan=False, **options,
        )  # fmt: skip
        self.module = self.ddp.module

    def __call__(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        return self.ddp(x, side)

    def owed(self) -> dict[str, torch.Tensor]:
        return self.state.owed_gradients()

    def save(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)

    def close(self) -> None:
        self.state.close()


class FsdpFront(Front):
    name = "fsdp"
    dtype = torch.float64
    events = frozenset({"unused", "overflow", "resume", "freeze"})

    def build(self, net: Net, resumed: bool) -> None:
        mesh = self.shared.mesh
        for block in (net.trunk, net.body, net.head):
            fully_shard(block, mesh=mesh["shard"])
        fully_shard(net, mesh=mesh["shard"])
        self.comp = compress_fsdp(
            net, FSDP_SCHEME, replicate_group=mesh["replicate"].get_group(), where="both",
            min_compress_bytes=0, grad_scaler=self.scaler,
        )  # fmt: skip
        self.module = net

    def __call__(self, x: torch.Tensor, side: bool) -> torch.Tensor:
        return self.module(x, side)

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in self.module.named_parameters()}

    def grads(self) -> dict[str, torch.Tensor]:
        return {
            n: p.grad.full_tensor().detach().double().reshape(-1)
            for n, p in self.module.named_parameters()
            if p.grad is not None
        }

    def owed(self) -> dict[str, torch.Tensor]:
        return self.comp.owed_gradients()

    def save(self) -> dict[str, Any]:
        return self.comp.state_dict()

    def load(self, state: dict[str, Any]) -> None:
        self.comp.load_state_dict(state)


FRONTS: dict[str, type[Front]] = {f.name: f for f in (WrapFront, HookFront, FsdpFront)}


def applies(front: type[Front], scenario: Scenario) -> bool:
    """A scenario runs through a front when the front has one of its events; the events it lacks
    are left out (the layout scenario is each front's own layout change)."""
    return bool(scenario.events() & front.events)


def for_front(front: type[Front], scenario: Scenario) -> Scenario:
    """The scenario without the events this front lacks."""
    lacks = scenario.events() - front.events
    return dataclasses.replace(
        scenario,
        unused=() if "unused" in lacks else scenario.unused,
        overflow=None if "overflow" in lacks else scenario.overflow,
        resume_after=None if "resume" in lacks else scenario.resume_after,
        rebucket=False if "rebucket" in lacks else scenario.rebucket,
        frozen=() if "freeze" in lacks else scenario.frozen,
        dense_from=None if "dense_from" in lacks else scenario.dense_from,
    )


# ------------------------------------------------------------------------------------- the driver
def off_by(front: Front, a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    """Whether ``a`` matches the reference ``b`` within the front's tolerance, and by how much."""
    err = float((a - b).abs().max()) if a.numel() else 0.0
    if front.dtype == torch.float64:
        return err <= ABS_TOL, f"max abs error {err:.3e} (tolerance {ABS_TOL:.0e})"
    scale = max(float(b.abs().max()), 1e-12)
    return (
        err / scale <= REL_TOL,
        f"max abs error {err:.3e}, relative {err / scale:.3e} (tolerance {REL_TOL:.0e})",
    )


def summed(t: torch.Tensor) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t)
    return t


def conserve(shared: Shared, front_name: str, scenario_name: str) -> None:
    """Run the scenario through the front (one check of the world); recorded when it passed."""
    cls = FRONTS[front_name]
    front = cls(shared, for_front(cls, SCENARIOS[scenario_name]))
    front.start()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the fronts' notes (a frozen parameter waits...)
            run_scenario(front, f"{front_name}/{scenario_name}")
    finally:
        front.close()
    with open(os.path.join(shared.folder, f"passed-rank{dist.get_rank()}.txt"), "a") as fh:
        fh.write(f"{front_name}/{scenario_name}\n")


def run_scenario(front: Front, label: str) -> None:
    """Train the front through its scenario and check the invariant after every step (module
    docstring), with what each event promises besides."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sc, cls = front.scenario, type(front)
    names = [n for n, _ in front.module.named_parameters()]
    twin = Net().to(front.dtype)  # never touched by gradsync
    wanted = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in twin.named_parameters()}
    applied = {n: torch.zeros_like(w) for n, w in wanted.items()}
    ever_owed = False
    with expect_all() as expect:
        for step in range(sc.steps):
            side = sc.side(step, rank)
            frozen = step in sc.frozen
            skipped = sc.overflow is not None and step == sc.overflow[0]
            factor = float("inf") if sc.overflow == (step, rank) else 1.0
            x, y = batch(step, front.dtype)
            # the reference: the twin at the front's current parameters, a plain all-reduce
            params = front.params()
            with torch.no_grad():
                for n, p in twin.named_parameters():
                    p.copy_(params[n].view_as(p))
            for n, p in twin.named_parameters():
                p.requires_grad_(not (frozen and n == FROZEN))
            twin.zero_grad(set_to_none=True)
            nn.functional.mse_loss(twin(x, side), y).backward()
            for n, p in twin.named_parameters():
                g = p.grad.double().reshape(-1) if p.grad is not None else torch.zeros_like(wanted[n])
                g = summed(g)
                if not skipped:  # a skipped step was never computed, as far as training goes
                    wanted[n] += g / world
            # the front
            dict(front.module.named_parameters())[FROZEN].requires_grad_(not frozen)
            before = {n: t.clone() for n, t in front.owed().items()} if skipped else {}
            scale = front.scale()
            front.backward(x, y, side, factor)
            grads = front.grads()
            if skipped:
                with expect(f"{label}, step {step}: every gradient is non-finite on rank {rank}"):
                    finite = [n for n, g in grads.items() if bool(torch.isfinite(g).any())]
                    assert grads and not finite, f"finite elements in {finite} (grads of {sorted(grads)})"
            else:
                for n, g in grads.items():
                    applied[n] += g / scale
            front.step()
            if skipped:
                after = front.params()
                with expect(f"{label}, step {step}: rank {rank}'s GradScaler skipped the step"):
                    assert front.scale() < scale, f"scale {scale} -> {front.scale()}"
                    moved = [n for n in names if not torch.equal(after[n], params[n])]
                    assert not moved, f"parameters moved: {moved}"
            if sc.resume_after == step:
                front.resume()
            owed = front.owed()
            if skipped:
                with expect(f"{label}, step {step}: rank {rank}'s owed gradients are those before the skip"):
                    assert owed.keys() == before.keys(), f"{sorted(before)} -> {sorted(owed)}"
                    changed = [n for n in owed if not torch.equal(owed[n], before[n])]
                    assert not changed, f"changed: {changed}"
            with expect(f"{label}: owed_gradients is per parameter name, flat"):
                assert set(owed) <= set(names), sorted(set(owed) - set(names))
                assert all(t.dim() == 1 and t.is_floating_point() for t in owed.values())
            nothing_owed = (
                (sc.dense_from is not None and step >= sc.dense_from)
                or (cls.dense_after_load and sc.resume_after is not None and step == sc.resume_after + 1)
            )  # fmt: skip
            for n in names:
                total = summed(owed[n].double() if n in owed else torch.zeros_like(wanted[n]))
                ever_owed |= bool(total.abs().max() > 0)
                ok, how = off_by(front, applied[n] + total, wanted[n])
                with expect(
                    f"{label}, after step {step}, {n}: applied + owed != the mean of the raw gradients"
                ):
                    assert ok, how
                if nothing_owed:
                    with expect(f"{label}, after step {step} (dense), {n}: still owed"):
                        assert float(total.abs().max()) == 0.0, f"max |owed| {float(total.abs().max()):.3e}"
        with expect(f"{label}: something was owed at some step (the check has teeth)"):
            assert ever_owed


CASES = [(f, s) for f, cls in FRONTS.items() for s, sc in SCENARIOS.items() if applies(cls, sc)]

# (front, scenario) -> the defect that makes it fail on the current code (xfail, strict)
KNOWN: dict[tuple[str, str], str] = {}


def conservation_world(folder: str) -> None:
    torch.set_num_threads(1)
    shared = Shared(folder)
    run_checks(*(named_check(conserve, shared, f, s, label=f"{f}/{s}") for f, s in CASES))


# --------------------------------------------------------------------------------------- the tests
@pytest.fixture(scope="module")
def world_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str | None]:
    """Run every check in one world; the folder of its pass records and its failure report."""
    folder = str(tmp_path_factory.mktemp("conservation"))
    try:
        run_world(WORLD, conservation_world, folder)
    except WorldFailed as e:
        return folder, str(e)
    return folder, None


def _passed(folder: str, label: str) -> bool:
    for r in range(WORLD):
        try:
            with open(os.path.join(folder, f"passed-rank{r}.txt")) as fh:
                if label not in fh.read().split("\n"):
                    return False
        except OSError:
            return False
    return True


def _excerpt(report: str | None, label: str) -> str:
    """The parts of the world's report about check ``label`` (all of it when none is)."""
    if report is None:
        return f"{label}: not recorded as passed on every rank, and the world reported nothing"
    head = f": conserve[{label}] ====="
    parts = report.split("\n===== rank ")
    mine = [p for p in parts[1:] if p.split("\n", 1)[0].endswith(head)]
    if not mine:
        return report
    return parts[0] + "\n" + "\n".join("===== rank " + p for p in mine)


def _case(front: str, scenario: str) -> Any:
    why = KNOWN.get((front, scenario))
    marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
    return pytest.param(front, scenario, marks=marks, id=f"{front}-{scenario}")


@pytest.mark.parametrize(("front", "scenario"), [_case(f, s) for f, s in CASES])
def test_nothing_owed_is_lost(world_report: tuple[str, str | None], front: str, scenario: str) -> None:
    folder, report = world_report
    label = f"{front}/{scenario}"
    if not _passed(folder, label):
        pytest.fail(_excerpt(report, label), pytrace=False)


def test_every_scenario_runs_through_every_front() -> None:
    """No scenario silently leaves a front out (the layout scenario runs each front's own layout
    change), and every front has the events of scenarios 1-3."""
    assert len(CASES) == len(FRONTS) * len(SCENARIOS), CASES
    assert all({"unused", "overflow", "resume"} <= cls.events for cls in FRONTS.values())
