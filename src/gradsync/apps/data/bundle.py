"""The :class:`DataBundle` every dataset builds, and the small dataset types the builders share.

Items of every dataset are ``(input, target)`` tensor pairs:

* ``classify``: a float32 image ``(C, H, W)`` and an int64 class index (a 0-d tensor);
* ``lm``: int64 token ids ``(seq_len,)`` and the same window shifted by one token.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils.data import Dataset


class MapDataset(Protocol):
    """A map-style dataset as gradsync uses one: a length and ``(input, target)`` items by index
    (every dataset here; ``torch.utils.data.Dataset`` itself promises no ``len``)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class DataBundle:
    """A train/validation pair of map-style datasets and what a training run needs to know about them."""

    name: str
    task: str  # "classify" or "lm"
    train: MapDataset
    val: MapDataset
    input_shape: tuple[int, ...]  # classify: (C, H, W) of one image; lm: (seq_len,)
    num_classes: int  # classify: number of classes; lm: vocabulary size
    fingerprint: str  # short hex hash of the data and its transform (stored in checkpoints)
    source: str  # one line: where the data comes from and under which license


def fingerprint(*parts: Any) -> str:
    """16 hex digits identifying ``parts`` (bytes, arrays and anything with a stable ``repr``)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        if isinstance(part, np.ndarray):
            h.update(f"ndarray{part.dtype.str}{part.shape}".encode())
            h.update(np.ascontiguousarray(part).tobytes())
        elif isinstance(part, (bytes, bytearray, memoryview)):
            h.update(b"bytes%d:" % len(part))
            h.update(part)
        else:
            h.update(repr(part).encode())
        h.update(b"\x00")
    return h.hexdigest()


class TensorPairs(Dataset):
    """Inputs and targets held in two tensors with the same first dimension."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        if inputs.shape[0] != targets.shape[0]:
            raise ValueError(f"inputs have {inputs.shape[0]} rows but targets have {targets.shape[0]}")
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


class TokenWindows(Dataset):
    """Non-overlapping language-model windows over ``tokens[start:stop]`` (a 1-D integer array).

    Window ``i`` starts at ``start + i * seq_len``; its input is ``seq_len`` tokens from there and its
    target the ``seq_len`` tokens one position later, so the last window needs one token after it.
    The array may be a numpy memmap: only the requested window is read.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, start: int = 0, stop: int | None = None) -> None:
        stop = len(tokens) if stop is None else stop
        if not 0 <= start <= stop <= len(tokens):
            raise ValueError(f"bad token range [{start}, {stop}) for {len(tokens)} tokens")
        self.tokens = tokens
        self.seq_len = seq_len
        self.start = start
        self.stop = stop
        self.count = max(0, (stop - start - 1) // seq_len)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            index += self.count
        if not 0 <= index < self.count:
            raise IndexError(f"window {index} out of range for {self.count} windows")
        base = self.start + index * self.seq_len
        chunk = torch.from_numpy(np.array(self.tokens[base : base + self.seq_len + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]


def lm_bundle(
    name: str,
    tokens: np.ndarray,
    *,
    vocab: int,
    seq_len: int,
    fingerprint: str,
    source: str,
    val_fraction: float = 0.1,
) -> DataBundle:
    """Split a token stream: the last ``val_fraction`` is validation, the rest training windows."""
    split = int(len(tokens) * (1.0 - val_fraction))
    train = TokenWindows(tokens, seq_len, 0, split)
    val = TokenWindows(tokens, seq_len, split, len(tokens))
    if len(train) == 0 or len(val) == 0:
        need = int(np.ceil((seq_len + 1) / val_fraction))
        raise ValueError(
            f"--data {name}: {len(tokens)} tokens are too few for seq_len={seq_len} "
            f"(need at least {need} so that the last {val_fraction:.0%} holds one window)"
        )
    return DataBundle(
        name=name,
        task="lm",
        train=train,
        val=val,
        input_shape=(seq_len,),
        num_classes=vocab,
        fingerprint=fingerprint,
        source=source,
    )


def stratified_split(
    labels: torch.Tensor, val_fraction: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices ``(train, val)`` of a seeded split that keeps the class proportions.

    The validation set gets ``round(len(labels) * val_fraction)`` samples (at least one when there
    are two or more), shared out over the classes in proportion to their sizes, the remainder going
    to the classes with the largest fractional shares; every class keeps at least one training
    sample. Within a class the chosen samples come from a seeded shuffle. Both results are sorted.
    """
    g = torch.Generator().manual_seed(seed)
    classes = torch.unique(labels, sorted=True).tolist()
    members = [torch.nonzero(labels == c, as_tuple=True)[0] for c in classes]
    sizes = [len(m) for m in members]
    total = math.floor(len(labels) * val_fraction + 0.5)
    if len(labels) >= 2:
        total = max(total, 1)
    quotas = [n * val_fraction for n in sizes]
    counts = [min(int(q), n - 1) for q, n in zip(quotas, sizes, strict=True)]
    by_remainder = sorted(range(len(sizes)), key=lambda i: (-(quotas[i] - int(quotas[i])), -sizes[i], i))
    while sum(counts) < total:
        grown = False
        for i in by_remainder:
            if sum(counts) < total and counts[i] < sizes[i] - 1:
                counts[i] += 1
                grown = True
        if not grown:
            break
    train: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)]
    val: list[torch.Tensor] = [torch.empty(0, dtype=torch.long)]
    for idx, n_val in zip(members, counts, strict=True):
        idx = idx[torch.randperm(len(idx), generator=g)]
        val.append(idx[:n_val])
        train.append(idx[n_val:])
    return torch.sort(torch.cat(train)).values, torch.sort(torch.cat(val)).values
