"""The ``gradsync`` command line.

Every command runs in two steps: its ``check(args)``, which rejects bad option values before
anything runs (no process, process group, data or benchmark yet), then its ``main(args)``. The
exit status says which step failed:

- 0: done.
- 1: a failure while running (ranks that disagree, a synchronization or task error, a damaged
  checkpoint, a diverged loss, a failed worker...), or the ``apps`` extra is not installed;
  one line on stderr, ``GRADSYNC_DEBUG=1`` adds the traceback.
- 2: a usage error: argparse's own, or a value a command's check refused.
- 130: interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from gradsync import __version__

# What the command line imports beyond torch (pyproject's `apps` extra): import name ->
# distribution name.
APP_MODULES = {
    "rich": "rich",
    "numpy": "numpy",
    "sklearn": "scikit-learn",
    "PIL": "pillow",
    "matplotlib": "matplotlib",
    "aiohttp": "fsspec[http]",  # fsspec itself comes with torch
}
INSTALL_APPS = 'pip install "gradsync[apps]"'
DEBUG_VARIABLE = "GRADSYNC_DEBUG"

EPILOG = (
    "exit status: 0 done, 1 failed while running, 2 usage error (a bad option value), "
    f"130 interrupted. {DEBUG_VARIABLE}=1 prints the traceback of a failure."
)


class UsageError(Exception):
    """A command-line option value refused before anything ran: ``gradsync`` exits 2."""


def missing_app_modules() -> list[str]:
    """The distributions of the ``apps`` extra that cannot be imported here."""
    missing = []
    for module, dist in APP_MODULES.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(dist)
    return missing


def _apps_hint(missing: list[str]) -> str:
    return f"gradsync: the command line needs the apps extra ({', '.join(missing)} missing): {INSTALL_APPS}"


def _cmd_codecs(args: argparse.Namespace) -> int:
    from gradsync.codecs import codec_class, codec_names

    for name in codec_names():
        cls = codec_class(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        options = ", ".join(
            f"{f.name}={f.default}" for f in dataclasses.fields(cls.Config) if f.name != "compile"
        )
        traits = [t for t in ("summable", "sparse", "lossless", "randomized") if getattr(cls, t, False)]
        print(f"{name:13s} {doc}")
        print(f"{'':13s} options: {options or '-'}{'; ' + ', '.join(traits) if traits else ''}")
    return 0


def _cmd_cluster(args: argparse.Namespace) -> int:
    from gradsync import cluster

    # cluster reports its own failures (ClusterError: exit 1) and runs every gradsync command in
    # child processes, so a ValueError leaving it is an option it refused before doing anything
    try:
        return cluster.main(args)
    except ValueError as e:
        raise UsageError(str(e)) from e


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsync", description="Compression-aware data-parallel training.", epilog=EPILOG
    )
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from gradsync import cluster, profile_cli, trace_cli, train, whatif_cli
    from gradsync.bench import codecs as bench_codecs
    from gradsync.bench import collectives as bench_collectives
    from gradsync.bench import convergence as bench_convergence
    from gradsync.bench import datacache as bench_datacache
    from gradsync.bench import fsdp as bench_fsdp
    from gradsync.bench import large_batch as bench_large_batch
    from gradsync.bench import optim as bench_optim
    from gradsync.bench import overhead as bench_overhead
    from gradsync.bench import pto as bench_pto
    from gradsync.bench import step as bench_step
    from gradsync.bench import train as bench_train
    from gradsync.bench import whatif as bench_whatif

    p = sub.add_parser("train", help="train a model on local workers (or under torchrun) with gradsync")
    train.add_arguments(p)
    p.set_defaults(check=train.check, func=train.main)
    p = sub.add_parser("cluster", help="an emulated multi-node cluster on this machine (needs root)")
    cluster.add_arguments(p)
    p.set_defaults(check=None, func=_cmd_cluster)
    p = sub.add_parser("trace", help="merge, check or draw a timeline written by --trace")
    trace_cli.add_arguments(p)
    p.set_defaults(check=trace_cli.check, func=trace_cli.main)
    p = sub.add_parser("codecs", help="list the codecs and their options")
    p.set_defaults(check=None, func=_cmd_codecs)
    p = sub.add_parser("profile", help="each gradient's ready time in a training step, and the phases")
    profile_cli.add_arguments(p)
    p.set_defaults(check=profile_cli.check, func=profile_cli.main)
    p = sub.add_parser("whatif", help="predicted step time and scaling factor on any cluster and network")
    whatif_cli.add_arguments(p)
    p.set_defaults(check=whatif_cli.check, func=whatif_cli.main)
    p = sub.add_parser("calibrate", help="measure the running cluster's links for gradsync whatif --links")
    whatif_cli.calibrate_add_arguments(p)
    p.set_defaults(check=whatif_cli.calibrate_check, func=whatif_cli.calibrate_main)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    benchmarks: list[tuple[str, Any, str]] = [
        ("codecs", bench_codecs, "encode/decode speed of each codec against the memory floor and torch.topk"),
        ("collectives", bench_collectives, "every aggregation scheme on the world it is launched in"),
        ("step", bench_step, "a training step's time split per synchronization scheme, against DDP"),
        ("train", bench_train, "gradsync against PyTorch DDP and its hooks: samples/s, scaling factor"),
        ("convergence", bench_convergence, "each scheme's accuracy next to dense training"),
        ("fsdp", bench_fsdp, "FSDP2, HSDP and replicate() with and without gradsync's compression"),
        (
            "large-batch",
            bench_large_batch,
            "LARS at a large global batch against SGD at the small and large one",
        ),
        ("pto", bench_pto, "paper 01's parallel tensor operator against local trust ratios: the crossover"),
        (
            "optim",
            bench_optim,
            "the LARS and LAMB step against a per-parameter loop, SGD and the memory floor",
        ),
        (
            "datacache",
            bench_datacache,
            "training from an image folder behind a slow link, with and without the data cache",
        ),
        ("overhead", bench_overhead, "what recording a timeline (--trace) costs a step"),
        ("whatif", bench_whatif, "the what-if simulator's predicted step next to the measured one"),
    ]
    for name, module, text in benchmarks:
        p = bsub.add_parser(name, help=text)
        module.add_arguments(p)
        p.set_defaults(check=module.check, func=module.main)
    return parser


def _one_line(e: BaseException, debug: bool) -> str:
    """The failure's message on one line; other libraries' exceptions also get their type and
    the way to their traceback (gradsync's own messages are written to be read as they are)."""
    text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
    if type(e).__module__.split(".")[0] == "gradsync":
        return text or type(e).__name__
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if debug else f"{text} ({DEBUG_VARIABLE}=1 prints the traceback)"


def _run(args: argparse.Namespace) -> int:
    check: Callable[[argparse.Namespace], None] | None = args.check
    if check is not None:
        try:
            check(args)
        except ValueError as e:
            raise UsageError(str(e)) from e
    return int(args.func(args) or 0)


def main(argv: list[str] | None = None) -> int:
    missing = missing_app_modules()
    if missing:
        print(_apps_hint(missing), file=sys.stderr)
        return 1
    args = build_parser().parse_args(argv)  # argparse's own usage errors exit 2 here
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    debug = os.environ.get(DEBUG_VARIABLE, "") not in ("", "0")
    try:
        return _run(args)
    except UsageError as e:
        print(f"gradsync: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("gradsync: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            traceback.print_exc()
        module = (getattr(e, "name", None) or "").split(".")[0] if isinstance(e, ImportError) else ""
        if module in APP_MODULES:
            print(_apps_hint([APP_MODULES[module]]), file=sys.stderr)
        else:
            print(f"gradsync: error: {_one_line(e, debug)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
