"""Collectives on torch.distributed: node topology, hierarchical dense all-reduce, compressed
strategies (packed sparse all-gather, hierarchical top-k, CaSync ring and parameter server) and
their alpha-beta cost model. Only typed tensors move; codecs are used, never re-implemented."""

from gradsync.collectives.compressed import STRATEGIES, compressed_allreduce, hitopk
from gradsync.collectives.dense import ALGORITHMS, HybridPolicy, allreduce
from gradsync.collectives.primitives import MismatchError, Traffic, record_traffic
from gradsync.collectives.topology import Topology, TopologyError

__all__ = [
    "ALGORITHMS",
    "STRATEGIES",
    "HybridPolicy",
    "MismatchError",
    "Topology",
    "TopologyError",
    "Traffic",
    "allreduce",
    "compressed_allreduce",
    "hitopk",
    "record_traffic",
]
