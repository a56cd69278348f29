"""Where the unstreamed outer loop's exchange step spends its time on an emulated N x 1 cluster
(run_outer.sh starts it on every node). Every step as ``bench`` runs it (barrier, forward,
backward, SGD step, ``outer.step()``), in rounds of 30 steps without the loop (``local``) then 30
with it (every 10, CODEC). Rank 0 prints, per round, the mean step of both (the slowest rank's
per step) and the period's extra (outer minus local, times 10, in ms); the forward and backward
by position in the period (the exchange lands after position 4); the same all-gather as the
exchange's with the ranks idle (seconds); and per exchange and rank: forward+backward, the SGD
step, the whole ``outer.step()`` and its pieces (the pseudo-gradient, the program's work between
its collectives = the encode, the collective calls, the finisher = the decode, the outer step
with the buffers' all-reduce). Exchange 0 is the loop's first meeting (its buffers made)."""

import datetime
import statistics
import sys
import time
from collections.abc import Generator
from typing import Any

import torch
import torch.distributed as dist

import gradsync
import gradsync.outer.loop as L
from gradsync.apps.models import build_model_for
from gradsync.observe.profiler import default_loss

torch.set_num_threads(1)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
rank, world = dist.get_rank(), dist.get_world_size()
CODEC = sys.argv[1] if len(sys.argv) > 1 else "terngrad:bits=4"
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
torch.manual_seed(0)
model = build_model_for("vgg", "classify", (3, 32, 32), 10)
g = torch.Generator().manual_seed(rank)
x, y = torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g)

rec: dict[str, float] = {}


def timed_run(program: Generator[Any, Any, Any]) -> None:
    t = time.perf_counter()
    try:
        step = next(program)
        rec["gen"] = rec.get("gen", 0.0) + time.perf_counter() - t
        while True:
            t = time.perf_counter()
            result = step()
            c = time.perf_counter()
            rec["calls"] = rec.get("calls", 0.0) + c - t
            rec.setdefault("each", []).append(c - t)
            step = program.send(result)
            rec["gen"] = rec.get("gen", 0.0) + time.perf_counter() - c
    except StopIteration as stop:
        rec["gen"] = rec.get("gen", 0.0) + time.perf_counter() - c
        finisher = stop.value
    t = time.perf_counter()
    if finisher is not None:
        finisher()
    rec["finish"] = time.perf_counter() - t


L.run = timed_run
orig_apply = L.OuterLoop._apply


def timed_apply(self: L.OuterLoop, ex: Any) -> None:
    t = time.perf_counter()
    orig_apply(self, ex)
    rec["apply"] = time.perf_counter() - t


L.OuterLoop._apply = timed_apply
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
outer = gradsync.OuterLoop(model, every=10, codec=CODEC)
rows = []
summary = []
pos = []


def slowest(v: float) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def steps(n: int, with_outer: bool) -> list[tuple[float, float]]:
    out = []
    for _ in range(n):
        dist.barrier()
        t0 = time.perf_counter()
        default_loss(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec.clear()
        t2 = time.perf_counter()
        if with_outer:
            outer.step()
        t3 = time.perf_counter()
        if "apply" in rec:
            each = rec.pop("each")
            r = {"fb": t1 - t0, "opt": t2 - t1, "outer": t3 - t2, **rec, "ncalls": len(each)}
            r["pseudo"] = r["outer"] - r.get("gen", 0) - r.get("calls", 0) - r.get("finish", 0) - r["apply"]
            rows.append(r)
        out.append((slowest(t3 - t0), slowest(t1 - t0)))
    return out


for _ in range(5):
    steps(1, True)
for _ in range(ROUNDS):
    loc = steps(30, False)
    out = steps(30, True)
    summary.append((statistics.fmean(a for a, _ in loc), statistics.fmean(a for a, _ in out)))
    pos.append(
        (
            [round(1e3 * statistics.fmean(loc[i + 10 * k][1] for k in range(3))) for i in range(10)],
            [round(1e3 * statistics.fmean(out[i + 10 * k][1] for k in range(3))) for i in range(10)],
        )
    )
# the same all-gather, the ranks idle
payload = torch.zeros(int(sum(p.numel() for p in model.parameters()) * 4 * 0.125), dtype=torch.uint8)
outs = torch.empty(world * payload.numel(), dtype=torch.uint8)
idle = []
for _ in range(3):
    dist.barrier()
    t = time.perf_counter()
    dist.all_gather_into_tensor(outs, payload)
    idle.append(time.perf_counter() - t)
every = [None] * world
dist.all_gather_object(every, rows)
if rank == 0:
    keys = ["fb", "opt", "outer", "pseudo", "gen", "calls", "finish", "apply"]
    means = [(round(a * 1e3), round(b * 1e3), round((b - a) * 1e4)) for a, b in summary]
    print("rounds local/outer mean step", means)
    for a, b in pos:
        ma, mb = round(statistics.fmean(a)), round(statistics.fmean(b))
        print("fwd+bwd by position, local", a, "outer", b, "means", ma, mb)
    print("payload MB", payload.numel() / 1e6, "idle all_gather s", [round(v, 3) for v in idle])
    for i in range(len(rows)):
        cells = ("/".join(f"{every[r][i].get(k, 0):.3f}" for r in range(world)) for k in keys)
        print("exchange", i, "  ".join(f"{k} {c}" for k, c in zip(keys, cells, strict=True)))
