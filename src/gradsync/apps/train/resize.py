"""Progressive resizing (the MSTopK paper's DAWNbench recipe: low resolution in the first epochs,
full resolution at the end): ``--resize-schedule EPOCH:SIZE,...`` gives the input resolution from
each epoch on.

Images are produced at the dataset's own size and resized per batch on the device (bilinear,
antialiased when shrinking), so any image data works and the data pipeline is unchanged. The
resolution is a function of the epoch alone, so a resumed run trains each epoch at the size the
uninterrupted run did. Validation uses the epoch's training size. The model must accept every
size in the schedule (a convolutional network with global pooling, e.g. ``resnet``); one that
does not is refused before any process starts.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

MIN_SIZE = 4


def parse_resize_schedule(text: str, native: int | None = None) -> list[tuple[int, int]]:
    """``"0:16,4:24,8:32"`` as ``[(0, 16), (4, 24), (8, 32)]``: starting at epoch 0, epochs
    increasing, sizes of at least :data:`MIN_SIZE` and (given ``native``) at most the data's."""
    stages: list[tuple[int, int]] = []
    try:
        for part in text.split(","):
            epoch, size = part.split(":")
            stages.append((int(epoch), int(size)))
    except ValueError:
        stages = []
    ok = bool(stages) and stages[0][0] == 0
    ok = ok and all(a[0] < b[0] for a, b in itertools.pairwise(stages))
    ok = ok and all(s >= MIN_SIZE for _, s in stages)
    if not ok:
        raise ValueError(
            "--resize-schedule takes EPOCH:SIZE pairs separated by commas, the first at epoch 0, "
            f"epochs increasing, sizes >= {MIN_SIZE} (e.g. 0:16,4:24,8:32), got {text!r}"
        )
    if native is not None and any(s > native for _, s in stages):
        raise ValueError(
            f"--resize-schedule {text!r} asks for more than the data's own {native} x {native} pixels; "
            "raise the data's size (e.g. synthetic-images:size=64) instead"
        )
    return stages


def size_at(stages: list[tuple[int, int]], epoch: int) -> int:
    """The resolution of ``epoch`` (0-based)."""
    return [s for e, s in stages if e <= epoch][-1]


def resize(x: torch.Tensor, size: int) -> torch.Tensor:
    """A batch ``(N, C, H, W)`` at ``size x size`` (unchanged when it already is)."""
    if x.shape[-2:] == (size, size):
        return x
    shrink = size < x.shape[-1]
    return F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=shrink)


def check_model_takes(model: nn.Module, input_shape: tuple[int, ...], stages: list[tuple[int, int]]) -> None:
    """Refuse a model that cannot take every size of the schedule (a forward pass on the meta
    device: no memory, no compute)."""
    channels = input_shape[0]
    for _, size in stages:
        try:
            model.to("meta")(torch.zeros(2, channels, size, size, device="meta"))
        except (RuntimeError, ValueError) as e:
            reason = str(e).splitlines()[0]
            raise ValueError(
                f"--resize-schedule: the model cannot take {size} x {size} inputs ({reason}); "
                "use a model with global pooling, such as resnet"
            ) from None
