"""Effective cores per kind of work: each kernel run by 1, 2 and 4 processes at once for a fixed
time; the processes' summed throughput over one process's alone is the number of cores that kind
of work gets from this host (issue 44's question: does the engine's codec work share the cores
the way the training step does?).

    python kinds.py                       # every kind below at 64 MiB
    KINDS_BYTES=16777216 python kinds.py mstopk:density=0.01+ef powersgd+ef

Kinds: ``stream`` (an in-place add over two buffers: memory-bound), ``matmul`` (512 x 512
products: core-bound), ``conv`` (a 3 x 3 convolution over a 16 x 64 x 56 x 56 batch) and any
codec spec (its encode and decode of one tensor of ``KINDS_BYTES`` bytes, error feedback as
the spec says)."""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

KINDS = ("stream", "matmul", "conv", "mstopk:density=0.01+ef", "onebit+ef", "powersgd+ef",
         "topk:density=0.01+ef", "terngrad:bits=4")  # fmt: skip


def kernel(kind: str, nbytes: int) -> Callable[[], Any]:
    torch.set_num_threads(1)
    if kind == "matmul":
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        return lambda: torch.mm(a, b)
    if kind == "conv":
        x, conv = torch.randn(16, 64, 56, 56), torch.nn.Conv2d(64, 64, 3, padding=1)
        return lambda: conv(x)
    n = nbytes // 4
    side = 2 ** (int(math.log2(n)) // 2)
    x = torch.randn(n).view(side, n // side)
    if kind == "stream":
        y = torch.randn_like(x)
        return lambda: x.add_(y, alpha=0.5)
    from gradsync.codecs import build_codec

    codec, out = build_codec(kind).fresh(), torch.empty_like(x)

    def encode_decode() -> None:
        codec.decode(codec.encode(x), out=out)

    return encode_decode


def worker(kind: str, nbytes: int, start: float, seconds: float, results: Any) -> None:
    run = kernel(kind, nbytes)
    run()
    run()
    while time.time() < start:
        time.sleep(0.001)
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        run()
        count += 1
    results.put(count / (time.perf_counter() - t0))


def main() -> None:
    nbytes = int(os.environ.get("KINDS_BYTES", 64 << 20))
    ctx = mp.get_context("spawn")
    print(time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), f"{nbytes} bytes", flush=True)
    for kind in sys.argv[1:] or KINDS:
        line, alone = [], 0.0
        for k in (1, 2, 4):
            results = ctx.Queue()
            start = time.time() + 2.5  # every process built and warm before the clock starts
            procs = [ctx.Process(target=worker, args=(kind, nbytes, start, 3.0, results)) for _ in range(k)]
            for p in procs:
                p.start()
            total = sum(results.get() for _ in procs)
            for p in procs:
                p.join()
            alone = alone or total
            line.append(f"{k} at once: {total / alone:.2f}")
        print(f"{kind:26s} alone {1e3 / alone:7.2f} ms/call; effective cores:", ", ".join(line), flush=True)


if __name__ == "__main__":
    main()
