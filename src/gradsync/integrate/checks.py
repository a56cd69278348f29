"""What gradsync refuses up front, on every rank, before any collective: models it cannot
synchronize correctly. Each refusal names the module and says what to do instead."""

from __future__ import annotations

from torch import nn


def check_model(model: nn.Module | None) -> None:
    """Raise ``ValueError`` for a model gradsync cannot synchronize.

    Sparse embeddings (``nn.Embedding(..., sparse=True)``, ``nn.EmbeddingBag(..., sparse=True)``)
    produce sparse gradient tensors; gradsync's buckets, codecs and error feedback work on dense
    tensors, and packing a sparse gradient would fail deep inside the first backward pass."""
    if model is None:
        return
    if not isinstance(model, nn.Module):
        raise TypeError(f"gradsync: expected a torch.nn.Module, got {type(model).__name__}")
    sparse = [
        f"{name or '(the model)'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    ]
    if sparse:
        raise ValueError(
            "gradsync: sparse gradients are not supported, but "
            + ", ".join(sparse)
            + " use sparse=True; construct them with sparse=False (dense gradients, which gradsync "
            "can compress; with a top-k codec only the rows that change are sent anyway)"
        )
