"""The gradient-sync core that every front drives (``wrap``'s engine, the DDP comm hook, FSDP2):
the ledger of what error feedback owes (:mod:`~gradsync.sync.ledger`), buckets and their
synchronization, the codecs of a scheme, the task manager that overlaps compression and
communication with the backward pass (CaSync, from "Communication-Efficient Distributed Deep
Learning with Merged Gradient Sparsification on GPUs", and tensor fusion), and the step's
statistics. The planner that decides a plan is :mod:`gradsync.planner`; ``wrap``'s engine is
:mod:`gradsync.integrate.engine`.
"""

from __future__ import annotations

from gradsync.sync.config import SyncConfig
from gradsync.sync.scheme import Scheme
from gradsync.sync.stats import StepStats
from gradsync.sync.tasks import Task, TaskError, TaskManager

__all__ = ["Scheme", "StepStats", "SyncConfig", "Task", "TaskError", "TaskManager"]
