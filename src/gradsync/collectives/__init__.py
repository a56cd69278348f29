"""Collectives on torch.distributed: node topology, hierarchical dense all-reduce, compressed
strategies (packed sparse all-gather, hierarchical top-k, CaSync ring and parameter server) and
their alpha-beta cost model. Only typed tensors move; codecs are used, never re-implemented."""

from gradsync.collectives.compressed import compressed_allreduce, hitopk
from gradsync.collectives.dense import (
    DenseAlgorithm,
    HybridPolicy,
    allreduce,
    dense_algorithm,
    dense_algorithm_names,
    register_dense_algorithm,
)
from gradsync.collectives.primitives import MismatchError, Traffic, record_traffic
from gradsync.collectives.strategies import (
    CompressedStrategy,
    compressed_strategy,
    compressed_strategy_names,
    register_compressed_strategy,
)
from gradsync.collectives.topology import Topology, TopologyError

__all__ = [
    "CompressedStrategy",
    "DenseAlgorithm",
    "HybridPolicy",
    "MismatchError",
    "Topology",
    "TopologyError",
    "Traffic",
    "allreduce",
    "compressed_allreduce",
    "compressed_strategy",
    "compressed_strategy_names",
    "dense_algorithm",
    "dense_algorithm_names",
    "hitopk",
    "record_traffic",
    "register_compressed_strategy",
    "register_dense_algorithm",
]
