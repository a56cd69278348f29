"""The partitioned order that lets each node cache only its part of the dataset (MSTopK paper,
§4.1).

:class:`PartitionSampler` splits the dataset once, by a seeded permutation, into one fixed part
per rank; each epoch a rank goes through its own part in a fresh order. So a node (its ranks'
parts together) touches the same ``1/nodes`` of the dataset every epoch, and a memory store of
``dataset / nodes`` samples per node holds everything it will ever be asked for; every sample is
still seen exactly once per epoch across the world (up to the padding every distributed sampler
needs when the dataset does not divide evenly).

Shuffle quality, against a global reshuffle every epoch (``DistributedSampler``): a global batch
is the union of the ranks' batches, and the gradient is their mean, so what matters is which
samples share a step. With fixed parts, each step takes ``batch`` samples from every part: a
stratified draw over random strata. The gradient stays an unbiased estimate of the full-batch
gradient and its variance is no larger than that of the global shuffle's draw; what is lost is
only the variety of which samples meet on the same *rank*, which matters for per-rank statistics
(batch normalization) and nothing else. Since the parts are a random permutation, no rank's part
is biased towards any class. ``gradsync bench datacache`` measures the accuracy of both orders.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from gradsync.apps.data.loader import check_int, check_shard

_PARTITION_STREAM = 0x5EED_CAC4E  # keeps the partition's permutation apart from the epochs' orders


class PartitionSampler(Sampler[int]):
    """This rank's fixed part of ``range(length)``, in a new order each epoch.

    The parts: a permutation of ``range(length)`` seeded by ``seed`` alone, padded by repeating
    its start to a multiple of ``world`` (or cut with ``drop_last``), with rank ``r`` taking
    every ``world``-th entry from ``r``. Epoch ``e`` visits the part in the order of
    ``torch.randperm`` seeded by ``seed``, ``e`` and the rank (or in the part's order without
    ``shuffle``). ``len`` is the same as ``DistributedSampler``'s. Call :meth:`set_epoch` before
    each epoch.
    """

    def __init__(
        self,
        length: int,
        rank: int,
        world: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        check_shard(length, rank, world, seed, min_length=1)
        self.length, self.rank, self.world = length, rank, world
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.epoch = 0
        self.num_samples = length // world if drop_last else math.ceil(length / world)
        if self.num_samples == 0:
            raise ValueError(f"length {length} leaves nothing for each of {world} ranks with drop_last")
        total = self.num_samples * world
        g = torch.Generator().manual_seed(seed ^ _PARTITION_STREAM)
        order = torch.randperm(length, generator=g).tolist()
        if total > length:
            order += (order * math.ceil((total - length) / length))[: total - length]
        self.part = order[:total][rank::world]

    @staticmethod
    def owner(length: int, world: int, seed: int = 0) -> list[int]:
        """The rank whose part holds each index (without padding duplicates: the first owner)."""
        g = torch.Generator().manual_seed(seed ^ _PARTITION_STREAM)
        order = torch.randperm(length, generator=g).tolist()
        owners = [0] * length
        for position, index in enumerate(order):
            owners[index] = position % world
        return owners

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next ``iter`` on."""
        self.epoch = check_int("epoch", epoch, 0)

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(list(self.part))
        mixed = self.seed * 0x9E3779B1 + self.epoch * 0x85EBCA6B + self.rank * 0xC2B2AE35
        g = torch.Generator().manual_seed(mixed % (1 << 63))
        return iter([self.part[i] for i in torch.randperm(len(self.part), generator=g).tolist()])

    def __len__(self) -> int:
        return self.num_samples
