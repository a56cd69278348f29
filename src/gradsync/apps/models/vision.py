"""Image classifiers written with torch.nn, sized for CPU runs: the papers' CNN families.

- :class:`VGG`: VGG-style conv stacks and a large fully-connected head. Almost all parameters sit
  in the head (21.0 M of 21.4 M at the defaults for 32 x 32 inputs), so its gradient is large
  next to its compute: the communication-heavy case.
- :class:`ResNet`: a small pre-activation-free ResNet (basic blocks, batch norm): few parameters
  for its compute, the compute-heavy case.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn(cin: int, cout: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class VGG(nn.Module):
    """conv-bn-relu blocks with max-pooling, then ``fc`` -> ``fc`` -> classes."""

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: int | tuple[int, int] = 32,
        widths: tuple[int, ...] = (32, 64, 128, 256),
        fc: int = 4096,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        # ``image_size`` is the side of a square image or (height, width). Each block halves both
        # sides (rounding down, as MaxPool2d does) until one side is down to 1 pixel, so small
        # inputs such as the 8 x 8 digits simply get fewer pooling steps.
        h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
        c = in_channels
        for width in widths:
            layers += _conv_bn(c, width)
            if min(h, w) >= 2:
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            c = width
        self.features = nn.Sequential(*layers)
        flat = c * h * w
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(flat, fc), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(fc, fc), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(fc, num_classes),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            *_conv_bn(cin, cout, stride), nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        )
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.skip = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: a stem, three stages of basic blocks, global pooling, one linear."""

    def __init__(
        self,
        num_classes: int = 10,
        in_channels: int = 3,
        widths: tuple[int, ...] = (16, 32, 64),
        blocks: int = 2,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(in_channels, widths[0]))
        stages: list[nn.Module] = []
        c = widths[0]
        for i, w in enumerate(widths):
            for b in range(blocks):
                stages.append(BasicBlock(c, w, 2 if (i > 0 and b == 0) else 1))
                c = w
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))
