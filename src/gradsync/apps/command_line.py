"""The command line a result records, as the user typed it.

Under the emulated cluster (``--emulate``) the command runs again in every node's processes
without ``--emulate``/``--link``; the parent passes its own command line down in
:data:`COMMAND_LINE_ENV`, so that a result saved by a node's process records the command that
reproduces it."""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

COMMAND_LINE_ENV = "GRADSYNC_COMMAND_LINE"


def command_line(args: Any = None) -> str:
    """``gradsync ...`` as typed: the emulating parent's when there is one, else this process's
    (``args.argv``, which :func:`gradsync.apps.commands.main` sets, or ``sys.argv``)."""
    inherited = os.environ.get(COMMAND_LINE_ENV)
    if inherited:
        return inherited
    return _joined(getattr(args, "argv", None) or sys.argv[1:])


def _joined(argv: list[str]) -> str:
    return "gradsync " + " ".join(shlex.quote(a) for a in argv)


@contextmanager
def passed_down(argv: list[str]) -> Iterator[None]:
    """Within the block, the processes this one starts record ``argv`` (this process's full
    command) as their command line."""
    before = os.environ.get(COMMAND_LINE_ENV)
    os.environ[COMMAND_LINE_ENV] = before or _joined(argv)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(COMMAND_LINE_ENV, None)
        else:
            os.environ[COMMAND_LINE_ENV] = before
