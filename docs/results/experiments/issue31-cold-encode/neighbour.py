"""Error feedback + MSTopK encode (4M elements, one thread) while one other process runs on the
other core: nothing, matrix products (compute-bound, like convolutions' backward pass), or
large copies (memory-bound, like another rank's encode). Same for the training step's own kind
of work (a 256 x 256 matrix product loop) as the reference: how much each neighbour slows it.

Run: python docs/results/experiments/issue31-cold-encode/neighbour.py
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time

import torch

import gradsync
from gradsync.codecs import EncodeContext


def neighbour(kind: str, stop: mp.Event) -> None:  # type: ignore[valid-type]
    torch.set_num_threads(1)
    if kind == "matmul":
        a = torch.randn(256, 256)
        while not stop.is_set():
            a = torch.tanh(a @ a)
    elif kind == "copy":
        x, y = torch.randn(16 * 2**20), torch.empty(16 * 2**20)
        while not stop.is_set():
            y.copy_(x)
            x.copy_(y)


def timed(fn: object, reps: int = 30) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    torch.set_num_threads(1)
    g = torch.randn(4 * 2**20)
    ef = gradsync.build_codec("mstopk:density=0.01+ef")
    a = torch.randn(256, 256)

    def encode() -> None:
        ef.encode(g, EncodeContext(key="x"))

    def compute() -> None:
        b = a
        for _ in range(40):
            b = torch.tanh(b @ a)

    for _ in range(3):
        encode()
    rows = []
    for kind in ("none", "matmul", "copy"):
        stop = mp.Event()
        proc = mp.Process(target=neighbour, args=(kind, stop)) if kind != "none" else None
        if proc:
            proc.start()
            time.sleep(1.0)
        rows.append({"neighbour": kind, "encode_ms": timed(encode), "matmul_loop_ms": timed(compute)})
        stop.set()
        if proc:
            proc.join()
    base = rows[0]
    for r in rows:
        r["encode_slowdown"] = r["encode_ms"] / base["encode_ms"]
        r["matmul_slowdown"] = r["matmul_loop_ms"] / base["matmul_loop_ms"]
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
