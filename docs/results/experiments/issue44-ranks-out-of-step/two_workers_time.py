"""Time one simulated step of hierarchical PowerSGD, 16 ranks per host on 4 cores, 200 buckets.

    PYTHONPATH=CHECKOUT/src python two_workers_time.py

The synthetic workload and codec table are the unit tests' (tests/test_whatif.py of this
checkout); run it once with each version of the code to compare, in turn.
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))

from gradsync.whatif.predict import Point, predict_point
from gradsync.whatif.simulate import Cpu
from test_whatif import network, table, workload

w = workload([(0.5, 0.0001 * i) for i in range(400)], backward=0.05)
opts = {"plan": "compress", "bucket_bytes": "1000000"}
t = time.perf_counter()
r = predict_point(w, Point(2, 8, network(1e-9)), ["powersgd:rank=4"], table(), Cpu(16, 4.0), opts)[0]
print(f"{r['step_ms']:.1f} ms predicted, {r['notes']}, {time.perf_counter() - t:.2f} s")
