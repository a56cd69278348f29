"""The codec table on a GPU: encode and decode time of every selection and quantization codec, with
and without error feedback, against ``torch.topk`` on ``|x|`` and the copy floor (one clone of the
tensor), timed with CUDA events at 2^20 .. 2^26 float32 elements and k = 1 %.

    PYTHONPATH=src python scripts/gpu_codec_table.py OUT.json [--sizes 20,22,24,26] [--reps 20]
        [--modes resident,host]

Each codec runs in resident mode (``Compressor.set_resident``: the host-free versions, what
gradsync uses on a GPU), replayed as CUDA graphs as gradsync runs it (``resident``); the same
without the graphs (``eager``: ``GRADSYNC_CUDA_GRAPHS=0``, every kernel launched from Python, what
the fixed cost per call was before them); and, for comparison, on its host path (``host``:
counts and thresholds read back by the host). ``compile=true`` rows run the quantizers' fused
passes through torch.compile.

Prints one table and writes the rows as JSON with the device, torch and CUDA versions. Each
contender is timed right after its own copy-floor and torch.topk runs, so every ratio comes from
the same moments of the run. A codec that fails is reported in its row; the table goes on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch

from gradsync.codecs import EncodeContext, build_codec

SPECS = [
    "topk:density=0.01",
    "chunktopk:density=0.01",
    "mstopk:density=0.01",
    "dgc:density=0.01",
    "trimmed_topk:density=0.01",
    "bsearch:density=0.01",
    "graddrop:density=0.01",
    "randomk:density=0.01",
    "qrgc:density=0.01",
    "onebit",
    "tbq:threshold=1.5",
    "terngrad",
    "fp16",
    "bf16",
    "topk:density=0.01+ef",
    "chunktopk:density=0.01+ef",
    "mstopk:density=0.01+ef",
    "dgc:density=0.01+ef",
    "onebit+ef",
    "onebit:compile=true+ef",
    "terngrad:compile=true",
]


def median_ms(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median of ``reps`` single calls after 3 warm-up calls: between two CUDA events on a GPU,
    by the wall clock elsewhere (a smoke run of this script on a CPU)."""
    for _ in range(3):
        fn()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    times = []
    for _ in range(reps):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_codec(spec: str, g: torch.Tensor, reps: int, mode: str = "resident") -> dict[str, object]:
    """One row: the copy floor, torch.topk at k = 1 % and the codec's encode and decode."""
    k = max(1, g.numel() // 100)
    floor = median_ms(lambda: g.clone(), reps, g.device)
    ref = median_ms(lambda: torch.topk(g.abs(), k, sorted=False), reps, g.device)
    row: dict[str, object] = {"log2": g.numel().bit_length() - 1, "codec": spec, "mode": mode,
                              "copy_ms": floor, "torch_topk_ms": ref}  # fmt: skip
    graphs = os.environ.get("GRADSYNC_CUDA_GRAPHS")
    if mode == "eager":
        os.environ["GRADSYNC_CUDA_GRAPHS"] = "0"
    try:
        codec = build_codec(spec)
        codec.set_resident(mode in ("resident", "eager"))
        row["host_free"] = codec.host_free
        ctx = EncodeContext(key="w")
        payload = codec.encode(g, ctx)
        buf = torch.empty(codec.max_nbytes(g.numel()), dtype=torch.uint8, device=g.device)
        out = torch.empty_like(g)
        enc = median_ms(lambda: codec.encode(g, ctx, out=buf), reps, g.device)
        dec = median_ms(lambda: codec.decode(payload, out=out), reps, g.device)
        row.update(encode_ms=enc, decode_ms=dec, payload_bytes=int(payload.nbytes),
                   vs_torch_topk=ref / enc, x_copy=enc / floor)  # fmt: skip
        if mode == "resident":
            row["replays"] = codec.plain.replayer.replayed
    except Exception as e:  # reported in its row; the table goes on
        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
    finally:
        if graphs is None:
            os.environ.pop("GRADSYNC_CUDA_GRAPHS", None)
        else:
            os.environ["GRADSYNC_CUDA_GRAPHS"] = graphs
    return row


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("out")
    p.add_argument("--sizes", default="20,22,24,26", help="log2 of the element counts")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke run")
    p.add_argument(
        "--modes",
        default="resident,eager",
        help="resident (replayed graphs: the GPU path), eager and/or host",
    )
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to time (--device cpu for a smoke run)", file=sys.stderr)
        return 1
    rows = []
    for log2 in (int(s) for s in args.sizes.split(",")):
        g = torch.randn(1 << log2, device=device)
        for spec in SPECS:
            for mode in args.modes.split(","):
                row = time_codec(spec, g, args.reps, mode)
                rows.append(row)
                if "error" in row:
                    print(f"2^{log2} {spec:28s} {mode:8s} ERROR {row['error']}")
                else:
                    print(f"2^{log2} {spec:28s} {mode:8s} encode {row['encode_ms']:8.3f} ms "
                      f"({row['vs_torch_topk']:6.2f}x torch.topk, {row['x_copy']:6.1f}x copy)  "
                      f"decode {row['decode_ms']:7.3f} ms")  # fmt: skip
    doc = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "reps": args.reps,
        "rows": rows,
    }
    with open(args.out, "w") as fh:
        json.dump(doc, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
