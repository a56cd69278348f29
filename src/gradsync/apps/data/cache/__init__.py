"""The data cache (MSTopK paper, §4.1): central storage, a node-local disk tier and a node-shared
memory store of decoded samples, with the dataset partitioned over the nodes.

From any training loop::

    from gradsync.apps.data import build_data
    from gradsync.apps.data.cache import CacheConfig, PartitionSampler

    cache = CacheConfig(directory="/scratch/gradsync-cache", node=int(os.environ["GROUP_RANK"]))
    data = build_data("imagefolder:http://storage:8000/pets,size=64", cache=cache)
    sampler = PartitionSampler(len(data.train), rank, world, seed=0)
    loader = torch.utils.data.DataLoader(data.train, batch_size=64, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ...

or ``gradsync train --data imagefolder:URL --cache DIR``. The modules: :mod:`.source` (fsspec
listing and fetching), :mod:`.disk` (verified, atomic, size-limited file tier), :mod:`.memory`
(the shared-memory store) and :mod:`.memory_files` (its files' home, users and crash clean-up),
:mod:`.tiers` (how the three combine), :mod:`.images` and :mod:`.tokens` (the cached datasets),
:mod:`.partition` (the sampler).

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from gradsync.apps.data.cache.config import CacheConfig, node_index
from gradsync.apps.data.cache.disk import DiskCache, entry_key
from gradsync.apps.data.cache.memory import SharedSampleStore
from gradsync.apps.data.cache.memory_files import reclaim_stale
from gradsync.apps.data.cache.partition import PartitionSampler
from gradsync.apps.data.cache.source import RemoteFile, Storage, StorageError
from gradsync.apps.data.cache.tiers import SampleTiers

__all__ = [
    "CacheConfig",
    "DiskCache",
    "PartitionSampler",
    "RemoteFile",
    "SampleTiers",
    "SharedSampleStore",
    "Storage",
    "StorageError",
    "entry_key",
    "node_index",
    "reclaim_stale",
]
