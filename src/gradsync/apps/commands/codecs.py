"""``gradsync codecs``: every codec with its options and traits."""

from __future__ import annotations

import argparse
import dataclasses

from gradsync.codecs import codec_class, codec_names


def add_arguments(p: argparse.ArgumentParser) -> None:
    """No options."""


def check(args: argparse.Namespace) -> None:
    """Nothing to check."""


def main(args: argparse.Namespace) -> int:
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
