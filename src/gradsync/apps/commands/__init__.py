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
import importlib
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


@dataclasses.dataclass(frozen=True)
class Command:
    """One ``gradsync`` command: a module of this package (or of ``bench``) that defines
    ``add_arguments(parser)``, ``check(args)`` (raises ``ValueError`` naming the option and what it
    allows, before anything runs) and ``main(args) -> int``."""

    name: str
    module: str
    help: str


# Every command, in the order ``gradsync --help`` lists them. A new command is a module with the
# three functions and one line here.
COMMANDS: tuple[Command, ...] = (
    Command("train", "train", "train a model on local workers (or under torchrun) with gradsync"),
    Command("cluster", "cluster", "an emulated multi-node cluster on this machine (needs root)"),
    Command("trace", "trace", "merge, check or draw a timeline written by --trace"),
    Command("codecs", "codecs", "list the codecs and their options"),
    Command("profile", "profile", "each gradient's ready time in a training step, and the phases"),
    Command("whatif", "whatif", "predicted step time and scaling factor on any cluster and network"),
    Command("advise", "advise", "every mode ranked by predicted speed with its measured quality cost"),
    Command("calibrate", "calibrate", "measure the running cluster's links for gradsync whatif --links"),
)

# ``gradsync bench NAME``: each a module of ``bench`` here, with the same three functions.
BENCHMARKS: tuple[Command, ...] = (
    Command(
        "codecs",
        "bench.codecs",
        "encode/decode speed of each codec against the memory floor and torch.topk",
    ),
    Command("collectives", "bench.collectives", "every aggregation scheme on the world it is launched in"),
    Command("step", "bench.step", "a training step's time split per synchronization scheme, against DDP"),
    Command(
        "gpu-step",
        "bench.gpu_step",
        "one GPU: the share of a real training step gradsync's codec work takes, beside DDP and PowerSGD",
    ),
    Command("train", "bench.train", "gradsync against PyTorch DDP and its hooks: samples/s, scaling factor"),
    Command("convergence", "bench.convergence", "each scheme's accuracy next to dense training"),
    Command("fsdp", "bench.fsdp", "FSDP2, HSDP and replicate() with and without gradsync's compression"),
    Command(
        "large-batch",
        "bench.large_batch",
        "LARS at a large global batch against SGD at the small and large one",
    ),
    Command(
        "pto",
        "bench.pto",
        "the parallel tensor operator (MSTopK paper) against local trust ratios: the crossover",
    ),
    Command(
        "optim",
        "bench.optim",
        "the LARS and LAMB step against a per-parameter loop, SGD and the memory floor",
    ),
    Command(
        "datacache",
        "bench.datacache",
        "training from an image folder behind a slow link, with and without the data cache",
    ),
    Command("overhead", "bench.overhead", "what recording a timeline (--trace) costs a step"),
    Command("whatif", "bench.whatif", "the what-if simulator's predicted step next to the measured one"),
)


def _add(sub: Any, command: Command) -> None:
    module = importlib.import_module(f"{__name__}.{command.module}")
    p = sub.add_parser(command.name, help=command.help)
    module.add_arguments(p)
    p.set_defaults(check=module.check, func=module.main)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradsync", description="Compression-aware data-parallel training.", epilog=EPILOG
    )
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        _add(sub, command)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    for command in BENCHMARKS:
        _add(bsub, command)
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
    check: Callable[[argparse.Namespace], None] = args.check
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
