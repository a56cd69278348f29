"""``gradsync bench codecs``: encode/decode speed of every codec against the memory floor.

For each tensor size the floor is one read pass (``x.sum()`` over the same float32 tensor), timed
alternately with the codec so that each ratio comes from the same moments of the same run. The
selection codecs are also compared with the obvious alternative, ``torch.topk`` on ``|x|``.
Encode writes into a reused payload buffer and decode into a reused output tensor, as the sync
engine does; a fresh allocation per call would mostly measure page faults.

Variants: ``eager`` (default operators: the native kernels where built), ``torch`` (the same
codecs with the native kernels switched off) and ``compiled`` (``compile=true``: torch.compile).

``--ef`` adds each sparsifier under error feedback, as the sync engine runs it: ``ef fused``
(the residual added to the gradient inside the selection's first scan, where the codec can)
timed alternately with ``ef add+encode`` (the addition first, then the codec), the same payload
and residual both ways; the ``vs add+encode`` column is the median of their per-pair ratios.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
from dataclasses import asdict, dataclass
from typing import Any

import torch

from gradsync.apps.command_line import command_line
from gradsync.apps.commands.bench.support.output import markdown_table, save_result
from gradsync.apps.commands.bench.support.timing import paired
from gradsync.codecs import build_codec, codec_class, codec_names
from gradsync.codecs.config import SparsityConfig
from gradsync.codecs.ops import backend, native

VARIANTS = ("eager", "torch", "compiled")

# extra options per codec for the benchmark (defaults otherwise)
EXTRA = {"tbq": "threshold=1.5", "powersgd": "rank=4"}


@dataclass
class Row:
    codec: str
    variant: str
    log2: int
    numel: int
    density: float | None
    encode_ms: float
    encode_x_floor: float
    decode_ms: float
    decode_x_floor: float
    payload_bytes: int
    compression: float
    floor_ms: float
    vs_torch_topk: float | None = None
    vs_unfused: float | None = None  # ef fused: add+encode's time / this one's (paired)


def _spec(name: str, density: float | None, variant: str) -> str:
    opts = []
    if density is not None:
        opts.append(f"density={density}")
    if name in EXTRA:
        opts.append(EXTRA[name])
    if variant == "compiled":
        opts.append("compile=true")
    return name + (":" + ",".join(opts) if opts else "")


def _is_sparse(name: str) -> bool:
    return issubclass(codec_class(name).Config, SparsityConfig)


def _shape(name: str, n: int) -> tuple[int, ...]:
    # PowerSGD needs a matrix: the most square factorization by a power of two
    if name == "powersgd":
        rows = 2 ** (int(math.log2(n)) // 2)
        return (rows, n // rows)
    return (n,)


def bench_one(name: str, x: torch.Tensor, density: float | None, variant: str, budget: float) -> Row:
    spec = _spec(name, density, variant)
    codec = build_codec(spec)
    shape = _shape(name, x.numel())
    xs = x.view(shape)
    buf = torch.empty(codec.max_nbytes(x.numel(), shape), dtype=torch.uint8)
    out = torch.empty(shape)
    floor = x.sum
    with backend("torch" if variant == "torch" else "native"):
        enc = paired(lambda: codec.encode(xs, out=buf), floor, budget_s=budget)
        payload = codec.encode(xs, out=buf)  # the buffer now holds exactly this payload
        dec = paired(lambda: codec.decode(payload, out=out), floor, budget_s=budget)
    dense = x.numel() * x.element_size()
    return Row(
        codec=name,
        variant=variant,
        log2=int(math.log2(x.numel())),
        numel=x.numel(),
        density=density,
        encode_ms=enc.seconds * 1e3,
        encode_x_floor=enc.ratio,
        decode_ms=dec.seconds * 1e3,
        decode_x_floor=dec.ratio,
        payload_bytes=payload.nbytes,
        compression=dense / payload.nbytes,
        floor_ms=enc.reference * 1e3,
    )


def bench_feedback(name: str, x: torch.Tensor, density: float, budget: float) -> list[Row]:
    """``name`` under error feedback, fused against add+encode (see the module), each with its
    own residual, both encoding the same gradient every call."""
    from gradsync.codecs import ErrorFeedback

    spec = _spec(name, density, "eager") + "+ef"
    fused, unfused = build_codec(spec), build_codec(spec)
    assert isinstance(fused, ErrorFeedback) and isinstance(unfused, ErrorFeedback)
    unfused.fuse_sum = False
    buf = torch.empty(fused.max_nbytes(x.numel()), dtype=torch.uint8)
    both = paired(lambda: fused.encode(x, out=buf), lambda: unfused.encode(x, out=buf), budget_s=budget)
    floor = paired(lambda: unfused.encode(x, out=buf), x.sum, budget_s=budget)
    payload = fused.encode(x, out=buf)
    rows = []
    for variant, seconds in (("ef fused", both.seconds), ("ef add+encode", both.reference)):
        rows.append(Row(
            codec=name + "+ef", variant=variant, log2=int(math.log2(x.numel())), numel=x.numel(),
            density=density, encode_ms=seconds * 1e3, encode_x_floor=seconds / floor.reference,
            decode_ms=math.nan, decode_x_floor=math.nan, payload_bytes=payload.nbytes,
            compression=x.numel() * x.element_size() / payload.nbytes, floor_ms=floor.reference * 1e3,
            vs_unfused=1 / both.ratio if variant == "ef fused" else None,
        ))  # fmt: skip
    return rows


def bench_torch_topk(x: torch.Tensor, density: float, budget: float) -> Row:
    k = max(1, math.ceil(density * x.numel()))
    a = torch.empty_like(x)

    def run() -> None:
        torch.abs(x, out=a)
        torch.topk(a, k, sorted=False)

    t = paired(run, x.sum, budget_s=budget)
    return Row(
        "torch.topk",
        "reference",
        int(math.log2(x.numel())),
        x.numel(),
        density,
        t.seconds * 1e3,
        t.ratio,
        math.nan,
        math.nan,
        0,
        math.nan,
        t.reference * 1e3,
    )


def _names(args: argparse.Namespace) -> list[str]:
    return codec_names() if args.codecs == "all" else [c.strip() for c in args.codecs.split(",")]


def _variants(args: argparse.Namespace) -> list[str]:
    return [v.strip() for v in args.variants.split(",")]


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    names = _names(args)
    variants = _variants(args)
    rows: list[Row] = []
    gen = torch.Generator().manual_seed(args.seed)
    jobs = []
    for log2 in args.sizes:
        for name in names:
            for density in args.densities if _is_sparse(name) else [None]:
                for variant in variants:
                    jobs.append((log2, name, density, variant))
    from rich.progress import Progress

    with Progress(transient=True, disable=not sys.stderr.isatty()) as progress:
        task = progress.add_task(
            "benchmarking codecs", total=len(jobs) + len(args.sizes) * len(args.densities)
        )
        for log2 in args.sizes:
            x = torch.randn(2**log2, generator=gen)
            ref: dict[float, float] = {}
            for density in args.densities:
                row = bench_torch_topk(x, density, args.budget)
                ref[density] = row.encode_ms
                rows.append(row)
                progress.advance(task)
            for jl, name, density, variant in jobs:
                if jl != log2:
                    continue
                row = bench_one(name, x, density, variant, args.budget)
                if density is not None:
                    row.vs_torch_topk = ref[density] / row.encode_ms
                rows.append(row)
                if args.ef and density is not None and variant == "eager":
                    rows += bench_feedback(name, x, density, args.budget)
                progress.advance(task)
    return {
        "command": command_line(),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
        },
        "torch": torch.__version__,
        "threads": args.threads,
        "native_kernels": native.AVAILABLE,
        "rows": [asdict(r) for r in rows],
    }


COLUMNS = (
    "codec", "variant", "n", "density", "encode ms", "enc/floor", "decode ms", "dec/floor", "payload B",
    "ratio", "vs torch.topk", "vs add+encode",
)  # fmt: skip


def _cells(r: dict[str, Any]) -> list[str]:
    def f(v: float | None, fmt: str) -> str:
        return "" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    return [
        r["codec"], r["variant"], f"2^{r['log2']}", f(r["density"], "g"), f(r["encode_ms"], ".3f"),
        f(r["encode_x_floor"], ".2f"), f(r["decode_ms"], ".3f"), f(r["decode_x_floor"], ".2f"),
        f(r["payload_bytes"] or None, "d"), f(r["compression"], ".1f"), f(r["vs_torch_topk"], ".1f"),
        f(r.get("vs_unfused"), ".2f"),
    ]  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    """The result table as GitHub markdown."""
    return markdown_table(COLUMNS, [_cells(r) for r in result["rows"]])


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    title = f"codec speed, {result['threads']} thread(s), ratios to the read floor x.sum() in the same run"
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("codec", "variant") else "right")
    for r in result["rows"]:
        table.add_row(*_cells(r))
    console = Console() if sys.stdout.isatty() else Console(width=200)
    console.print(table)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        type=_int_list,
        default=[18, 20, 22, 24],
        help="log2 of the tensor sizes (default 18,20,22,24)",
    )
    p.add_argument("--densities", type=_float_list, default=[0.01, 0.001], help="densities for sparsifiers")
    p.add_argument("--codecs", default="all", help="comma-separated codec names (default all)")
    p.add_argument("--variants", default="eager", help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument(
        "--ef",
        action="store_true",
        help="also time each sparsifier under error feedback: fused with the residual's addition, "
        "and add+encode (needs the eager variant)",
    )
    p.add_argument(
        "--budget", type=float, default=0.25, help="seconds of timing per measurement (default 0.25)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--markdown", metavar="PATH", help="also write the table as markdown")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(not 0 <= v <= 30 for v in values):
        raise argparse.ArgumentTypeError(f"sizes are log2 values in [0, 30], got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"densities must be in (0, 1], got {text!r}")
    return values


def check(args: argparse.Namespace) -> None:
    """The option values, before anything is benchmarked (``ValueError`` naming the option)."""
    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if args.budget <= 0:
        raise ValueError(f"--budget must be positive, got {args.budget}")
    for name in _names(args):
        codec_class(name)  # validates the name
    for v in _variants(args):
        if v not in VARIANTS:
            raise ValueError(f"--variants: {v!r} is not one of {', '.join(VARIANTS)}")
    if getattr(args, "ef", False):
        if "eager" not in _variants(args):
            raise ValueError(f"--ef times the eager variant, and --variants {args.variants!r} leaves it out")
        if not any(_is_sparse(n) for n in _names(args)):
            raise ValueError(
                f"--ef times sparsifiers under error feedback, and --codecs {args.codecs!r} has none"
            )


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`)."""
    result = run(args)
    print_table(result)
    save_result(result, args.json, args.markdown, markdown(result))
    return 0
