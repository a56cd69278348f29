"""gradsync: communication-efficient, compression-aware data-parallel training for PyTorch."""

from gradsync.codecs import (
    Codec,
    EncodeContext,
    ErrorFeedback,
    FeedbackConfig,
    Payload,
    build_codec,
    codec_names,
)
from gradsync.collectives import Topology
from gradsync.integrate import GradSync, SyncedOptimizer, ddp_comm_hook, register_comm_hook, wrap
from gradsync.outer import OuterLoop
from gradsync.sync import StepStats, SyncConfig
from gradsync.sync.host_reads import audit_host_reads
from gradsync.version import VERSION

__version__ = VERSION

__all__ = [
    "Codec",
    "EncodeContext",
    "ErrorFeedback",
    "FeedbackConfig",
    "GradSync",
    "OuterLoop",
    "Payload",
    "StepStats",
    "SyncConfig",
    "SyncedOptimizer",
    "Topology",
    "__version__",
    "audit_host_reads",
    "build_codec",
    "codec_names",
    "ddp_comm_hook",
    "register_comm_hook",
    "wrap",
]
