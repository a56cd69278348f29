"""gradsync's schemes as a PyTorch DDP communication hook.

``state, hook = gradsync.ddp_comm_hook("hitopk:density=0.01", model=model)`` then
``ddp_model.register_comm_hook(state, hook)``. DDP keeps its own buckets (and rebuilds them after
the first iteration); the hook synchronizes each bucket it is handed with the scheme, through the
same step programs and task manager as :func:`gradsync.wrap`, so a bucket's compression and
communication run on gradsync's threads while DDP's backward pass continues, and returns a
Future that DDP waits for.

Compression state is keyed by the bucket's parameters (their names when ``model`` is given, so
that the keys match :func:`gradsync.wrap`'s for the same grouping): identical on every rank and
stable across DDP's bucket rebuild. The first ``dense_warmup_steps`` iterations (at least one,
which covers DDP's rebuild) are dense, and buckets smaller than ``min_compress_bytes`` always
are. What the hook does not do, compared with ``wrap``, is plan: every other bucket is
compressed (``plan="dense"`` turns compression off).
"""

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.codecs import ErrorFeedback
from gradsync.codecs.ops import Workspace
from gradsync.collectives.compressed import compressed_program, is_lowrank
from gradsync.collectives.dense import allreduce_program
from gradsync.collectives.program import Program
from gradsync.collectives.topology import Topology
from gradsync.integrate.agreement import agreed, comm_device
from gradsync.integrate.wrap import build_config, model_fingerprint
from gradsync.sync.config import SyncConfig
from gradsync.sync.scheme import Scheme
from gradsync.sync.tasks import TaskManager


class HookState:
    """What the hook keeps between calls. ``step`` counts DDP iterations (buckets marked last)."""

    def __init__(
        self, config: SyncConfig, topology: Topology, model: nn.Module | None, loss_scale: float = 1.0
    ):
        self.config = config
        self.topo = topology
        self.scheme = Scheme.parse(config.scheme).resolve(topology.nodes, topology.per_node)
        self.codec = self.scheme.build(config.error_feedback)
        self.manager = TaskManager("gradsync-ddp")
        self.step = 0
        self.loss_scale = loss_scale  # set it each step under GradScaler (error feedback's units)
        # parameter names, for state keys that match wrap()'s (internal)
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._workspaces: dict[str, Workspace] = {}

    def key(self, bucket: dist.GradBucket) -> str:
        params = bucket.parameters()
        names = [self._names.get(id(p)) for p in params]
        if params and all(n is not None for n in names):
            return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"
        shapes = ";".join(str(tuple(p.shape)) for p in params)
        return f"ddp-bucket:{hashlib.blake2b(shapes.encode(), digest_size=6).hexdigest()}"

    def compresses(self, buffer: torch.Tensor) -> bool:
        c = self.config
        dense_step = self.step < c.dense_warmup_steps or (
            c.dense_from_step is not None and self.step >= c.dense_from_step
        )
        return (
            self.codec is not None and not dense_step and c.plan != "dense"
            and buffer.numel() * buffer.element_size() >= c.min_compress_bytes
        )  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "codec": None if self.codec is None else self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        if self.codec is not None and state.get("codec") is not None:
            self.codec.load_state_dict(state["codec"])


def _program(state: HookState, bucket: dist.GradBucket, key: str) -> Program:
    buf = bucket.buffer()
    ws = state._workspaces.setdefault(key, Workspace())
    scheme = state.scheme
    if not state.compresses(buf):
        algo = scheme.algorithm if scheme.kind == "dense" else "hybrid"
        comm_dtype = scheme.comm_dtype if scheme.kind == "dense" else None
        return (yield from allreduce_program(buf, state.topo, algo, "mean", comm_dtype, None, ws))
    codec = state.codec
    assert codec is not None
    plain = codec.codec if isinstance(codec, ErrorFeedback) else codec
    parts = None
    if is_lowrank(plain):
        names = [state._names.get(id(p)) for p in bucket.parameters()]
        parts = [
            (g.view(p.shape), n if n is not None else f"{key}/{i}")
            for i, (g, p, n) in enumerate(zip(bucket.gradients(), bucket.parameters(), names, strict=True))
        ]
    return (
        yield from compressed_program(
            buf, state.topo, codec, scheme.strategy or "allgather", bool(scheme.local), "mean", key,
            state.loss_scale, 4, ws, parts,
        )
    )  # fmt: skip


def gradsync_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: synchronize the bucket on gradsync's threads."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    buf = bucket.buffer()
    key = state.key(bucket)
    last = bucket.is_last()

    def done() -> None:
        if last:
            state.step += 1
        fut.set_result(buf)

    state.manager.submit(
        _program(state, bucket, key), f"ddp bucket {bucket.index()}", done, fut.set_exception
    )
    return fut


def ddp_comm_hook(
    scheme: str | SyncConfig = "auto",
    topology: Topology | None = None,
    *,
    model: nn.Module | None = None,
    config: SyncConfig | None = None,
    **options: Any,
) -> tuple[HookState, Any]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    ``scheme`` and ``options`` as for :func:`gradsync.wrap`. Pass the wrapped ``model`` so that
    compression state is keyed by parameter names. Checked to be identical on every rank."""
    topo = topology or Topology()
    fingerprint = model_fingerprint(model) if model is not None else ""
    if topo.world > 1:
        cfg = agreed(
            topo, lambda: build_config(scheme, config, options), lambda c: c.spec(),
            fingerprint, comm_device(),
        )  # fmt: skip
    else:
        cfg = build_config(scheme, config, options)
    return HookState(cfg, topo, model), gradsync_hook
