"""Datasets for ``gradsync train`` and the sharded, prefetching loader that feeds them.

``build_data(spec)`` turns a ``--data`` spec (see :mod:`gradsync.apps.data.spec` for the syntax) into a
:class:`DataBundle`: train and validation datasets of ``(input, target)`` tensor pairs plus their
shape, class count or vocabulary, a fingerprint for checkpoints and a one-line source. Real data
that needs no download (``digits``, ``text``), generated data for speed runs (``synthetic-images``,
``synthetic-text``) and files on disk (``imagefolder:PATH``, ``tokens:PATH``) are available.
:class:`ShardedSampler` and :class:`PrefetchLoader` shard and batch any of them.
"""

from __future__ import annotations

from gradsync.apps.data.bundle import DataBundle, TensorPairs, TokenWindows
from gradsync.apps.data.loader import PrefetchLoader, ShardedSampler, collate
from gradsync.apps.data.spec import build_data, data_names, data_usage, parse_data_spec

__all__ = [
    "DataBundle",
    "PrefetchLoader",
    "ShardedSampler",
    "TensorPairs",
    "TokenWindows",
    "build_data",
    "collate",
    "data_names",
    "data_usage",
    "parse_data_spec",
]
