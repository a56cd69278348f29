"""Deprecated: the command line moved to :mod:`gradsync.apps.commands`. The ``gradsync`` command
itself is unchanged; this module only keeps ``gradsync.cli.main`` working for code that called it."""

from __future__ import annotations

import warnings

from gradsync.apps.commands import main

warnings.warn(
    "gradsync.cli is deprecated: import gradsync.apps.commands instead (the gradsync command is unchanged)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["main"]
