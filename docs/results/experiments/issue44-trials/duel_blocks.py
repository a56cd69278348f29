"""``auto``'s closed loop block by block on an emulated N x 1 cluster (../on_cluster.sh starts it
on every node): every step as ``bench`` runs it (barrier, forward, backward, SGD step), VGG batch
16, ``scheme="auto"`` with its defaults, until the loop settles (and at least 170 steps), ROUNDS
times with a fresh model. Rank 0 prints one line per stretch of steps that ran one plan in one
role (before the trials, side ``a`` or ``b`` of a duel, settled): the plan's codecs and the
medians over its steps, the slowest rank's, of the step, the span the loop measures (backward
from the first ready gradient, plus the exposed synchronization), and the engine threads' busy
times summed over the buckets (compute, decode, inside collectives)."""

import copy
import statistics
import sys
import time

import torch
import torch.distributed as dist
from probe_world import join, plan_codecs, slowest

import gradsync
from gradsync.observe.profiler import default_loss

rank, base, x, y = join()
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
FIELDS = ("step", "span", "bwd", "exp", "compute", "decode", "comm")


def role(synced: gradsync.GradSync) -> str:
    loop = synced.engine.loop
    return loop.duel.side if loop.duel is not None else "settled" if loop.settled else "-"


def report(r: int, stretch: list[tuple[int, str, str, list[float]]]) -> None:
    med = [1e3 * statistics.median(row[3][k] for row in stretch) for k in range(len(FIELDS))]
    first, last = stretch[0], stretch[-1]
    times = " ".join(f"{name} {v:5.0f}" for name, v in zip(FIELDS, med, strict=True))
    print(f"r{r} steps {first[0]:3d}-{last[0]:3d} {first[2]:7s} {first[1][:40]:40s} {times}", flush=True)


for r in range(ROUNDS):
    synced = gradsync.wrap(copy.deepcopy(base), log_plan=False, scheme="auto")
    opt = torch.optim.SGD(synced.parameters(), lr=0.01, momentum=0.9)
    rows = []
    for i in range(200):
        plan, part = plan_codecs(synced), role(synced)  # what this step runs (a round ends after a step)
        dist.barrier()
        t0 = time.perf_counter()
        default_loss(synced(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        st = synced.last_stats
        busy = [sum(getattr(b, k) for b in st.bucket_stats) for k in ("compute_s", "decode_s", "comm_s")]
        step_s = time.perf_counter() - t0
        measured = slowest(step_s, st.backward_s + st.exposed_s, st.backward_s, st.exposed_s, *busy)
        rows.append((i, plan, part, measured))
        if synced.engine.loop.settled and i > 170:
            break
    if rank == 0:
        stretch: list[tuple[int, str, str, list[float]]] = []
        for row in rows:
            if stretch and (row[1], row[2]) != (stretch[-1][1], stretch[-1][2]):
                report(r, stretch)
                stretch = []
            stretch.append(row)
        report(r, stretch)
    synced.close()
dist.destroy_process_group()
