"""Images on disk in the usual one-folder-per-class layout, read with Pillow.

Layout: ``ROOT/<class name>/.../<image>``; classes are the sub-folder names sorted, numbered from 0.
Files with the extensions in :data:`IMAGE_EXTENSIONS` (any case) are images, searched recursively;
hidden files and other extensions are skipped. If ``ROOT/train`` exists it holds the training
classes and ``ROOT/val`` (optional) the validation images of those same classes; otherwise a seeded,
per-class 90/10 split of ``ROOT`` is used.

Each image is decoded when it is asked for (the index is built once), converted to RGB, or to
greyscale ``L`` when ``channels=1`` (``channels=auto``, the default, picks ``L`` only if every image
of the statistics sample below is greyscale), resized to ``size x size`` with bilinear filtering
(aspect ratio not kept), scaled to [0, 1], then standardized per channel with a mean and std
measured on up to :data:`STATS_SAMPLE` training images chosen by the seed.
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.utils.data import Dataset

from gradsync.apps.data.bundle import DataBundle, fingerprint, stratified_split

if TYPE_CHECKING:
    from PIL import Image

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".webp")
GREY_MODES = frozenset({"1", "L", "LA", "I", "I;16", "F"})
STATS_SAMPLE = 256
VAL_FRACTION = 0.1


@dataclass(frozen=True)
class ImageFile:
    path: Path
    label: int


ImageSource = Path | bytes
"""An image file: its path, or its bytes (fetched from central storage)."""


def open_image(source: ImageSource, name: object = None) -> Image.Image:
    """Open an image file or its bytes with Pillow (header only); any failure becomes a ValueError
    naming the file (``name``, else the path)."""
    from PIL import Image

    try:
        return Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
    except Exception as exc:
        raise ValueError(f"cannot read image {name or source}: {exc}") from exc


def decode_image(source: ImageSource, size: int, mode: str, name: object = None) -> np.ndarray:
    """Pixels of an image file (or its bytes) as uint8 ``(H, W, C)``, converted to ``mode`` and
    resized to ``size x size``."""
    from PIL import Image

    path = name or source
    try:
        with open_image(source, name) as img:
            img = img.convert(mode)
            if img.size != (size, size):
                img = img.resize((size, size), Image.Resampling.BILINEAR)
            pixels = np.array(img, dtype=np.uint8)  # a writable copy
    except ValueError:
        raise
    except Exception as exc:
        raise ValueError(f"cannot read image {path}: {exc}") from exc
    return pixels.reshape(size, size, -1)


class ImageFolderDataset(Dataset):
    """Decodes, resizes and standardizes one image per ``__getitem__``."""

    def __init__(
        self, files: list[ImageFile], size: int, mode: str, mean: torch.Tensor, std: torch.Tensor
    ) -> None:
        self.files = files
        self.size = size
        self.mode = mode
        self.mean = mean  # (C,) in [0, 1] units
        self.std = std  # (C,)

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        item = self.files[index]
        pixels = torch.from_numpy(decode_image(item.path, self.size, self.mode))
        image = pixels.permute(2, 0, 1).to(torch.float32).div_(255.0)
        image = (image - self.mean[:, None, None]) / self.std[:, None, None]
        return image, torch.tensor(item.label, dtype=torch.int64)


def _is_image(name: str) -> bool:
    return not name.startswith(".") and name.lower().endswith(IMAGE_EXTENSIONS)


def class_dirs(root: Path) -> list[str]:
    """Sorted names of the non-hidden sub-folders of ``root``."""
    if not root.exists():
        raise ValueError(f"--data imagefolder: directory {root} does not exist")
    if not root.is_dir():
        raise ValueError(f"--data imagefolder: {root} is not a directory")
    names = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
    if not names:
        raise ValueError(
            f"--data imagefolder: {root} has no class sub-folders (expected {root}/<class name>/<images>)"
        )
    return names


def scan_images(root: Path, classes: list[str]) -> list[ImageFile]:
    """Every image under ``root/<class>`` for the given classes, in a fixed order."""
    files: list[ImageFile] = []
    for label, name in enumerate(classes):
        folder = root / name
        if not folder.is_dir():
            continue
        found: list[Path] = []
        for dirpath, dirnames, filenames in os.walk(folder, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            found.extend(Path(dirpath) / f for f in sorted(filenames) if _is_image(f))
        if not found:
            raise ValueError(
                f"--data imagefolder: class folder {folder} has no images "
                f"(looked for {', '.join(IMAGE_EXTENSIONS)})"
            )
        files.extend(ImageFile(p, label) for p in found)
    return files


def _check_val_classes(val_root: Path, classes: list[str]) -> None:
    extra = sorted(set(class_dirs(val_root)) - set(classes))
    if extra:
        raise ValueError(
            f"--data imagefolder: {val_root} has classes that the training folder lacks: {', '.join(extra)}"
        )


def statistics_sample(n_train: int, seed: int) -> list[int]:
    """The training images (indices, sorted) whose pixels give the colour mode and statistics."""
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(n_train, generator=g)[:STATS_SAMPLE].tolist())


def image_statistics(
    sample: Sequence[ImageSource], size: int, channels: int | None
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """Colour mode and per-channel mean/std of [0, 1] pixels of the sample's images."""
    if channels is None:
        modes = []
        for source in sample:
            with open_image(source) as img:
                modes.append(img.mode)
        channels = 1 if all(m in GREY_MODES for m in modes) else 3
    mode = "L" if channels == 1 else "RGB"
    total = torch.zeros(channels, dtype=torch.float64)
    total_sq = torch.zeros(channels, dtype=torch.float64)
    count = 0
    for source in sample:
        px = (
            torch.from_numpy(decode_image(source, size, mode)).reshape(-1, channels).to(torch.float64) / 255.0
        )
        total += px.sum(0)
        total_sq += (px * px).sum(0)
        count += px.shape[0]
    mean = total / count
    var = (total_sq / count - mean * mean).clamp_min(0.0)
    std = var.sqrt()
    std = torch.where(std < 1e-3, torch.ones_like(std), std)  # flat channels: only shift them
    return mode, mean.to(torch.float32), std.to(torch.float32)


def load_imagefolder_bundle(path: str, *, size: int, channels: int | None, seed: int) -> DataBundle:
    """Index the folder, split it, measure the statistics; images are decoded later, per item."""
    root = Path(path).expanduser()
    train_root = root / "train"
    if root.is_dir() and train_root.is_dir():
        classes = class_dirs(train_root)
        train_files = scan_images(train_root, classes)
        val_root = root / "val"
        if val_root.is_dir():
            _check_val_classes(val_root, classes)
            val_files = scan_images(val_root, classes)
            layout = "train/val folders"
        else:
            train_files, val_files = _split(train_files, seed)
            layout = "seeded 90/10 split of train/"
    else:
        classes = class_dirs(root)
        train_files, val_files = _split(scan_images(root, classes), seed)
        layout = "seeded 90/10 split"
    if not val_files:
        raise ValueError(f"--data imagefolder: {root} has too few images to hold out any for validation")
    sample = [train_files[i].path for i in statistics_sample(len(train_files), seed)]
    mode, mean, std = image_statistics(sample, size, channels)
    listing = [
        (str(f.path.relative_to(root)), f.label, f.path.stat().st_size) for f in train_files + val_files
    ]
    return DataBundle(
        name="imagefolder",
        task="classify",
        train=ImageFolderDataset(train_files, size, mode, mean, std),
        val=ImageFolderDataset(val_files, size, mode, mean, std),
        input_shape=(len(mode), size, size),
        num_classes=len(classes),
        fingerprint=fingerprint("imagefolder", classes, listing, size, mode, seed),
        source=f"image folder {root} ({len(classes)} classes, {layout}); license: that of the images",
    )


def _split(files: list[ImageFile], seed: int) -> tuple[list[ImageFile], list[ImageFile]]:
    labels = torch.tensor([f.label for f in files], dtype=torch.int64)
    train_idx, val_idx = stratified_split(labels, VAL_FRACTION, seed)
    return [files[i] for i in train_idx.tolist()], [files[i] for i in val_idx.tolist()]
