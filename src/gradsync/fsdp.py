"""Compression inside FSDP2: ``gradsync.fsdp.compress_fsdp(model, "topk:density=0.01", ...)`` after
``fully_shard``, or ``gradsync.fsdp.replicate(model, scheme)`` for data parallelism on FSDP2.

See :mod:`gradsync.integrate.fsdp`."""

from gradsync.integrate.fsdp import WHERE, FsdpCompression, compress_fsdp
from gradsync.integrate.fsdp_replicate import replicate

__all__ = ["WHERE", "FsdpCompression", "compress_fsdp", "replicate"]
