"""Aligning the ranks' clocks for a trace: each rank's offset to rank 0's clock.

Collective over the topology's control group: every rank leaves a barrier and reads its clock,
a few rounds, and the median difference to rank 0 is its offset.
"""

from __future__ import annotations

import statistics
import time
import uuid

import torch

from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology


def align_clocks(topo: Topology, started_at: float, rounds: int = 9) -> tuple[float, float, float, str]:
    """This rank's clock minus rank 0's (seconds), the spread of the rounds, rank 0's start time
    on rank 0's clock, and a run id shared by every rank. Collective over the control group."""
    if topo.world == 1 or not topo.is_bound:
        return 0.0, 0.0, started_at, uuid.uuid4().hex[:12]
    dev, group = topo.comm_device, topo.control_group
    diffs: list[list[float]] = []
    for _ in range(rounds):
        P.all_reduce(torch.zeros(1, device=dev), group, "world")  # leave together
        now = time.perf_counter()
        table = torch.empty(topo.world, dtype=torch.float64, device=dev)
        P.all_gather(table, torch.tensor([now], dtype=torch.float64, device=dev), group, "world")
        times = table.tolist()
        diffs.append([t - times[0] for t in times])
    mine = [d[topo.rank] for d in diffs]
    offset = statistics.median(mine)
    spread = max(
        max(abs(d[r] - statistics.median(x[r] for x in diffs)) for d in diffs) for r in range(topo.world)
    )
    # rank 0's start and a run id: 64-bit words from rank 0
    run = int(uuid.uuid4().int & ((1 << 62) - 1))
    word = torch.tensor([started_at, float(run)], dtype=torch.float64, device=dev)
    P.broadcast(word, topo.global_rank(0), group, "world")
    origin0, run_f = word.tolist()
    return offset, spread, origin0, f"{int(run_f):x}"[:12]
