"""``gradsync.wrap(model, scheme=...)``: the one line a training script changes.

The wrapper registers a post-accumulate-grad hook on every trainable parameter. Each hook tells
the engine that a gradient is final; the engine launches a bucket as soon as it is complete, so
compression and communication of the last layers overlap the backward pass of the first ones.
At the end of the backward pass (a callback queued on the autograd engine, as DDP does) the
engine launches what is left and waits, so that after ``loss.backward()`` returns every
``.grad`` holds the mean gradient over all ranks. With ``finish_in_backward=False`` the wait is
deferred to :meth:`GradSync.finish_sync` (or :class:`SyncedOptimizer.step`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from gradsync.collectives import primitives as P
from gradsync.collectives.topology import Topology
from gradsync.integrate.agreement import agreed
from gradsync.integrate.checks import check_model, check_outer_scope
from gradsync.integrate.engine import SyncEngine
from gradsync.sync import host_reads
from gradsync.sync.config import SyncConfig
from gradsync.sync.stats import StepStats

if TYPE_CHECKING:
    from gradsync.observe.trace import TraceRecorder


def build_config(scheme: str | SyncConfig, config: SyncConfig | None, options: dict[str, Any]) -> SyncConfig:
    """One :class:`SyncConfig` from ``wrap``'s arguments (unknown options raise ``ValueError``)."""
    if isinstance(scheme, SyncConfig):
        if config is not None:
            raise ValueError("give the SyncConfig once (as scheme or as config), not twice")
        config = scheme
    if config is not None:
        if options:
            raise ValueError(f"give options in the SyncConfig or as keywords, not both: {sorted(options)}")
        return config
    return SyncConfig.from_options({"scheme": scheme, **options})


class GradSync(nn.Module, Joinable):
    """A model whose gradients gradsync synchronizes (built by :func:`wrap`).

    ``forward`` is the wrapped module's. ``state_dict()`` is the usual module state (with a
    ``module.`` prefix, like DDP; ``.module.state_dict()`` gives the bare one); the engine's
    compression state is :meth:`sync_state_dict`.

    Like DDP it is a :class:`~torch.distributed.algorithms.Joinable`: inside
    ``with Join([model]):`` ranks may have different numbers of batches. A rank that runs out
    takes part in the other ranks' steps with zero gradients, and when all are done every rank
    gets the parameters of the rank that trained longest. As with DDP, the mean divides by the
    whole world size unless ``Join([model], divide_by_initial_world_size=False)``.
    """

    def __init__(
        self,
        module: nn.Module,
        engine: SyncEngine,
        trace: str | os.PathLike[str] | None = None,
        trace_steps: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        self.module = module
        self.engine = engine
        self.tracer: TraceRecorder | None = None
        self._trace_path: str | os.PathLike[str] | None = None
        if trace is not None:
            self.start_trace(trace, trace_steps)
        self._callback_queued = False  # one rank: the end-of-backward callback is queued
        self._in_pass = False  # a backward pass reached the parameters; its end is queued
        self._syncing = False  # ... and it synchronizes (not under no_sync())
        self._handles = []
        if engine.config.broadcast_buffers:
            engine.buffer_source = module.buffers
        for slot in engine.slots:
            self._handles.append(slot.param.register_post_accumulate_grad_hook(self._hook(slot.index)))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.engine
        if engine.active and torch.is_grad_enabled() and self.module.training:
            engine.attach_grads()  # zero-copy buckets: accumulate straight into them
        if engine.active and engine.enabled and torch.is_grad_enabled() and self.module.training:
            engine.forwards += 1  # the step check names these when it fails
            work = Join.notify_join_context(self)
            if work is not None:
                engine.join_work = work
            if self.tracer is not None:
                t0 = time.perf_counter()
                out = self.module(*args, **kwargs)
                self.tracer.span("forward", t0, time.perf_counter())
                return out
        return self.module(*args, **kwargs)

    def _hook(self, index: int) -> Any:
        def hook(param: torch.Tensor) -> None:
            engine = self.engine
            if not engine.active:
                _check_not_stale(engine)
                if engine.enabled and engine.acts_alone and not self._callback_queued:
                    self._callback_queued = True  # one rank: clipping and momentum still apply
                    torch.autograd.Variable._execution_engine.queue_callback(self._finish_alone)
                return
            if not self._in_pass:  # the step check compares the backward passes across ranks
                self._in_pass = True
                engine.passes += 1
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)
            if not engine.enabled:
                engine.note_used(index)  # no_sync(): used, for the next synchronization
                return
            self._syncing = True
            with host_reads.watching():  # (autograd runs hooks outside the caller's torch modes)
                engine.ready(index)

        return hook

    def _finish_alone(self) -> None:
        self._callback_queued = False
        with host_reads.watching():
            self.engine.finish_alone()

    def _backward_end(self) -> None:
        self._in_pass = False
        if not self._syncing:
            return
        self._syncing = False
        with host_reads.watching():
            self.engine.backward_ended()
            if self.engine.config.finish_in_backward:
                self.engine.finish()

    # ------------------------------------------------------------------ public
    def finish_sync(self) -> StepStats | None:
        """Wait until every gradient of the last backward pass is synchronized (a no-op when it
        already is); returns the step's :class:`~gradsync.sync.StepStats`."""
        return self.engine.finish()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no communication) inside the block; the first backward
        pass after it synchronizes the accumulated sum."""
        previous = self.engine.enabled
        self.engine.enabled = False
        try:
            yield
        finally:
            self.engine.enabled = previous

    @property
    def last_stats(self) -> StepStats | None:
        return self.engine.last_stats

    def plan_table(self) -> str:
        return self.engine.plan_table()

    def owed_gradients(self) -> dict[str, torch.Tensor]:
        """What this rank still owes the mean gradient, per parameter name (flat, unscaled):
        error feedback's residuals and what is carried, a frozen parameter's included (it is
        owed until the parameter trains again). See :meth:`SyncEngine.owed_gradients`."""
        return self.engine.owed_gradients()

    def sync_state_dict(self) -> dict[str, Any]:
        """This rank's compression state (residuals, factors, generators, plan, step)."""
        return self.engine.state_dict()

    def load_sync_state_dict(self, state: dict[str, Any], reset_compression_state: bool = False) -> None:
        self.engine.load_state_dict(state, reset_compression_state)

    # ------------------------------------------------------------------ timeline
    def start_trace(self, path: str | os.PathLike[str], steps: tuple[int, int] | None = None) -> None:
        """Record a timeline of the following steps (only synchronized steps ``START <= step <
        STOP`` with ``steps``), written to ``path`` by :meth:`write_trace` (or :meth:`close`):
        see :mod:`gradsync.observe.trace`. Every rank must do the same."""
        # the timeline lives one layer down (observe reads the engine's events); only a traced
        # model imports it
        from gradsync.observe.trace import TraceRecorder

        if self.tracer is not None:
            raise RuntimeError(f"gradsync: a trace is already being recorded (to {self._trace_path})")
        check_trace_path(path)
        self.tracer = TraceRecorder(self.engine.topo, steps)
        self._trace_path = path
        self.tracer.attach(self.engine)
        self.tracer.record_optimizers()

    def write_trace(self) -> Path | None:
        """Stop recording and write the timeline (collective: every rank calls it). Returns the
        merged file on rank 0, this rank's own file elsewhere; None when nothing was traced."""
        tracer, path = self.tracer, self._trace_path
        self.tracer, self._trace_path = None, None
        if tracer is None or path is None:
            return None
        return tracer.write(path)

    @contextlib.contextmanager
    def tracing(self, path: str | os.PathLike[str]) -> Iterator[None]:
        """Trace the steps inside the block; the file is written when it ends (on every rank:
        writing is collective, so every rank must run the block)."""
        self.start_trace(path, None)
        try:
            yield
        finally:
            self.write_trace()

    def close(self) -> None:
        """Write a pending trace (collective), remove the hooks and stop the engine's threads."""
        if self.tracer is not None and self.engine.failure.error is None:
            self.write_trace()
        elif self.tracer is not None:  # a failed engine's peers may be gone: nothing collective
            self.tracer.detach()
            self.tracer = None
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.engine.close()

    # ------------------------------------------------------------------ Join
    def join_hook(self, **kwargs: Any) -> JoinHook:
        """For :class:`~torch.distributed.algorithms.Join`: reads ``divide_by_initial_world_size``
        and, like DDP's, ignores options meant for the context's other joinables."""
        return _JoinHook(self, bool(kwargs.get("divide_by_initial_world_size", True)))

    @property
    def join_device(self) -> torch.device:
        return self.engine.topo.comm_device

    @property
    def join_process_group(self) -> Any:
        return self.engine.topo.control_group

    def _sync_final_model(self, is_last_joiner: bool) -> None:
        """Every rank takes the parameters and buffers (with ``broadcast_buffers``, as DDP) of
        the last rank to join (it trained on every step; the others mirrored the last steps
        without updating), and its pass counts, which the next step check compares."""
        engine, topo = self.engine, self.engine.topo
        if topo.world == 1:
            return
        counts = [topo.rank if is_last_joiner else -1, engine.passes, engine.forwards]
        top = torch.tensor(counts, dtype=torch.int64, device=topo.comm_device)
        P.all_reduce(top, topo.control_group, "world", op=dist.ReduceOp.MAX)
        src, engine.passes, engine.forwards = (int(v) for v in top.tolist())
        buffers = list(self.module.buffers()) if engine.config.broadcast_buffers else []
        with torch.no_grad():
            for t in [*self.module.parameters(), *buffers]:
                P.broadcast(t.data, topo.global_rank(src), topo.control_group, "world")


class _JoinHook(JoinHook):
    def __init__(self, model: GradSync, divide_by_initial_world_size: bool) -> None:
        self.model = model
        model.engine.join_divide_by_world = divide_by_initial_world_size

    def main_hook(self) -> None:
        """A rank out of data mirrors one step of the others with zero gradients."""
        self.model.engine.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.model._sync_final_model(is_last_joiner)


def check_trace_path(path: object) -> None:
    """Refuse a ``trace`` that cannot name a file to write (``ValueError`` naming it)."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ValueError(f"trace must be a file path (e.g. 'trace.json'), got {path!r}")
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"trace must be a file path, {str(p)!r} is a directory")
    parent = next((q for q in p.absolute().parents if q.exists()), None)
    if parent is not None and not parent.is_dir():
        raise ValueError(f"trace: {str(parent)!r} is a file, so {str(p)!r} cannot be written")
    if parent is not None and not os.access(parent, os.W_OK):
        raise ValueError(f"trace: {str(parent)!r} is not writable, so {str(p)!r} cannot be written")


def check_trace_steps(steps: object) -> None:
    """Refuse a ``trace_steps`` that is not ``(START, STOP)`` with ``0 <= START < STOP``."""
    ok = (
        isinstance(steps, tuple)
        and len(steps) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in steps)
        and 0 <= steps[0] < steps[1]
    )
    if not ok:
        raise ValueError(f"trace_steps must be (START, STOP) with 0 <= START < STOP, got {steps!r}")


def _check_not_stale(engine: SyncEngine) -> None:
    """A one-rank engine while a multi-rank process group exists: wrap() ran before
    init_process_group, and training would go on without synchronizing, silently."""
    if not engine.topo.is_bound and dist.is_initialized() and dist.get_world_size() > 1:
        raise RuntimeError(
            "gradsync: this model was wrapped before torch.distributed.init_process_group(), so it "
            f"was built for one process, but the world now has {dist.get_world_size()}: its "
            "gradients would not be synchronized. Call gradsync.wrap() after init_process_group()"
        )


def wrap(
    model: nn.Module,
    scheme: str | SyncConfig = "auto",
    topology: Topology | None = None,
    *,
    grad_scaler: Any | None = None,
    config: SyncConfig | None = None,
    trace: str | os.PathLike[str] | None = None,
    trace_steps: tuple[int, int] | None = None,
    process_group: dist.ProcessGroup | None = None,
    **options: Any,
) -> GradSync:
    """Synchronize ``model``'s gradients with gradsync.

    ``scheme`` is a spec string (``"hitopk:density=0.01"``, ``"torus2d"``, ``"powersgd:rank=4"``,
    ``"ps+local/onebit"``...) or a :class:`~gradsync.sync.SyncConfig`. The default, ``"auto"``,
    lets the planner pick per bucket among dense, top-k at 1 % and PowerSGD at rank 4 on every
    strategy (:data:`~gradsync.sync.scheme.AUTO_CODECS`), by its measured cost model; ``options`` are further
    SyncConfig fields (``bucket_bytes=...``, ``plan="compress"``...). ``topology`` defaults to
    torchrun's layout. Pass the GradScaler of mixed-precision training as ``grad_scaler``: error
    feedback then works in unscaled units and overflowing steps are skipped on every rank.

    Every rank must call ``wrap`` with the same arguments on the same model; that is checked
    (one tiny all-gather) and a difference raises on every rank, naming the ranks. With world
    size 1 nothing is communicated and the gradients are left as they are (``rehearse=True``
    runs the synchronization path all the same, for measuring: :attr:`SyncConfig.rehearse`).

    ``process_group``: synchronize over that group's ranks only, as DDP's ``process_group`` (by
    default one node of them: under an outer loop, ``process_group=outer.inner_group`` keeps the
    per-step synchronization inside the node). Only the group's ranks call ``wrap``.

    ``trace="trace.json"`` records a timeline of every step (Chrome trace events, opens in
    Perfetto; ``trace_steps=(START, STOP)`` keeps those steps only), written when the model is
    closed (:meth:`GradSync.close`, on every rank) or by :meth:`GradSync.write_trace`;
    :meth:`GradSync.tracing` traces a block instead.
    """
    check_model(model)
    if process_group is not None and topology is not None:
        raise ValueError(
            "wrap: give topology or process_group, not both (Topology(process_group=...) takes the group)"
        )
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"wrap: process_group must be a torch.distributed ProcessGroup (this rank's), got "
            f"{type(process_group).__name__}"
        )
    if process_group is not None:
        ranks = dist.get_process_group_ranks(process_group)
    elif topology is not None:
        ranks = topology.bind().global_ranks()
    else:
        ranks = list(range(dist.get_world_size())) if dist.is_initialized() else [0]
    check_outer_scope(model, ranks)  # before any group is made for it
    if process_group is not None:
        topo = Topology(process_group=process_group)
    else:
        topo = topology.bind() if topology is not None else Topology()

    def build() -> SyncEngine:
        if trace is not None:
            check_trace_path(trace)
        if trace_steps is not None:
            check_trace_steps(trace_steps)
        return SyncEngine(model.named_parameters(), topo, build_config(scheme, config, options), grad_scaler)

    # whether a trace is recorded is agreed too: writing one is collective
    engine = agreed(topo, build, lambda e: e.config.spec() + (" +trace" if trace is not None else ""), model)
    if topo.world > 1 and engine.config.broadcast_parameters:
        # buffers too, unless broadcast_buffers=False (DDP's broadcast_buffers=False skips them
        # at construction as well)
        buffers = list(model.buffers()) if engine.config.broadcast_buffers else []
        with torch.no_grad():
            for t in [*model.parameters(), *buffers]:
                P.broadcast(t.data, topo.global_rank(0), topo.control_group, "world")
    return GradSync(model, engine, trace, trace_steps)


class SyncedOptimizer:
    """An optimizer whose ``step()`` first finishes gradsync's synchronization (needed with
    ``finish_in_backward=False``; harmless otherwise). Everything else is the wrapped optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: GradSync) -> None:
        self.optimizer = optimizer
        self.model = model

    def step(self, closure: Any = None) -> Any:
        self.model.finish_sync()
        return self.optimizer.step(closure) if closure is not None else self.optimizer.step()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.optimizer, name)
