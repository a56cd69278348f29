"""The ``gradsync`` command line."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from gradsync import __version__


def _cmd_codecs(args: argparse.Namespace) -> int:
    from gradsync.codecs import codec_class, codec_names

    for name in codec_names():
        cls = codec_class(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0]
        options = ", ".join(
            f"{f.name}={f.default}" for f in dataclasses.fields(cls.Config) if f.name != "compile"
        )
        traits = [t for t in ("aggregatable", "sparse", "lossless", "randomized") if getattr(cls, t)]
        print(f"{name:13s} {doc}")
        print(f"{'':13s} options: {options or '-'}{'; ' + ', '.join(traits) if traits else ''}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gradsync", description="Compression-aware data-parallel training.")
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    from gradsync import cluster, train
    from gradsync.bench import codecs as bench_codecs
    from gradsync.bench import collectives as bench_collectives
    from gradsync.bench import convergence as bench_convergence
    from gradsync.bench import step as bench_step
    from gradsync.bench import train as bench_train

    commands = [
        (sub, "train", train, "train a model on local workers (or under torchrun) with gradsync"),
        (sub, "cluster", cluster, "an emulated multi-node cluster on this machine (needs root)"),
    ]
    p = sub.add_parser("codecs", help="list the codecs and their options")
    p.set_defaults(func=_cmd_codecs)
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True)
    commands += [
        (
            bsub,
            "codecs",
            bench_codecs,
            "encode/decode speed of every codec against the memory floor and torch.topk",
        ),
        (bsub, "collectives", bench_collectives, "every aggregation scheme on the world it is launched in"),
        (bsub, "step", bench_step, "a training step's time split per synchronization scheme, against DDP"),
        (bsub, "train", bench_train, "gradsync against PyTorch DDP and its hooks: samples/s, scaling factor"),
        (bsub, "convergence", bench_convergence, "each scheme's accuracy next to dense training"),
    ]
    for parent, name, module, text in commands:
        p = parent.add_parser(name, help=text)
        module.add_arguments(p)
        p.set_defaults(func=module.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        return int(args.func(args) or 0)
    except ValueError as e:  # bad option values: a message, not a traceback
        print(f"gradsync: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
