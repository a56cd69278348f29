"""How long the planner takes with the re-cut on plans of many latency-bound buckets: N top-k
buckets of 256 kB ready 1 ms apart, a small dense bucket after each, 5 ms start-up on 4 x 1
ranks at 100 Mbit/s.

    python docs/results/experiments/issue31-recut/recut_time.py
"""

from __future__ import annotations

import time

from gradsync.collectives.cost import CodecCost, CostModel, CostParams, Linear, Link
from gradsync.planner.decide import make_plan
from gradsync.sync import Scheme


def main() -> None:
    scheme = Scheme.parse("allgather/topk")
    codec = CodecCost(Linear(1e-4, 1e-9), Linear(1e-4, 1e-9), Linear(64, 0.02))
    model = CostModel(CostParams(Link(1e-4, 1e-10), Link(5e-3, 8 / 100e6), 0.0), 4, 1)
    for n in (50, 200, 400):
        groups, nbytes, ready = [], [], []
        for i in range(n):
            groups += [([2 * i], 0), ([2 * i + 1], -1)]
            nbytes += [256 << 10, 1024]
            ready += [i * 1e-3, i * 1e-3 + 1e-4]
        t0 = time.perf_counter()
        plan = make_plan(groups, nbytes, scheme, model, {0: codec}, "auto", "auto", 0, fuse_bytes=64 << 20,
                         ready=ready)  # fmt: skip
        seconds = time.perf_counter() - t0
        compressed = sum(b.compress for b in plan.buckets)
        print(f"{n} compressed buckets -> {compressed} in {seconds:.2f} s")


if __name__ == "__main__":
    main()
