"""Sharding a dataset over ranks and batching it ahead of the training loop.

:class:`ShardedSampler` gives each rank its part of a per-epoch permutation, with the same indices
as ``torch.utils.data.DistributedSampler`` for the same seed and epoch, but without needing a
process group. :class:`PrefetchLoader` collates batches on one background thread, a bounded number
ahead; it uses no worker processes, since the training processes already keep the cores busy.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections.abc import Iterable, Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from gradsync.apps.data.bundle import MapDataset


def check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def check_shard(length: object, rank: object, world: object, seed: object, *, min_length: int) -> None:
    """A distributed sampler's arguments (``ValueError`` naming the bad one)."""
    check_int("length", length, min_length)
    if check_int("rank", rank, 0) >= check_int("world", world, 1):
        raise ValueError(f"rank must be in [0, world) = [0, {world}), got {rank}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


class ShardedSampler(Sampler[int]):
    """This rank's indices of ``range(length)``: every ``world``-th index of the epoch's order from ``rank``.

    The order is ``torch.randperm(length)`` from a generator seeded with ``seed + epoch`` (the same
    on every rank), or ``0..length-1`` without ``shuffle``. Without ``drop_last`` the order is
    padded by repeating its start so that it divides evenly and every rank gets ``ceil(length /
    world)`` indices; with ``drop_last`` the tail is cut instead and every rank gets ``length //
    world``. Call :meth:`set_epoch` before each epoch to reshuffle.
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
        check_shard(length, rank, world, seed, min_length=0)
        self.length, self.rank, self.world = length, rank, world
        self.shuffle = bool(shuffle)
        self.seed = seed
        self.drop_last = bool(drop_last)
        self.epoch = 0
        if self.drop_last:
            self.num_samples = length // world
        else:
            self.num_samples = math.ceil(length / world)
        self.total_size = self.num_samples * world

    def set_epoch(self, epoch: int) -> None:
        """Use the order of ``epoch`` from the next ``iter`` on."""
        self.epoch = check_int("epoch", epoch, 0)

    def epoch_order(self) -> list[int]:
        """The whole epoch's order before sharding (padded or cut to ``world * len(self)``)."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=g).tolist()
        else:
            order = list(range(self.length))
        if self.total_size > len(order) and order:
            repeats = math.ceil((self.total_size - len(order)) / len(order))
            order += (order * repeats)[: self.total_size - len(order)]
        return order[: self.total_size]

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_order()[self.rank : self.total_size : self.world])

    def __len__(self) -> int:
        return self.num_samples


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


_END = object()
_POLL_S = 0.05
_JOIN_S = 10.0


def collate(items: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``[(input, target), ...]`` into ``(inputs, targets)`` with a leading batch dimension."""
    try:
        inputs = torch.stack([torch.as_tensor(item[0]) for item in items])
        targets = torch.stack([torch.as_tensor(item[1]) for item in items])
    except (TypeError, IndexError, RuntimeError) as exc:
        raise TypeError(f"dataset items must be (input, target) pairs of same-shaped tensors: {exc}") from exc
    return inputs, targets


def load_batch(dataset: MapDataset, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of ``indices``: through the dataset's own ``load_batch`` where it has
    one (the cached datasets fetch a batch's missing files together), else item by item."""
    batched = getattr(dataset, "load_batch", None)
    if batched is not None:
        return batched(indices)
    return collate([dataset[i] for i in indices])


def _put(q: queue.Queue, item: object, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _produce(
    dataset: MapDataset,
    indices: Iterator[int],
    batch_size: int,
    drop_last: bool,
    skip: int,
    q: queue.Queue,
    stop: threading.Event,
) -> None:
    try:
        for _ in range(skip):  # skip batches without loading them
            if len(list(itertools.islice(indices, batch_size))) < batch_size:
                break
        while not stop.is_set():
            chunk = list(itertools.islice(indices, batch_size))
            if chunk and drop_last and len(chunk) < batch_size:
                warm = getattr(dataset, "warm", None)
                if warm is not None:  # a cache still loads what the short last batch leaves out
                    warm(chunk)
                break
            if not chunk:
                break
            if not _put(q, load_batch(dataset, chunk), stop):
                return
        _put(q, _END, stop)
    except BaseException as exc:  # handed to the consumer, which re-raises it
        _put(q, _Failure(exc), stop)


class PrefetchLoader:
    """Batches from a dataset in sampler order, collated into stacked tensors, prepared by a background
    thread ``depth`` batches ahead.

    Each iteration starts one daemon thread that reads ``dataset[i]`` for the sampler's indices and
    puts ``(inputs, targets)`` batches on a queue of ``depth`` slots. An exception raised there is
    raised again in the consuming loop. Leaving the loop early (``break``, an exception, closing the
    generator) stops and joins the thread. The caller calls ``sampler.set_epoch`` between epochs.
    """

    def __init__(
        self,
        dataset: MapDataset,
        sampler: Iterable[int],
        batch_size: int,
        *,
        drop_last: bool = True,
        depth: int = 2,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.batch_size = check_int("batch_size", batch_size, 1)
        self.drop_last = bool(drop_last)
        self.depth = check_int("depth", depth, 1)

    def __len__(self) -> int:
        if not isinstance(self.sampler, Sized):
            raise TypeError("the sampler has no len()")
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return self.iter_from(0)

    def iter_from(self, skip: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Like ``iter(self)`` but without the first ``skip`` batches (resuming mid-epoch).

        Skipped batches are not loaded; only their indices are drawn from the sampler.
        """
        check_int("skip", skip, 0)
        # the sampler's iterator is taken now, so a set_epoch after this call leaves this pass alone
        return self._batches(iter(self.sampler), skip)

    def _batches(self, indices: Iterator[int], skip: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        q: queue.Queue = queue.Queue(maxsize=self.depth)
        stop = threading.Event()
        thread = threading.Thread(
            target=_produce,
            args=(self.dataset, indices, self.batch_size, self.drop_last, skip, q, stop),
            name="gradsync-prefetch",
            daemon=True,
        )
        thread.start()
        try:
            while True:
                try:
                    item = q.get(timeout=_POLL_S)
                except queue.Empty:
                    if thread.is_alive():
                        continue
                    try:  # it may have finished between the timeout and the check
                        item = q.get_nowait()
                    except queue.Empty:
                        raise RuntimeError("the prefetch thread stopped without finishing") from None
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            stop.set()
            thread.join(timeout=_JOIN_S)
