"""Integration with PyTorch training code: ``wrap(model)``, the DDP comm hook, the optimizer wrapper."""

from gradsync.integrate.ddp_hook import HookState, ddp_comm_hook, gradsync_hook, register_comm_hook
from gradsync.integrate.wrap import GradSync, SyncedOptimizer, wrap

__all__ = [
    "GradSync",
    "HookState",
    "SyncedOptimizer",
    "ddp_comm_hook",
    "gradsync_hook",
    "register_comm_hook",
    "wrap",
]
