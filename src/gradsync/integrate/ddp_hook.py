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

The hook may be made before ``init_process_group`` (Lightning's ``DDPStrategy`` takes it as an
argument before it starts the process group): it then binds to the process group at its first
call, with the same start-up agreement ``wrap`` has. Its collectives run on gradsync's own
process groups (see :class:`~gradsync.collectives.Topology`), so they never pair with DDP's
(the unused-parameter bitmap of ``find_unused_parameters``, buffer broadcasts) or the user's.
Each iteration starts with the step check of :mod:`gradsync.sync.sequence`: every rank must be
at the same iteration (a rank resumed from another checkpoint is refused on every rank). With
``model`` given, forward passes are counted too; ranks whose counts differ (a look at the
predictions on one rank) train on, as DDP does, with one warning. Under ``Join`` DDP runs the
hook on zero buckets for a rank out of data; the hook recognizes them (they run outside any
backward pass).

What error feedback owes is never lost (:mod:`gradsync.sync.carry`), as with ``wrap``:

- ``grad_scaler=``: the hook reads the loss scale once per iteration (error feedback keeps its
  residuals unscaled) and checks every bucket for inf/NaN; one tiny all-reduce after the last
  bucket agrees on it, and if any rank overflowed, every rank's buckets become NaN (its
  GradScaler skips the step) and every rank undoes what the iteration did to its residuals.
  DDP receives the iteration's buckets once that is settled.
- ``find_unused_parameters`` (read from the DDP model by :func:`register_comm_hook`): the same
  all-reduce carries which parameters got a gradient; DDP leaves a parameter that no rank used
  untouched, so what error feedback sent of it goes back into its residual.
- A stream whose bucket DDP no longer forms (a rebuild), and every stream at the start of a
  dense iteration (``dense_from_step``, and the first iteration after :meth:`HookState.load_state_dict`,
  which runs dense so that DDP's first-iteration bucket rebuild happens on dense buckets), ends;
  what it owed is added to its parameters' gradients in the next iteration.

State is kept per parameter, never per bucket shape. Parameters take their names from ``model``
when it is given; a hook made without it (as PyTorch's docs make hooks) names each parameter by
where DDP's bucket held it when the hook first saw it. Those names agree across ranks and
survive DDP's bucket rebuild; across a checkpoint they hold when the new DDP model forms its
first buckets as the old one did (the same model and ``bucket_cap_mb``), and a checkpoint whose
owed gradient does not fit a parameter is refused. Pass ``model`` to key state by the model's
own names.
"""

import dataclasses
import logging
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from gradsync.codecs.ops import Workspace
from gradsync.collectives.compressed import codec_refusal
from gradsync.collectives.program import Program
from gradsync.collectives.topology import Topology, TopologyError
from gradsync.integrate.agreement import agreed
from gradsync.integrate.checks import check_model
from gradsync.integrate.hook_books import HookBooks, Iteration
from gradsync.integrate.wrap import build_config
from gradsync.sync import host_reads
from gradsync.sync.bucket_sync import bucket_program
from gradsync.sync.checkpoint import front_state, must_reset
from gradsync.sync.codec_set import CodecSet, scheme_codecs
from gradsync.sync.config import SyncConfig
from gradsync.sync.density_schedule import apply_schedule
from gradsync.sync.ledger import Ledger
from gradsync.sync.momentum import sync_momentum
from gradsync.sync.scheme import Scheme
from gradsync.sync.sequence import EngineWords, sequence_program, warn_forwards_apart
from gradsync.sync.tasks import TaskManager

log = logging.getLogger("gradsync")

STATE_FORMAT = "gradsync.ddp_hook/2"
_OLDER_FORMAT = "gradsync.ddp_hook/1"  # one "codec" instead of the ledger's "codecs"


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (DDP's Join runs
    the hook outside one, on zero buckets, for a rank that has no data left)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current is None or current() != -1


class HookState:
    """What the hook keeps between calls. ``step`` counts DDP iterations (buckets marked last)."""

    def __init__(
        self,
        config: SyncConfig,
        topology: Topology | None,
        model: nn.Module | None,
        loss_scale: float = 1.0,
        grad_scaler: Any | None = None,
    ) -> None:
        if config.find_unused_parameters and model is None:
            raise ValueError(
                "find_unused_parameters: the DDP hook needs model= (the DDP model's module) to tell "
                "which parameters got a gradient; gradsync.register_comm_hook passes it"
            )
        self.config = config
        self.model = model
        self.grad_scaler = grad_scaler
        self.iteration: Iteration | None = None
        self._dense_next = False  # the first iteration after load_state_dict is dense
        self.codec_set = CodecSet(config, Scheme.parse(config.scheme))
        """The hook's codecs, built as wrap's engine builds them: one, or none for a dense scheme
        (``hook_config`` refuses candidates and a codec for large tensors)."""
        self.codec = self.codec_set.codecs[0] if self.codec_set.codecs else None
        self.density_schedule = self.codec_set.density_schedule
        check_overflow = grad_scaler is not None if config.check_overflow is None else config.check_overflow
        self.ledger = Ledger([self.codec] if self.codec is not None else [])
        """What error feedback owes: the codec's streams and the carry, with the round an overflow
        undoes (:mod:`gradsync.sync.ledger`: the same object ``wrap``'s engine and FSDP2 drive)."""
        self.books = HookBooks(self.ledger, model, config.find_unused_parameters, check_overflow)
        """DDP's bucket layouts and the parameters' use, from one iteration to the next."""
        self.manager = TaskManager("gradsync-ddp")
        self.step = 0
        self.forwards = 0  # training-mode forward passes of ``model`` (for the step check)
        self.words: EngineWords | None = None  # the step check of the iteration in flight
        self._forwards_warned = False
        self.loss_scale = loss_scale  # the scale the gradients carry (read from grad_scaler when given)
        # bound to the process group by bind() (at construction when one exists, else at the first call)
        self.topo: Topology | None = None
        self.scheme: Scheme | None = None
        self.resident = False  # decided when the hook binds to its process group
        self._topology = topology
        # parameter names, for state keys that match wrap()'s (internal)
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self._workspaces: dict[str, Workspace] = {}
        self._refusals: dict[str, str | None] = {}  # bucket key -> why the codec cannot take it
        self._seen: dict[str, tuple[int, str | None, int]] = {}  # first compressed iteration's buckets
        self._reported = False
        self._counting = model.register_forward_pre_hook(self._count_forward) if model is not None else None

    def _count_forward(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled() and module.training:
            self.forwards += 1

    def bind(self) -> Topology:
        """Bind to the process group that exists now (once; every rank at the same point)."""
        if self.topo is not None:
            if not self.topo.is_bound:
                raise TopologyError(
                    "gradsync: the process group this DDP hook was bound to has been destroyed; make a "
                    "new hook for the new process group"
                )
            return self.topo
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("gradsync: the DDP hook ran without a process group")
        topo = self._topology.bind() if self._topology is not None else Topology()
        agreed(topo, lambda: _placed(topo, self.model, self.config), lambda c: c.spec(), self.model)
        return self._bound_to(topo)

    def _bound_to(self, topo: Topology) -> Topology:
        self.scheme = Scheme.parse(self.config.scheme).resolve(topo.nodes, topo.per_node)
        self.topo = topo
        self.resident = self.codec_set.choose_resident(topo.comm_device)
        """Resident mode (:attr:`SyncConfig.resident`), decided once the device is known."""
        self.manager.device = topo.device  # the threads start with the first bucket
        return topo

    def names(self, bucket: dist.GradBucket) -> list[str]:
        """The names of the bucket's parameters, in its order. With ``model`` they are the
        model's; without it a parameter is named when the hook first sees it, by where it lay
        then (``ddp.b<bucket>.<position>``): DDP forms the same buckets on every rank, so the
        names agree across ranks, and a parameter keeps its name (and its residual) when DDP
        rebuilds its buckets. State is never keyed by shapes: two layers of the same shape are
        two streams."""
        out = []
        for i, p in enumerate(bucket.parameters()):
            name = self._names.get(id(p))
            if name is None:
                name = self._names[id(p)] = f"ddp.b{bucket.index()}.{i}"
            out.append(name)
        return out

    def key(self, bucket: dist.GradBucket) -> str:
        """The bucket's state key: its first and last parameter's names."""
        names = self.names(bucket)
        if not names:
            return f"ddp-bucket{bucket.index()}"
        return names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}"

    def dense_step(self) -> bool:
        """Whether this iteration is dense for everyone (warm-up, the switch to dense, or the
        first iteration after a load)."""
        c = self.config
        return (
            self._dense_next
            or self.step < c.dense_warmup_steps
            or (c.dense_from_step is not None and self.step >= c.dense_from_step)
        )

    # ------------------------------------------------------------------ one iteration
    def members(self, bucket: dist.GradBucket) -> list[tuple[str, int]]:
        """The bucket's parameters as (name, numel), in its order."""
        return [(n, p.numel()) for n, p in zip(self.names(bucket), bucket.parameters(), strict=True)]

    def begin(self, joined: bool) -> Iteration:
        """The first bucket of an iteration (every bucket of the last one is done by now)."""
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            self.loss_scale = host_reads.read_loss_scale(self.grad_scaler)  # once per iteration
        self.iteration = self.books.begin(joined, self.dense_step())
        return self.iteration

    def settle(self, it: Iteration, flags: torch.Tensor | None) -> None:
        """The iteration is over (compute thread): the ledger settles it, then DDP gets the
        buckets (its next iteration starts from the counted step)."""
        self._note_forwards()
        self.books.settle(it, flags)
        self._dense_next = self._dense_next and not it.dense
        self.step += 1
        self.iteration = None
        self.books.release(it)

    def _note_forwards(self) -> None:
        """Once: the ranks' forward counts were apart (see :func:`warn_forwards_apart`)."""
        if not self._forwards_warned:
            self._forwards_warned = warn_forwards_apart(self.words, f"DDP iteration {self.step}")

    def owed_gradients(self) -> dict[str, torch.Tensor]:
        """What this rank still owes the mean gradient, per parameter (as
        ``GradSync.engine.owed_gradients``); call it between iterations."""
        return self.books.owed_gradients(self.topo.world if self.topo is not None else 1)

    def why_dense(self, buffer: torch.Tensor, key: str = "") -> str | None:
        """Why a bucket is synchronized densely this iteration; None when it is compressed."""
        c = self.config
        if self.codec is None:
            return "dense scheme"
        if self.dense_step():
            return "dense step"
        if c.plan == "dense":
            return "plan='dense'"
        if buffer.numel() * buffer.element_size() < c.min_compress_bytes:
            return f"smaller than min_compress_bytes={c.min_compress_bytes}"
        return self._codec_refuses(buffer, key)

    def _codec_refuses(self, buffer: torch.Tensor, key: str) -> str | None:
        """Why the codec cannot take this bucket (None: it can); worked out once per bucket
        (its key names the same parameters every time)."""
        assert self.codec is not None and self.scheme is not None and self.topo is not None
        s, t = self.scheme, self.topo
        if s.local and t.nodes == 1:
            return "one node: nothing crosses a node, so it is reduced densely inside it"
        if key not in self._refusals:
            self._refusals[key] = codec_refusal(
                self.codec, buffer.numel(), s.strategy or "allgather", bool(s.local), t.nodes, t.per_node,
                buffer.element_size(),
            )  # fmt: skip
        return self._refusals[key]

    def note(self, key: str, bucket: dist.GradBucket, why: str | None) -> None:
        """Remember how a bucket went in the first compressed iteration (for :meth:`report`);
        a no-op once that iteration is over."""
        if self.codec is None or self._reported or self.dense_step():
            return
        factored_dense = 0  # tensors of a compressed bucket that PowerSGD sends dense
        if why is None and self.codec.per_tensor:
            factored_dense = sum(not self.codec.compresses(p.shape) for p in bucket.parameters())
        buf = bucket.buffer()
        self._seen[key] = (buf.numel() * buf.element_size(), why, factored_dense)

    def report(self) -> None:
        """After the first compressed iteration: rank 0 logs what is compressed and why the rest
        is not; every rank warns when nothing is (as wrap's plan report does)."""
        if self._reported or not self._seen or self.topo is None:
            return
        self._reported = True
        done = {k: v for k, v in self._seen.items() if v[1] is None}
        dense: dict[str, list[int]] = {}
        for nbytes, why, _ in self._seen.values():
            if why is not None:
                dense.setdefault(why, []).append(nbytes)
        squeezed = sum(v[2] for v in done.values())
        mb_done = sum(v[0] for v in done.values()) / 1e6
        mb_all = sum(v[0] for v in self._seen.values()) / 1e6
        text = (
            f"compressing {len(done)} of {len(self._seen)} DDP buckets ({mb_done:.3f} of {mb_all:.3f} MB) "
            f"with {self.scheme.name if self.scheme else self.config.scheme}"
        )
        if squeezed:
            text += f" ({squeezed} tensors in them go dense: 1-D, or too small for PowerSGD's rank)"
        for why, sizes in dense.items():
            text += f"; dense: {len(sizes)} ({sum(sizes) / 1e6:.3f} MB): {why}"
        if self.topo.rank == 0 and self.config.log_plan:
            log.info("gradsync DDP hook: %s", text)
        refused = sorted({why for why in dense if why in self._refusals.values()})
        if not done or refused:
            what = "compresses nothing in this DDP model" if not done else "cannot compress some DDP buckets"
            warnings.warn(
                f"gradsync: the scheme {self.config.scheme!r} {what} ({text})", RuntimeWarning, stacklevel=2
            )

    def signature(self) -> dict[str, Any]:
        """What a checkpoint of this hook must match: world, topology, scheme, codec and (with
        ``model``) the parameters that train."""
        topo = self.topo
        return {
            "world": topo.world if topo is not None else 1,
            "nodes": topo.nodes if topo is not None else 1,
            "per_node": topo.per_node if topo is not None else 1,
            "scheme": self.config.scheme,
            "codecs": [] if self.codec is None else [self.codec.spec()],
            "params": None
            if self.model is None
            else [f"{n}:{tuple(p.shape)}" for n, p in self.model.named_parameters() if p.requires_grad],
        }

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: tensors and plain values (``weights_only`` loads it), with the
        signature a load checks (the envelope of :mod:`gradsync.sync.checkpoint`)."""
        rank = self.topo.rank if self.topo is not None else 0
        return front_state(
            STATE_FORMAT, rank, self.signature(), self.step, self.ledger, **self.books.state_dict()
        )

    def load_state_dict(self, state: dict[str, Any], reset_compression_state: bool = False) -> None:
        """Restore :meth:`state_dict`. A state saved under another world, topology, scheme,
        codec or model, or by another rank, is refused naming the difference (with
        ``reset_compression_state=True``: a warning, and only the step count is kept). The
        next iteration is dense: what the residuals owe is sent in it, and DDP's
        first-iteration bucket rebuild (a new DDP model) happens on dense buckets, so no residual
        waits for a bucket that DDP no longer forms."""
        saved_before_signatures = isinstance(state, dict) and "format" not in state and "step" in state
        if isinstance(state, dict) and state.get("format") == _OLDER_FORMAT:
            state = {**state, "format": STATE_FORMAT}
        if not saved_before_signatures and must_reset(
            state, self.signature(), self.topo.rank if self.topo is not None else 0,
            reset_compression_state, STATE_FORMAT,
        ):  # fmt: skip
            self.step = int(state.get("step", self.step))
            self.ledger.reset()
            self._dense_next = True
            return
        self.step = int(state["step"])
        self.ledger.load_state_dict(state)
        self.books.load_state_dict(state)
        self._dense_next = True

    def close(self) -> None:
        """Stop the threads and stop counting forward passes (and gradients)."""
        if self._counting is not None:
            self._counting.remove()
            self._counting = None
        self.books.close()
        self.manager.close()


def _program(state: HookState, it: Iteration, bucket: dist.GradBucket, key: str, compress: bool) -> Program:
    buf = bucket.buffer()
    state.books.inject(it, key, buf, state.loss_scale)
    ws = state._workspaces.setdefault(key, Workspace())
    scheme, topo = state.scheme, state.topo
    assert scheme is not None and topo is not None
    if not compress:
        algorithm = state.config.dense_algorithm
        algorithm = "hybrid" if algorithm == "auto" else algorithm  # no planner in the hook
        return (
            yield from bucket_program(
                buf, topo, scheme, None, key, state.loss_scale, ws, algorithm, resident=state.resident
            )
        )
    codec = state.codec
    assert codec is not None
    apply_schedule(state.density_schedule, [codec], state.step)  # the same step for every bucket
    parts = None
    if codec.per_tensor:
        parts = [
            (g.view(p.shape), n)
            for g, p, n in zip(bucket.gradients(), bucket.parameters(), state.names(bucket), strict=True)
        ]
    return (
        yield from bucket_program(buf, topo, scheme, codec, key, state.loss_scale, ws, lowrank_parts=parts)
    )


def gradsync_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: synchronize the bucket on gradsync's threads."""
    with host_reads.watching():  # (autograd runs hooks outside the caller's torch modes)
        return _synchronize_bucket(state, bucket)


def _synchronize_bucket(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    topo = state.bind()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    buf = bucket.buffer()
    if buf.layout != torch.strided:
        raise ValueError(
            "gradsync: DDP handed the hook a sparse gradient bucket; gradsync synchronizes dense "
            "gradients only (build embeddings with sparse=False)"
        )
    key = state.key(bucket)
    first, last = bucket.index() == 0, bucket.is_last()
    # DDP's Join mirrors a step on zero buckets outside backward, for a rank out of data
    it = state.begin(joined=not _in_backward()) if first or state.iteration is None else state.iteration
    it.members[key] = state.books.layouts[key] = state.members(bucket)
    why = state.why_dense(buf, key)
    if why is None:
        it.compressed.add(key)
        if state.codec is not None and state.codec.per_tensor:  # its streams are per tensor
            it.compressed.update(n for n, _ in it.members[key])
    state.note(key, bucket, why)
    if last:
        state.report()
    held = state.books.needs_flags

    def done() -> None:
        if held:  # DDP gets it once the iteration's flags are settled
            it.held.append((fut, buf))
            return
        if last:  # before DDP sees the result: its next iteration starts from the settled state
            state.settle(it, None)
        fut.set_result(buf)

    def fail(error: BaseException) -> None:
        # torch annotates set_exception's argument as the future's result type; it takes the error
        for f in [fut, *(f for f, _ in it.held)]:
            if not f.done():
                f.set_exception(error)  # type: ignore[arg-type]

    if first and state.config.check_steps and topo.world > 1:
        # the first bucket of an iteration: check that every rank is at the same step first
        forwards = None if it.joined or state.model is None else state.forwards
        # as with wrap: the synchronizing backward passes must agree; forward passes that differ
        # (a look at the predictions on one rank) are said once, not refused (DDP trains on)
        words = state.words = EngineWords(None if it.joined else state.step, 0, False)
        program = sequence_program(topo, state.step, forwards, words=words)
        state.manager.submit(program, "step check", None, fail)
    state.manager.submit(
        _program(state, it, bucket, key, why is None), f"ddp bucket {bucket.index()}", done, fail
    )
    if last and held:
        program, flags = state.books.flags_program(it, topo)
        state.manager.submit(program, "step flags", lambda: state.settle(it, flags), fail)
    return fut


def hook_config(config: SyncConfig) -> SyncConfig:
    """Refuse what a DDP hook cannot do (DDP decides the buckets and starts them during the
    backward pass; the hook sees one bucket at a time), rather than ignore it."""
    if Scheme.parse(config.scheme).candidates:
        raise ValueError(
            f"scheme {config.scheme!r}: candidates need gradsync.wrap (its planner picks a scheme per "
            "bucket); the DDP hook runs one scheme; pass one of the candidates"
        )
    if config.rehearse:
        raise ValueError(
            "rehearse: running the synchronization path in a world of one is gradsync.wrap's (the "
            "hook leaves a one-rank world's buckets as they are); use wrap to measure it"
        )
    if config.clip_local is not None:
        raise ValueError(
            "clip_local: local gradient clipping needs gradsync.wrap (the DDP hook sees one bucket "
            "at a time, after DDP started it); clip with wrap, or clip the synchronized gradient"
        )
    if config.large_codec is not None:
        raise ValueError(
            f"large_codec={config.large_codec!r}: a codec for large tensors needs gradsync.wrap (its "
            "buckets hold one size class; DDP's mix large and small tensors, and the hook runs one "
            "codec); pass it as the scheme, or use wrap"
        )
    if config.partitions > 1:  # 0 (let the planner pick) and 1 (whole) are what the hook does
        raise ValueError(
            f"partitions={config.partitions}: splitting a compressed bucket into pipelined parts needs "
            "gradsync.wrap (the hook synchronizes each of DDP's buckets whole); use partitions 0 or 1, "
            "or make DDP's buckets smaller with bucket_cap_mb"
        )
    scheme = Scheme.parse(config.scheme)
    if scheme.kind != "dense" and sync_momentum(scheme_codecs(config, scheme).classes) is not None:
        raise ValueError(
            f"scheme {config.scheme!r}: ef momentum (momentum correction) needs gradsync.wrap: it "
            "moves the optimizer's momentum into the synchronization, and the DDP hook cannot give "
            "it back to the buckets it sends densely; use ef without momentum and the optimizer's "
            "momentum, or gradsync.wrap"
        )
    return config


def _placed(topo: Topology, model: nn.Module | None, config: SyncConfig) -> SyncConfig:
    """``config``, once the model's parameters are checked to be on this rank's device."""
    if model is not None:
        topo.check_devices(p.device for p in model.parameters())
    return config


def ddp_comm_hook(
    scheme: str | SyncConfig = "auto",
    topology: Topology | None = None,
    *,
    model: nn.Module | None = None,
    config: SyncConfig | None = None,
    grad_scaler: Any | None = None,
    **options: Any,
) -> tuple[HookState, Any]:
    """``(state, hook)`` for ``DistributedDataParallel.register_comm_hook``.

    ``scheme`` and ``options`` as for :func:`gradsync.wrap`. Pass the wrapped ``model`` so that
    compression state is keyed by parameter names and forward passes are counted for the step
    check, and ``grad_scaler`` under mixed precision (overflowing iterations are then skipped on
    every rank, their residuals untouched). With a DDP model made with
    ``find_unused_parameters=True`` pass ``find_unused_parameters=True`` too
    (:func:`register_comm_hook` reads it from the model). Options are checked here; with a
    process group the hook binds to it here too (and checks that every rank passed the same),
    else at its first call."""
    check_model(model)
    if not (dist.is_available() and dist.is_initialized()):
        cfg = hook_config(build_config(scheme, config, options))
        return HookState(cfg, topology, model, grad_scaler=grad_scaler), gradsync_hook
    # with a process group, a bad option on one rank must fail on every rank: agree first
    topo = topology.bind() if topology is not None else Topology()
    cfg = agreed(
        topo, lambda: _placed(topo, model, hook_config(build_config(scheme, config, options))),
        lambda c: c.spec(), model,
    )  # fmt: skip
    state = HookState(cfg, topo, model, grad_scaler=grad_scaler)
    state._bound_to(topo)
    return state, gradsync_hook


def register_comm_hook(
    ddp_model: DistributedDataParallel,
    scheme: str | SyncConfig = "auto",
    topology: Topology | None = None,
    *,
    config: SyncConfig | None = None,
    grad_scaler: Any | None = None,
    **options: Any,
) -> HookState:
    """Register gradsync's hook on a DDP model (after ``init_process_group``) and return its
    state: the one call for models that a framework wrapped in DDP (Accelerate's
    ``prepare``, Lightning's strategy). Compression state is keyed by the parameter names of
    ``ddp_model.module``, its forward passes are counted for the step check, and the hook takes
    the DDP model's ``find_unused_parameters`` (whatever the options say: it must do what DDP
    does). ``grad_scaler``: as for :func:`ddp_comm_hook`."""
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            "gradsync: register_comm_hook needs a DistributedDataParallel model, "
            f"got {type(ddp_model).__name__}"
        )
    # the hook mirrors what DDP does with parameters that got no gradient
    unused = bool(getattr(ddp_model, "find_unused_parameters", False))
    if isinstance(scheme, SyncConfig) and config is None:
        config, scheme = scheme, "auto"
    if config is not None:
        config = dataclasses.replace(config, find_unused_parameters=unused)
    else:
        options["find_unused_parameters"] = unused
    state, hook = ddp_comm_hook(
        scheme, topology, model=ddp_model.module, config=config, grad_scaler=grad_scaler, **options
    )
    ddp_model.register_comm_hook(state, hook)
    return state
