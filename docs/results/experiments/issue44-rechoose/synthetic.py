"""`auto` against every fixed scheme of its codecs, in the simulator, on synthetic models: the
planner's choice of each bucket's candidate, by its own total (before) or by the step it makes in
the engine's order of work (after, planner/recut.py rechoose_candidates). Run it at each commit:

    python docs/results/experiments/issue44-rechoose/synthetic.py

Nothing is timed: the codec table is written out (encode 1 ms + 1 ns/B, decode 0.1 ms; top-k
sends 2 % of the bytes, PowerSGD 1 %: the table of tests/test_whatif.py, repeated here so that
the script runs at any commit without the tests), the compute is 20 ms forward, 40 ms backward (or 310 ms
for the model of 300 tensors) and 5 ms for the optimizer, on free node-internal links.
"""

from __future__ import annotations

import time

from gradsync.collectives.cost import CodecCost, CostParams, Linear, Link
from gradsync.whatif.codec_costs import CodecTable
from gradsync.whatif.network import Network
from gradsync.whatif.predict import Point, predict_point
from gradsync.whatif.simulate import Cpu
from gradsync.whatif.workload import Tensor, Workload

MB = 1 << 20
FIXED = [
    *(f"{s}{loc}/mstopk:density=0.01" for s in ("allgather", "ring", "ps") for loc in ("", "+local")),
    "allgather/powersgd:rank=4",
    "allgather+local/powersgd:rank=4",
]


def workload(tensors: list[tuple[float, float]], backward: float) -> Workload:
    ts = tuple(Tensor(f"t{i}", int(mb * MB) // 4, 4, True, ready) for i, (mb, ready) in enumerate(tensors))
    return Workload("synthetic", 8, ts, 0.0, 0.020, backward, 0.005, "synthetic")


def table() -> CodecTable:
    line = CodecCost(Linear(1e-3, 1e-9), Linear(1e-4, 0.0), Linear(16.0, 0.02))
    low = CodecCost(Linear(1e-3, 1e-9), Linear(1e-4, 0.0), Linear(16.0, 0.01), lowrank=True)
    return CodecTable(
        entries={"mstopk:density=0.01+ef": line, "topk:density=0.01+ef": line, "powersgd+ef": low,
                 "powersgd:rank=4": low}
    )  # fmt: skip


def point(nodes: int, per_node: int, bits_per_s: float, alpha: float) -> Point:
    links = CostParams(Link(0.0, 0.0), Link(alpha, 8 / bits_per_s), 0.0)
    return Point(nodes, per_node, Network(links, "synthetic"))


def main() -> None:
    four = workload([(8, 0.010), (8, 0.020), (8, 0.030), (8, 0.040)], 0.040)
    many = workload([(0.5, 0.001 * i) for i in range(1, 301)], 0.31)
    cases = [
        ("4 tensors of 8 MiB", four, point(8, 1, 100e6, 1e-5), {"plan": "compress"}),
        ("4 tensors of 8 MiB", four, point(2, 2, 100e6, 1e-4), {"plan": "compress"}),
        ("4 tensors of 8 MiB", four, point(4, 2, 1e9, 1e-5), {"plan": "compress"}),
        ("300 tensors, 1 MiB buckets", many, point(4, 2, 1e9, 1e-4), {"bucket_bytes": str(1 << 20)}),
        ("300 tensors, 1 MiB buckets", many, point(2, 2, 100e6, 1e-4), {"bucket_bytes": str(1 << 20)}),
    ]
    for label, w, pt, options in cases:
        rows = {r["contender"]: r["step_ms"] for r in predict_point(w, pt, FIXED, table(), Cpu(), options)}
        best = min(rows, key=rows.__getitem__)
        t0 = time.perf_counter()
        auto = predict_point(w, pt, ["auto"], table(), Cpu(), options)[0]["step_ms"]
        seconds = time.perf_counter() - t0
        print(
            f"{label}, {pt.nodes} x {pt.per_node}: auto {auto:.1f} ms, best fixed {rows[best]:.1f} ({best}), "
            f"auto / best {auto / rows[best]:.3f}; simulated in {seconds:.2f} s"
        )


if __name__ == "__main__":
    main()
