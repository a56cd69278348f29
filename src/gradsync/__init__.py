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

__version__ = "0.1.0"

__all__ = [
    "Codec",
    "EncodeContext",
    "ErrorFeedback",
    "FeedbackConfig",
    "Payload",
    "__version__",
    "build_codec",
    "codec_names",
]
