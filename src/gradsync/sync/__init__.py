"""The gradient-sync core that every front drives (``wrap``'s engine, the DDP comm hook, FSDP2):
the ledger of what error feedback owes (:mod:`~gradsync.sync.ledger`), buckets and their
synchronization, the codecs of a scheme, the task manager that overlaps compression and
communication with the backward pass (CaSync, from "Communication-Efficient Distributed Deep
Learning with Merged Gradient Sparsification on GPUs", and tensor fusion), and the step's
statistics. The planner that decides a plan is :mod:`gradsync.planner`; ``wrap``'s engine is
:mod:`gradsync.integrate.engine`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from gradsync.sync.config import SyncConfig
from gradsync.sync.scheme import Scheme
from gradsync.sync.stats import StepStats
from gradsync.sync.tasks import Task, TaskError, TaskManager

__all__ = ["Scheme", "StepStats", "SyncConfig", "Task", "TaskError", "TaskManager"]

# Names that moved out of this package: still importable from here, with a DeprecationWarning.
_MOVED = {
    "SyncEngine": "gradsync.integrate.engine",
    "Plan": "gradsync.planner.plan",
    "BucketPlan": "gradsync.planner.plan",
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"gradsync.sync.{name} is deprecated: import it from {_MOVED[name]}", DeprecationWarning, stacklevel=2
    )
    return getattr(importlib.import_module(_MOVED[name]), name)
