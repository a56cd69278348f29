"""One bucket's synchronization, as :func:`gradsync.wrap`'s engine and the DDP comm hook both run
it (once the :class:`~gradsync.sync.ledger.Ledger` put what is owed into the flat gradient and
its inf/NaN flag is noted): the scheme's dense all-reduce or compressed collective, as a step
program on the task manager's threads.

The two callers differ in who forms the buckets (the engine's plan, or DDP) and in what they do
around a bucket (packing and clipping in the engine; DDP packs its own buffer), not in how a
bucket is synchronized: that is this module, once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from gradsync.codecs import Compressor
from gradsync.codecs.ops import Workspace
from gradsync.collectives.compressed import compressed_program
from gradsync.collectives.dense import allreduce_program
from gradsync.collectives.program import Program
from gradsync.collectives.topology import Topology
from gradsync.sync.buckets import Bucket
from gradsync.sync.momentum import SyncMomentum
from gradsync.sync.scheme import Scheme

PIPELINE = 4
"""Chunks a large hierarchical top-k bucket is cut into, so that the inter-node all-gather of
one chunk overlaps the selection of the next (:mod:`gradsync.collectives.hitopk_pipeline`)."""


def nonfinite_flag(flat: torch.Tensor) -> torch.Tensor:
    """A 0-d bool on ``flat``'s device: whether it holds inf or NaN. It stays there until the
    step's flag all-reduce reads all of them at once (no host synchronization per bucket)."""
    return torch.isfinite(flat).all().logical_not()


def bucket_program(
    view: torch.Tensor,
    topo: Topology,
    scheme: Scheme,
    codec: Compressor | None,
    key: str,
    loss_scale: float,
    workspace: Workspace,
    dense_algorithm: str = "hybrid",
    lowrank_parts: list[tuple[torch.Tensor, str]] | None = None,
    offset: int = 0,
    resident: bool | None = None,
    rehearse: bool = False,
) -> Program:
    """The step program that synchronizes ``view`` (a bucket, or one part of it) to the mean
    over the ranks. ``codec`` None: dense, with the dense scheme's own algorithm and wire dtype,
    or ``dense_algorithm`` for a compressed scheme's dense bucket. Otherwise compressed under
    ``scheme`` with error-feedback state keyed by ``key`` (``offset``: where ``view`` starts in
    the bucket; ``lowrank_parts``: a low-rank codec's tensors in it, with their own keys).
    ``resident``: a dense scheme's 16-bit wire keeps its scale on the device (None: on a GPU).
    ``rehearse``: in a world of one, run it all the same (:attr:`gradsync.sync.SyncConfig.rehearse`)."""
    if codec is None:
        if scheme.kind == "dense":
            algo, comm_dtype = scheme.algorithm, scheme.comm_dtype
        else:
            algo, comm_dtype = dense_algorithm, None
        return (
            yield from allreduce_program(
                view, topo, algo, "mean", comm_dtype, None, workspace, resident, rehearse
            )
        )
    return (
        yield from compressed_program(
            view, topo, codec, scheme.strategy or "allgather", bool(scheme.local), "mean", key, loss_scale,
            PIPELINE, workspace, lowrank_parts, offset, rehearse,
        )
    )  # fmt: skip


def unpacker(
    bucket: Bucket, compressed: bool, shadow: bool, momentum: SyncMomentum | None, scale: float
) -> Callable[[], None]:
    """What runs after each part of one of the engine's buckets (on the compute thread): once
    every part is done, momentum correction's dense side, then the synchronized values go back
    into the gradients (not on a ``shadow`` rank, one that joined without data)."""

    def done() -> None:
        bucket.parts_left -= 1
        if bucket.parts_left:
            return
        # a joined rank's too (the momentum stays the same everywhere); a compressed bucket
        # only while earlier dense steps' momentum is still being released
        if momentum is not None and (not compressed or momentum.velocity):
            names = [s.name for s in bucket.slots]
            views = [bucket.view(j) for j in range(len(bucket.slots))]
            (momentum.release if compressed else momentum.dense)(names, views, scale)
        if not shadow:
            bucket.unpack()

    return done
