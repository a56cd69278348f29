"""How long one thread hand-off takes on this machine while other threads keep the cores busy.

A hand-off is what the sync engine does between its threads for every bucket part: the compute
thread finishes an encode and wakes the communication thread; the communication thread's
collective completes and wakes the compute thread to decode. Here two Python threads pass a
token back and forth through a queue (each pass: put, the sleeping peer wakes and takes it),
while ``busy`` worker processes run single-threaded matrix products (no GIL shared with the
hand-off). Reported per load: the median and 90th percentile of one pass, in milliseconds.

Run: python docs/results/experiments/issue31-thread-hops/wake_latency.py
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time


def burn(stop: mp.Event) -> None:  # type: ignore[valid-type]
    import torch

    torch.set_num_threads(1)
    a = torch.randn(256, 256)
    while not stop.is_set():
        for _ in range(50):
            a = torch.tanh(a @ a)


def passes(n: int) -> list[float]:
    to_b: queue.Queue[float] = queue.Queue()
    to_a: queue.Queue[float] = queue.Queue()
    times: list[float] = []

    def b() -> None:
        for _ in range(n):
            t = to_b.get()
            times.append(time.perf_counter() - t)
            time.sleep(0.002)  # the peer sleeps between hand-offs, as the engine's threads do
            to_a.put(time.perf_counter())

    th = threading.Thread(target=b)
    th.start()
    for _ in range(n):
        time.sleep(0.002)
        to_b.put(time.perf_counter())
        t = to_a.get()
        times.append(time.perf_counter() - t)
    th.join()
    return times


def main() -> None:
    cores = os.cpu_count() or 1
    out = {"cores": cores, "kernel": os.uname().release, "loads": []}
    for busy in (0, 1, 2, 3, 4, 6):
        stop = mp.Event()
        procs = [mp.Process(target=burn, args=(stop,)) for _ in range(busy)]
        for p in procs:
            p.start()
        time.sleep(1.0)
        t = passes(300)
        stop.set()
        for p in procs:
            p.join()
        t.sort()
        row = {
            "busy_processes": busy,
            "busy_per_core": busy / cores,
            "median_ms": statistics.median(t) * 1e3,
            "p90_ms": t[int(0.9 * len(t))] * 1e3,
            "mean_ms": statistics.fmean(t) * 1e3,
        }
        out["loads"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
