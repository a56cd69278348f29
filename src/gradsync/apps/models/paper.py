"""The papers' benchmark models at their real sizes, written with torch.nn (nothing downloaded).

The parameter tensors have the shapes, the count and the registration order of the reference
implementations, so that gradient synchronization sees the same tensors, in the same backward
order, as in the papers' runs:

- :func:`resnet50`, :func:`resnet101`: bottleneck ResNets, v1.5 (the stride sits on the 3 x 3
  convolution), module for module as ``torchvision.models.resnet50`` / ``resnet101``:
  25,557,032 and 44,549,160 parameters with 1000 classes.
- :func:`vgg16`: VGG-16 without batch norm, as ``torchvision.models.vgg16``: 138,357,544
  parameters with 1000 classes, 123.6 M of them in the fully-connected classifier.
- :func:`bert_base`: a BERT-base encoder with its masked-LM head (the word embedding tied to the
  output layer), shaped as Hugging Face's ``BertForMaskedLM`` for bert-base-uncased:
  109,514,298 parameters at vocabulary 30522 and 512 positions.

The convolutional models are compute heavy at 224 x 224 on a CPU; the tests build them on the
``meta`` device to count parameters and run them on small inputs only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- ResNet


class Bottleneck(nn.Module):
    """1 x 1 reduce -> 3 x 3 (carrying the stride) -> 1 x 1 expand (x4), plus the shortcut;
    ``downsample`` (1 x 1 conv + BN) when the shape changes. Attribute names as torchvision."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        skip = x if self.downsample is None else self.downsample(x)
        return self.relu(out + skip)


class BottleneckResNet(nn.Module):
    """ImageNet ResNet: 7 x 7 stem with max-pooling, four stages of bottleneck blocks (widths 64,
    128, 256, 512; stride 2 from the second stage on), global average pooling, one linear layer."""

    def __init__(
        self, blocks: tuple[int, int, int, int], num_classes: int = 1000, in_channels: int = 3
    ) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c = 64
        stages: list[nn.Sequential] = []
        for i, (width, n) in enumerate(zip((64, 128, 256, 512), blocks, strict=True)):
            layer = []
            for b in range(n):
                layer.append(Bottleneck(c, width, 2 if (i > 0 and b == 0) else 1))
                c = width * Bottleneck.expansion
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c, num_classes)
        # torchvision's initialization: He (fan-out) for convolutions, BN as identity
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def resnet50(num_classes: int = 1000, in_channels: int = 3) -> BottleneckResNet:
    """ResNet-50 (3, 4, 6, 3 bottleneck blocks): 25,557,032 parameters with 1000 classes."""
    return BottleneckResNet((3, 4, 6, 3), num_classes, in_channels)


def resnet101(num_classes: int = 1000, in_channels: int = 3) -> BottleneckResNet:
    """ResNet-101 (3, 4, 23, 3 bottleneck blocks): 44,549,160 parameters with 1000 classes."""
    return BottleneckResNet((3, 4, 23, 3), num_classes, in_channels)


# --------------------------------------------------------------------------- VGG-16

_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG16(nn.Module):
    """VGG-16 (configuration D, no batch norm): thirteen 3 x 3 convolutions with biases and five
    max-poolings, adaptive average pooling to 7 x 7, then 25088 -> 4096 -> 4096 -> classes with
    ReLU and dropout. ``image_size`` (side or (height, width)) only drops the max-poolings that
    would shrink a side below one pixel; the parameters do not depend on it (the pooling to 7 x 7
    does not), and from 32 x 32 up the module is torchvision's, index for index.
    """

    def __init__(
        self, num_classes: int = 1000, in_channels: int = 3, image_size: int | tuple[int, int] = 224
    ) -> None:
        super().__init__()
        h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
        layers: list[nn.Module] = []
        c = in_channels
        for v in _VGG16:
            if v == "M":
                if min(h, w) >= 2:
                    layers.append(nn.MaxPool2d(2, 2))
                    h, w = h // 2, w // 2
            else:
                assert isinstance(v, int)
                layers += [nn.Conv2d(c, v, 3, padding=1), nn.ReLU(inplace=True)]
                c = v
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(c * 7 * 7, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(0.5),
            nn.Linear(4096, num_classes),
        )  # fmt: skip
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0.0, 0.01)
            if isinstance(m, (nn.Conv2d, nn.Linear)) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def vgg16(
    num_classes: int = 1000, in_channels: int = 3, image_size: int | tuple[int, int] = (224, 224)
) -> VGG16:
    """VGG-16: 138,357,544 parameters with 1000 classes and 3 input channels, at any image size."""
    return VGG16(num_classes, in_channels, image_size)


# --------------------------------------------------------------------------- BERT-base


class _SelfAttention(nn.Module):
    """Multi-head self-attention with BERT's four separate projections (query, key, value,
    output), each a ``dim x dim`` weight with a bias."""

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.query = nn.Linear(dim, dim)
        self.key = nn.Linear(dim, dim)
        self.value = nn.Linear(dim, dim)
        self.output = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        b, t, d = x.shape

        def split(y: torch.Tensor) -> torch.Tensor:  # (B, T, D) -> (B, heads, T, D / heads)
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        att = F.scaled_dot_product_attention(
            split(self.query(x)), split(self.key(x)), split(self.value(x)),
            dropout_p=self.dropout if self.training else 0.0, is_causal=causal,
        )  # fmt: skip
        return self.output(att.transpose(1, 2).reshape(b, t, d))


class _EncoderLayer(nn.Module):
    """Post-LN encoder layer as in BERT: x = LN(x + attn(x)); x = LN(x + ff(x)), GELU inside ff."""

    def __init__(self, dim: int, heads: int, ff: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.attention = _SelfAttention(dim, heads, dropout)
        self.attention_norm = nn.LayerNorm(dim, eps=eps)
        self.intermediate = nn.Linear(dim, ff)
        self.out = nn.Linear(ff, dim)
        self.out_norm = nn.LayerNorm(dim, eps=eps)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, causal: bool) -> torch.Tensor:
        x = self.attention_norm(x + self.drop(self.attention(x, causal)))
        return self.out_norm(x + self.drop(self.out(F.gelu(self.intermediate(x)))))


class _MLMHead(nn.Module):
    """BERT's masked-LM head: dense + GELU + LayerNorm, then the tied vocabulary projection, whose
    weight the caller passes (the word embedding) and whose bias is this module's own."""

    def __init__(self, dim: int, vocab_size: int, eps: float) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        self.transform = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: torch.Tensor, embedding: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(F.gelu(self.transform(x))), embedding, self.bias)


class BertLM(nn.Module):
    """A BERT encoder with the masked-LM head: token ids (B, T) -> logits (B, T, vocab_size).

    Embeddings: word (``vocab_size x dim``), learned position (``seq_len x dim``) and token type
    (``type_vocab x dim``; every token has type 0 here), summed, then LayerNorm and dropout. Then
    ``layers`` post-LN encoder layers. The head is BERT's: dense ``dim x dim`` + GELU + LayerNorm
    (the "transform"), then a projection onto the vocabulary whose weight *is* the word embedding
    (tied: one parameter, counted once) plus its own bias of ``vocab_size``.

    Attention is bidirectional as in BERT; ``causal=True`` masks it so that position t sees tokens
    0..t only, which makes next-token targets a fair loss (the parameters are the same). Inputs may
    be shorter than ``seq_len`` (the number of positions), never longer. No pooler and no
    next-sentence head.
    """

    def __init__(
        self,
        vocab_size: int = 30522,
        seq_len: int = 512,
        dim: int = 768,
        layers: int = 12,
        heads: int = 12,
        ff: int = 3072,
        type_vocab: int = 2,
        dropout: float = 0.1,
        eps: float = 1e-12,
        causal: bool = False,
    ) -> None:
        super().__init__()
        if min(vocab_size, seq_len, dim, layers, heads, ff, type_vocab) < 1:
            raise ValueError("vocab_size, seq_len, dim, layers, heads, ff and type_vocab must all be >= 1")
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.vocab_size, self.seq_len, self.causal = vocab_size, seq_len, causal
        self.word_embeddings = nn.Embedding(vocab_size, dim)
        self.position_embeddings = nn.Embedding(seq_len, dim)
        self.token_type_embeddings = nn.Embedding(type_vocab, dim)
        self.embedding_norm = nn.LayerNorm(dim, eps=eps)
        self.drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(_EncoderLayer(dim, heads, ff, dropout, eps) for _ in range(layers))
        self.head = _MLMHead(dim, vocab_size, eps)
        # BERT's initialization: normal(0, 0.02) weights, zero biases, LayerNorm as identity
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(
                f"expected integer token ids (batch, time), got {tokens.dtype} {tuple(tokens.shape)}"
            )
        t = tokens.shape[1]
        if t > self.seq_len:
            raise ValueError(f"input has {t} tokens but the model was built with seq_len={self.seq_len}")
        pos = torch.arange(t, device=tokens.device)
        token_type = self.token_type_embeddings.weight[0]  # every token is of type 0
        x = self.word_embeddings(tokens) + self.position_embeddings(pos) + token_type
        x = self.drop(self.embedding_norm(x))
        for layer in self.layers:
            x = layer(x, self.causal)
        return self.head(x, self.word_embeddings.weight)


def bert_base(
    vocab_size: int = 30522, seq_len: int = 512, causal: bool = False, dropout: float = 0.1
) -> BertLM:
    """BERT-base with its masked-LM head: 12 layers, hidden 768, 12 heads, FF 3072, GELU, post-LN.

    109,514,298 parameters at the defaults (vocabulary 30522, 512 positions), in 202 tensors: the
    count of Hugging Face's ``BertForMaskedLM`` for bert-base-uncased. bert-base-uncased's usual
    "110 M" is ``BertModel``, 109,482,240: the same encoder and embeddings (108,891,648) plus the
    768 x 768 pooler (590,592) instead of the MLM head (transform 590,592 + LayerNorm 1,536 + output
    bias 30,522). The count moves by 769 per word of ``vocab_size`` and 768 per position.
    """
    return BertLM(vocab_size, seq_len, causal=causal, dropout=dropout)


__all__ = ["VGG16", "BertLM", "Bottleneck", "BottleneckResNet", "bert_base", "resnet50", "resnet101", "vgg16"]
