"""Codec library: every compressor of the papers behind one encode/decode contract.

>>> import torch, gradsync
>>> codec = gradsync.build_codec("topk:density=0.01")
>>> payload = codec.encode(torch.randn(1000))
>>> codec.decode(payload).count_nonzero().item()
10
"""

from gradsync.codecs.base import Codec, EncodeContext, Stream
from gradsync.codecs.compressor import Compressor, Owed
from gradsync.codecs.config import CodecConfig, OptionsConfig, SparsityConfig
from gradsync.codecs.feedback import ErrorFeedback, FeedbackConfig
from gradsync.codecs.payload import HEADER_BYTES, Flag, Header, Payload
from gradsync.codecs.registry import build_codec, codec_class, codec_names, register

__all__ = [
    "HEADER_BYTES",
    "Codec",
    "CodecConfig",
    "Compressor",
    "EncodeContext",
    "ErrorFeedback",
    "FeedbackConfig",
    "Flag",
    "Header",
    "OptionsConfig",
    "Owed",
    "Payload",
    "SparsityConfig",
    "Stream",
    "build_codec",
    "codec_class",
    "codec_names",
    "register",
]
