"""Generated datasets for speed runs: no files, fixed by the seed, and learnable.

``synthetic-images``: every class owns a random low-resolution pattern (8x8 at most, upsampled
bilinearly to the image size); an image is its class pattern plus normal noise of standard
deviation ``noise`` (1 by default; larger values make the classes overlap, so that accuracy takes
longer to reach and stays below 100 %). Images are
made on demand from ``(seed, index)`` with their own ``torch.Generator``, so memory stays small
whatever ``n`` and ``size`` are, and every rank sees the same image for the same index.

``synthetic-text``: a token stream from a random first-order Markov chain. Each token has a few
successors (drawn once from the seed) and the next token picks among them with fixed, unequal
probabilities, so the stream has far less entropy than uniform tokens and a model can learn it.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from gradsync.apps.data.bundle import DataBundle, fingerprint, lm_bundle

GENERATOR_VERSION = 1  # bump when the generated data changes, so fingerprints change too
PATTERN_RES = 8
NOISE_STD = 1.0
MARKOV_SUCCESSORS = 8
_MASK64 = (1 << 64) - 1
_CACHE_BYTES = 64 << 20


def mix_seed(*values: int) -> int:
    """A well-spread 63-bit seed from integers (splitmix64 steps), for per-item generators."""
    state = 0x9E3779B97F4A7C15
    for v in values:
        state = (state ^ (v & _MASK64)) & _MASK64
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        state = z ^ (z >> 31)
    return state >> 1


class SyntheticImages(Dataset):
    """Images ``index`` in ``[offset, offset + length)`` of the seeded stream: class pattern + noise."""

    def __init__(
        self,
        patterns: torch.Tensor,
        labels: torch.Tensor,
        size: int,
        seed: int,
        offset: int,
        noise: float = NOISE_STD,
    ) -> None:
        self.patterns = patterns  # (classes, C, r, r)
        self.labels = labels  # (length,) int64
        self.size = size
        self.seed = seed
        self.offset = offset
        self.noise = noise
        classes, channels = patterns.shape[:2]
        self._means: torch.Tensor | None = None
        if classes * channels * size * size * 4 <= _CACHE_BYTES:
            self._means = self._upsample(patterns)

    def _upsample(self, patterns: torch.Tensor) -> torch.Tensor:
        return F.interpolate(patterns, size=(self.size, self.size), mode="bilinear", align_corners=False)

    def class_mean(self, label: int) -> torch.Tensor:
        """The noise-free image of class ``label``."""
        if self._means is not None:
            return self._means[label]
        return self._upsample(self.patterns[label : label + 1])[0]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if index < 0:
            index += len(self.labels)
        if not 0 <= index < len(self.labels):
            raise IndexError(f"image {index} out of range for {len(self.labels)} images")
        label = self.labels[index]
        g = torch.Generator().manual_seed(mix_seed(self.seed, self.offset + index))
        channels = self.patterns.shape[1]
        noise = torch.randn((channels, self.size, self.size), generator=g) * self.noise
        return self.class_mean(int(label)) + noise, label


def synthetic_images_bundle(
    *, n: int, size: int, channels: int, classes: int, seed: int, noise: float = NOISE_STD
) -> DataBundle:
    """``n`` images in all; the last 10% of the indices (at least one) are validation."""
    g = torch.Generator().manual_seed(mix_seed(seed, 1))
    res = min(size, PATTERN_RES)
    patterns = torch.randn((classes, channels, res, res), generator=g)
    labels = torch.randperm(n, generator=g) % classes  # balanced classes in random order
    n_val = max(1, n // 10)
    n_train = n - n_val
    options: dict[str, float] = {"n": n, "size": size, "channels": channels, "classes": classes}
    if noise != NOISE_STD:  # absent at the default, so that earlier fingerprints still match
        options["noise"] = noise
    return DataBundle(
        name="synthetic-images",
        task="classify",
        train=SyntheticImages(patterns, labels[:n_train], size, seed, 0, noise),
        val=SyntheticImages(patterns, labels[n_train:], size, seed, n_train, noise),
        input_shape=(channels, size, size),
        num_classes=classes,
        fingerprint=fingerprint("synthetic-images", GENERATOR_VERSION, sorted(options.items()), seed),
        source=(
            f"synthetic images generated from seed {seed} (class patterns plus noise of std {noise}); "
            "no external data"
        ),
    )


def markov_tokens(n: int, vocab: int, seed: int) -> np.ndarray:
    """``n`` tokens (uint16 or uint8) of a seeded random Markov chain over ``vocab`` symbols."""
    g = torch.Generator().manual_seed(mix_seed(seed, 2))
    k = min(vocab, MARKOV_SUCCESSORS)
    successors = torch.randint(vocab, (vocab, k), generator=g).tolist()
    weights = 0.5 ** torch.arange(k, dtype=torch.float64)  # successor j is chosen with prob ~ 2^-j
    choices = torch.multinomial(weights, n, replacement=True, generator=g).tolist()
    token = int(torch.randint(vocab, (1,), generator=g))
    out = [0] * n
    for i, choice in enumerate(choices):
        out[i] = token
        token = successors[token][choice]
    return np.asarray(out, dtype=np.uint8 if vocab <= 256 else np.uint16)


def synthetic_text_bundle(*, n: int, vocab: int, seq_len: int, seed: int) -> DataBundle:
    """A stream of ``n`` Markov-chain tokens; the last 10% is validation."""
    tokens = markov_tokens(n, vocab, seed)
    return lm_bundle(
        "synthetic-text",
        tokens,
        vocab=vocab,
        seq_len=seq_len,
        fingerprint=fingerprint("synthetic-text", GENERATOR_VERSION, n, vocab, seed, seq_len),
        source=f"synthetic Markov-chain tokens generated from seed {seed}; no external data",
    )
