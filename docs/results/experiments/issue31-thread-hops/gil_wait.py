"""The same hand-off as wake_latency.py, but the busy work runs on threads of the same process:
either Python bytecode (holds the GIL, released only at the interpreter's switch interval) or a
torch kernel (releases the GIL while it computes), at two switch intervals.

Run: python docs/results/experiments/issue31-thread-hops/gil_wait.py
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

import torch
from wake_latency import passes  # type: ignore[import-not-found]


def python_busy(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(1000):
            x += i * i


def torch_busy(stop: threading.Event) -> None:
    a = torch.randn(256, 256)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def main() -> None:
    torch.set_num_threads(1)
    out = []
    for interval in (0.005, 0.0005):
        sys.setswitchinterval(interval)
        for kind, fn in (("python", python_busy), ("torch", torch_busy)):
            for busy in (0, 1, 2):
                stop = threading.Event()
                ths = [threading.Thread(target=fn, args=(stop,)) for _ in range(busy)]
                for t in ths:
                    t.start()
                time.sleep(0.5)
                t_ = passes(150)
                stop.set()
                for t in ths:
                    t.join()
                t_.sort()
                row = {"switch_interval_ms": interval * 1e3, "busy": kind, "threads": busy,
                       "median_ms": statistics.median(t_) * 1e3, "p90_ms": t_[int(0.9 * len(t_))] * 1e3,
                       "mean_ms": statistics.fmean(t_) * 1e3}  # fmt: skip
                out.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
