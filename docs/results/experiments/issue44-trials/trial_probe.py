"""How well a few measured steps tell two plans apart on an emulated N x 1 cluster (../on_cluster.sh
starts it on every node). Every step as ``bench`` runs it (barrier, forward, backward, SGD step),
VGG batch 16, in ROUNDS interleaved rounds; each round wraps a fresh model for each contender and
runs it until its closed loop settles, then STEPS more steps. Contenders: hitopk, powersgd:rank=4,
``auto`` without trials (its first plan and re-plans), ``auto`` with them (the default). Rank 0
prints per contender and round: the median step (slowest rank) and the median span (from the
first ready gradient to the end of the synchronization, the closed loop's measure, slowest rank)
over the steps after the closed loop settled; for ``auto`` the closed loop's rounds (measured
span, trial, kept) and the plan it settled on (codec per compressed bucket)."""

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
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 3
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 35
KNOWN = {
    "hitopk": dict(scheme="hitopk:density=0.01"),
    "powersgd": dict(scheme="powersgd:rank=4"),
    "auto-notrials": dict(scheme="auto", replan_trials=0),
    "auto": dict(scheme="auto"),
    # auto's cuts and strategies with top-k alone: what its top-k trial runs
    "auto-topk": dict(scheme="auto:candidates=hitopk:density=0.01"),
    "auto-topk-firstcut": dict(scheme="auto:candidates=hitopk:density=0.01", replan_recut=False),
    # and with PowerSGD alone: what a PowerSGD trial runs
    "auto-powersgd": dict(scheme="auto:candidates=powersgd:rank=4"),
}
NAMES = sys.argv[3].split(",") if len(sys.argv) > 3 else ["hitopk", "powersgd", "auto-notrials", "auto"]
CONTENDERS = {name: KNOWN[name] for name in NAMES}

for r in range(ROUNDS):
    for name, options in CONTENDERS.items():
        model = copy.deepcopy(base)
        synced = gradsync.wrap(model, log_plan=False, **options)
        opt = torch.optim.SGD(synced.parameters(), lr=0.01, momentum=0.9)
        steps, spans, settled_at = [], [], None
        i = 0
        while len(steps) < STEPS:  # until the closed loop settles, then STEPS more
            dist.barrier()
            t0 = time.perf_counter()
            loss = default_loss(synced(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            st = synced.last_stats
            step, span = slowest(time.perf_counter() - t0, st.backward_s + st.exposed_s)
            if settled_at is None and synced.engine.plan is not None and not synced.engine.loop.active:
                settled_at = i
            elif settled_at is not None:
                steps.append(step)
                spans.append(span)
            i += 1
        if rank == 0:
            hist = [
                (round(h["measured_ms"]), h.get("trial", "r" if h.get("reverted") else ""), h.get("kept", ""))
                for h in synced.engine.loop.history
            ]
            step_ms, span_ms = 1e3 * statistics.median(steps), 1e3 * statistics.median(spans)
            print(
                f"round {r + 1} {name:14s} settled after step {settled_at}: step {step_ms:.0f} ms, span "
                f"{span_ms:.0f} ms over {len(steps)} steps (spans {min(spans) * 1e3:.0f}-"
                f"{max(spans) * 1e3:.0f}); plan {plan_codecs(synced)}; loop {hist}",
                flush=True,
            )
        synced.close()
dist.destroy_process_group()
