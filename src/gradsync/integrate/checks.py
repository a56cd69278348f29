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


OUTER_NODE = "_gradsync_outer_node"
"""The attribute an outer loop sets on the module it manages: the global ranks of this rank's
node, the only ranks a per-step synchronization of that module may span."""


def check_outer_scope(model: nn.Module, ranks: list[int]) -> None:
    """Refuse a per-step synchronization over global ``ranks`` of a module an outer loop manages
    when they reach beyond this rank's node: the inner steps would then average across nodes
    every step, crossing the slow link the outer loop exists to spare (and no longer be DiLoCo's
    inner steps). Every rank of the synchronization sees the same ranks, so all raise."""
    node = getattr(model, OUTER_NODE, None)
    if node is None:
        return
    outside = sorted(set(ranks) - set(node))
    if outside:
        raise ValueError(
            f"gradsync: this model is under an outer loop whose node is ranks {list(node)}, but the "
            f"synchronization asked for spans ranks {sorted(ranks)} (ranks {outside} are on other "
            "nodes): it would average across nodes every inner step. Synchronize inside the node: "
            "gradsync.wrap(model, ..., process_group=outer.inner_group) or "
            "DDP(model, process_group=outer.inner_group)"
        )
