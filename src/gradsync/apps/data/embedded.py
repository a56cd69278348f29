"""Real datasets that are already on every machine: nothing is downloaded.

* ``digits``: the 8x8 handwritten digits bundled with scikit-learn (1797 images, 10 classes).
* ``text``: the English text of the Python documentation topics shipped in CPython's ``pydoc_data``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import torch

from gradsync.apps.data.bundle import DataBundle, TensorPairs, fingerprint, lm_bundle, stratified_split

DIGITS_VAL_FRACTION = 0.2


def load_digits_bundle(seed: int) -> DataBundle:
    """Digits as float32 ``(1, 8, 8)`` images, standardized with the training split's mean and std.

    Pixels (0..16) are divided by 16, then shifted and scaled by one mean and one std taken over
    every pixel of the training images. The split is stratified by class and seeded (about 80/20).
    """
    raw_images, raw_target = _digits_arrays()
    images = np.asarray(raw_images, dtype=np.float32) / 16.0  # (1797, 8, 8)
    labels = torch.as_tensor(np.asarray(raw_target), dtype=torch.int64)
    train_idx, val_idx = stratified_split(labels, DIGITS_VAL_FRACTION, seed)
    pixels = torch.from_numpy(images).unsqueeze(1)  # (N, 1, 8, 8)
    mean = pixels[train_idx].mean()
    std = pixels[train_idx].std()
    pixels = ((pixels - mean) / std).contiguous()
    return DataBundle(
        name="digits",
        task="classify",
        train=TensorPairs(pixels[train_idx], labels[train_idx]),
        val=TensorPairs(pixels[val_idx], labels[val_idx]),
        input_shape=(1, 8, 8),
        num_classes=10,
        fingerprint=fingerprint("digits", images, np.asarray(raw_target), "split", DIGITS_VAL_FRACTION, seed),
        source=(
            "scikit-learn load_digits (UCI Optical Recognition of Handwritten Digits, 1797 8x8 images); "
            "BSD-3-Clause as shipped by scikit-learn"
        ),
    )


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits, ``(images (N, 8, 8), target (N,))``, as ``load_digits``
    gives them: read straight from its CSV file (importing ``sklearn`` takes seconds, in every
    worker), else through ``load_digits``."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            data = np.loadtxt(path, delimiter=",")  # what load_digits reads
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)
    from sklearn.datasets import load_digits

    raw = load_digits()
    return raw.images, raw.target


def pydoc_text() -> str:
    """The Python documentation topics as one string, values joined in sorted-key order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as exc:
        raise ValueError(
            "--data text needs the Python documentation topics (module pydoc_data.topics), which this "
            f"Python installation does not have ({exc}); use --data tokens:PATH with a text file instead"
        ) from None
    return "".join(topics[key] for key in sorted(topics))


def load_text_bundle(seq_len: int) -> DataBundle:
    """Byte-level language modelling on the pydoc topics: vocabulary 256 (UTF-8 bytes)."""
    data = pydoc_text().encode("utf-8")
    tokens = np.frombuffer(data, dtype=np.uint8)
    version = ".".join(map(str, sys.version_info[:2]))
    return lm_bundle(
        "text",
        tokens,
        vocab=256,
        seq_len=seq_len,
        fingerprint=fingerprint("text", data, "bytes", seq_len),
        source=f"Python {version} documentation topics (pydoc_data.topics), PSF License; UTF-8 bytes",
    )
