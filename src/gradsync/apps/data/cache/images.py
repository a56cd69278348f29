"""An image folder on central storage (any fsspec URL), read through the cache tiers.

The layout, split, decoding and standardization are those of the local image folder
(:mod:`gradsync.apps.data.imagefolder`): the same folder gives the same samples whether it is read
from a path or a URL, cached or not. Decoded samples are kept as uint8 ``(C, H, W)`` arrays (one
byte per pixel value, a quarter of float32), standardized when a batch is made.
"""

from __future__ import annotations

import posixpath
from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from gradsync.apps.data.bundle import DataBundle, fingerprint
from gradsync.apps.data.cache.config import CacheConfig
from gradsync.apps.data.cache.source import RemoteFile, Storage
from gradsync.apps.data.cache.tiers import SampleTiers
from gradsync.apps.data.imagefolder import (
    IMAGE_EXTENSIONS,
    VAL_FRACTION,
    decode_image,
    image_statistics,
    statistics_sample,
)

Labelled = list[tuple[RemoteFile, int]]


def _visible_image(rel: str) -> bool:
    parts = rel.split("/")
    return not any(p.startswith(".") for p in parts) and parts[-1].lower().endswith(IMAGE_EXTENSIONS)


def _walk_key(rel: str) -> list[tuple[int, str]]:
    """Sort key that orders a class folder's files as ``os.walk`` with sorted names does: a
    folder's own files first, then each sub-folder's, depth first."""
    *dirs, name = rel.split("/")
    return [(1, d) for d in dirs] + [(0, name)]


def _by_class(
    files: list[RemoteFile], prefix: str, where: str
) -> tuple[list[str], dict[str, list[RemoteFile]]]:
    groups: dict[str, list[RemoteFile]] = {}
    for f in files:
        if not f.rel.startswith(prefix):
            continue
        rel = f.rel[len(prefix) :]
        if "/" not in rel or not _visible_image(rel):
            continue
        groups.setdefault(rel.split("/", 1)[0], []).append(f)
    if not groups:
        raise ValueError(
            f"--data imagefolder: {where} has no class sub-folders with images "
            f"(expected {where}/<class name>/<images>, looked for {', '.join(IMAGE_EXTENSIONS)})"
        )
    for name in groups:
        groups[name].sort(key=lambda f: _walk_key(f.rel[len(prefix) :].split("/", 1)[1]))
    return sorted(groups), groups


def _labelled(classes: list[str], groups: dict[str, list[RemoteFile]]) -> Labelled:
    return [(f, label) for label, name in enumerate(classes) for f in groups.get(name, [])]


def _split(files: Labelled, seed: int) -> tuple[Labelled, Labelled]:
    from gradsync.apps.data.bundle import stratified_split

    labels = torch.tensor([label for _, label in files], dtype=torch.int64)
    train_idx, val_idx = stratified_split(labels, VAL_FRACTION, seed)
    return [files[i] for i in train_idx.tolist()], [files[i] for i in val_idx.tolist()]


def index_listing(
    files: list[RemoteFile], seed: int, where: str
) -> tuple[list[str], Labelled, Labelled, str]:
    """Classes, training and validation files and a layout description from a listing (the
    rules of the local image folder: ``train/`` and ``val/`` folders if there is a ``train/``,
    else a seeded 90/10 split)."""
    tops = {f.rel.split("/", 1)[0] for f in files if "/" in f.rel}
    if "train" in tops:
        classes, groups = _by_class(files, "train/", posixpath.join(where, "train"))
        train = _labelled(classes, groups)
        if "val" in tops:
            val_classes, val_groups = _by_class(files, "val/", posixpath.join(where, "val"))
            extra = sorted(set(val_classes) - set(classes))
            if extra:
                raise ValueError(
                    f"--data imagefolder: {where}/val has classes that the training folder lacks: "
                    f"{', '.join(extra)}"
                )
            return classes, train, _labelled(classes, val_groups), "train/val folders"
        return (classes, *_split(train, seed), "seeded 90/10 split of train/")
    classes, groups = _by_class(files, "", where)
    return (classes, *_split(_labelled(classes, groups), seed), "seeded 90/10 split")


class CachedImages(Dataset):
    """One split (train or validation) of a cached image folder: item ``i`` is slot
    ``offset + i`` of the shared tiers, standardized to float32 ``(C, H, W)``."""

    def __init__(
        self,
        tiers: SampleTiers,
        offset: int,
        labels: Sequence[int],
        mean: torch.Tensor,
        std: torch.Tensor,
    ) -> None:
        self.tiers = tiers
        self.offset = offset
        self.labels = torch.tensor(list(labels), dtype=torch.int64)
        self.mean = mean[None, :, None, None]
        self.std = std[None, :, None, None]

    def __len__(self) -> int:
        return len(self.labels)

    def load_batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples of ``indices`` stacked into ``(inputs, targets)``; the batch's missing
        files are fetched together (concurrently) from central storage."""
        n = len(self)
        for i in indices:
            if not 0 <= i < n:
                raise IndexError(f"index {i} is out of range for a dataset of {n} samples")
        arrays = self.tiers.load([self.offset + i for i in indices])
        pixels = torch.from_numpy(np.stack(arrays)).to(torch.float32).div_(255.0)
        return (pixels - self.mean) / self.std, self.labels[list(indices)]

    def warm(self, indices: Sequence[int]) -> None:
        """Load ``indices`` into the cache without returning them (the samples a loader's
        dropped last batch would otherwise leave out of memory until a later epoch reads them)."""
        if self.tiers.memory is None and self.tiers.disk is None:
            return  # nothing would keep them
        self.tiers.load([self.offset + i for i in indices])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.load_batch([int(index)])
        return x[0], y[0]

    def cache_counters(self) -> dict[str, float]:
        """The tiers' counters (shared by the train and validation splits)."""
        return self.tiers.counters()


def load_cached_imagefolder(
    url: str, *, size: int, channels: int | None, seed: int, cache: CacheConfig | None
) -> DataBundle:
    """Index the folder at ``url``, measure the statistics and set the tiers up."""
    cache = cache if cache is not None else CacheConfig(memory=False)
    storage = Storage(url, cache.storage_options)
    files = storage.list_files()
    classes, train, val, layout = index_listing(files, seed, url.rstrip("/"))
    if not val:
        raise ValueError(f"--data imagefolder: {url} has too few images to hold out any for validation")
    everything = [f for f, _ in train] + [f for f, _ in val]
    tiers = SampleTiers(storage, everything, lambda data, f: np.empty(0), disk=cache.build_disk())
    sample = tiers.raw(statistics_sample(len(train), seed))
    mode, mean, std = image_statistics(list(sample), size, channels)
    shape = (len(mode), size, size)

    def decode(data: bytes, f: RemoteFile) -> np.ndarray:
        return np.ascontiguousarray(decode_image(data, size, mode, name=f.url).transpose(2, 0, 1))

    tiers.decode = decode
    listing = [(f.rel, label, f.size, f.version) for f, label in train + val]
    print_ = fingerprint("imagefolder", storage.url, classes, listing, size, mode, seed)
    tiers.memory = cache.build_memory(print_, len(everything), shape, np.uint8)
    where = "cached" if cache.directory or cache.memory else "uncached"
    return DataBundle(
        name="imagefolder",
        task="classify",
        train=CachedImages(tiers, 0, [label for _, label in train], mean, std),
        val=CachedImages(tiers, len(train), [label for _, label in val], mean, std),
        input_shape=shape,
        num_classes=len(classes),
        fingerprint=print_,
        source=f"image folder {url} ({len(classes)} classes, {layout}, {where}); license: that of the images",
    )
