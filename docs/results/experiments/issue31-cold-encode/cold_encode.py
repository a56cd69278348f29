"""Does error feedback + MSTopK encode cost more on a gradient that is not in the cache?

The engine encodes a bucket right after the backward pass wrote it, with the residual last
touched a whole step ago; ``time_codec`` (the planner's and the simulator's codec cost) encodes
the same tensor again and again. Timed alternately, one thread, for a 4M-element part (the
engine's part of VGG's 64 MiB layer) and a 16M-element tensor:

- warm: the same gradient encoded back to back, as ``time_codec`` does;
- cold: before each encode, 256 MiB of other memory is written (the gradient is rewritten too,
  as the backward pass does), so neither gradient nor residual is in any cache.

Run: python docs/results/experiments/issue31-cold-encode/cold_encode.py
"""

from __future__ import annotations

import json
import statistics
import time

import torch

import gradsync
from gradsync.codecs import EncodeContext


def main() -> None:
    torch.set_num_threads(1)
    out = []
    flush = torch.empty(64 * 2**20)  # 256 MiB
    for n in (4 * 2**20, 16 * 2**20):
        src = torch.randn(n)
        g = torch.empty(n)
        warm_ef = gradsync.build_codec("mstopk:density=0.01+ef")
        cold_ef = gradsync.build_codec("mstopk:density=0.01+ef")
        warm, cold = [], []
        g.copy_(src)
        for _ in range(3):
            warm_ef.encode(g, EncodeContext(key="w"))
            cold_ef.encode(g, EncodeContext(key="c"))
        for _ in range(15):
            g.copy_(src)
            t0 = time.perf_counter()
            warm_ef.encode(g, EncodeContext(key="w"))
            warm.append(time.perf_counter() - t0)
            flush.fill_(1.0)  # evicts the caches
            g.copy_(src)  # the backward pass writes the gradient
            flush[: 32 * 2**20].fill_(2.0)  # ... and goes on writing other memory
            t0 = time.perf_counter()
            cold_ef.encode(g, EncodeContext(key="c"))
            cold.append(time.perf_counter() - t0)
        row = {
            "numel": n,
            "warm_ms": statistics.median(warm) * 1e3,
            "cold_ms": statistics.median(cold) * 1e3,
        }
        row["cold_over_warm"] = row["cold_ms"] / row["warm_ms"]
        out.append(row)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
