"""How the sync engine fails: once, with a message that names the likely cause, and for good.

The first error of a step (a collective that timed out, a peer that closed its connection, a
mismatch the step check found, a configuration error) is recorded; every later call of the
engine raises it again, because the ranks' collectives may no longer pair.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from gradsync.sync.sequence import UNEVEN_HINT
from gradsync.sync.tasks import TaskError


class SyncError(RuntimeError):
    """Synchronization failed (a peer stopped, timed out, or the engine failed before)."""


class Failure:
    """The first failure of one rank's engine (``error``: None while there is none)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.error: BaseException | None = None

    @contextlib.contextmanager
    def guard(self, step: Callable[[], int], on_failure: Callable[[], None]) -> Iterator[None]:
        """Re-raise an earlier failure; record a new one (explained, for ``step()``) and call
        ``on_failure`` (the engine leaves its step), so every later call reports it too."""
        if self.error is not None:
            raise SyncError(
                f"gradsync: synchronization failed earlier on rank {self.rank} "
                f"({type(self.error).__name__}: {self.error}); the ranks' collectives may no longer "
                "pair, so this engine cannot continue (restart from a checkpoint)"
            ) from self.error
        try:
            yield
        except BaseException as e:
            on_failure()
            self.error = self.explained(e, step())
            if self.error is e:
                raise
            raise self.error from e

    def explained(self, e: BaseException, step: int) -> BaseException:
        """The error to report for ``e``: a configuration error, a mismatch or misuse (already
        named) or an interrupt as it is; anything else as a peer that stopped synchronizing."""
        root = e.__cause__ if isinstance(e, TaskError) and e.__cause__ is not None else e
        if isinstance(root, (ValueError, TypeError, SyncError)) or not isinstance(root, Exception):
            return root
        return SyncError(
            f"gradsync: rank {self.rank} could not synchronize step {step} "
            f"({type(root).__name__}: {root}). Another rank stopped synchronizing: it failed, was "
            f"killed, or ran out of data; {UNEVEN_HINT}"
        )
