"""The sync engine: buckets, plans and the task manager that compose codecs and collectives
into overlapped gradient synchronization (paper 05's CaSync, paper 03's fusion)."""

from gradsync.sync.config import SyncConfig
from gradsync.sync.engine import SyncEngine
from gradsync.sync.plan import BucketPlan, Plan
from gradsync.sync.scheme import Scheme
from gradsync.sync.stats import StepStats
from gradsync.sync.tasks import Task, TaskError, TaskManager

__all__ = [
    "BucketPlan",
    "Plan",
    "Scheme",
    "StepStats",
    "SyncConfig",
    "SyncEngine",
    "Task",
    "TaskError",
    "TaskManager",
]
