"""The sync engine: buckets of gradients, synchronized by the plan, overlapped with backward.

Life of a step (driven by :mod:`gradsync.integrate.wrap`, which calls :meth:`SyncEngine.ready`
from per-parameter post-accumulate-grad hooks and :meth:`SyncEngine.finish` at the end of the
backward pass):

1. a gradient becomes ready: its bucket's count drops; once the bucket is complete, and every
   bucket before it has been launched, it is launched: its step program(s) go to the task
   manager (packing, then the plan's dense or compressed collective, then unpacking into
   ``.grad``);
2. at the end of backward every bucket still waiting is launched (a parameter without a
   gradient counts as zero), optionally followed by a tiny all-reduce of the overflow flag and
   the used-parameter map, and the engine waits for all of them;
3. after the first step the engine measures the link levels, times the codec, makes the plan on
   rank 0 from the gradient-ready order and times it observed, and broadcasts it.

The first ``dense_warmup_steps`` steps (at least one) are dense. Buckets launch in a fixed
order, the same on every rank, and the task manager issues their collectives in that order.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from gradsync.codecs import Compressor, ErrorFeedback
from gradsync.collectives import primitives as P
from gradsync.collectives.compressed import codec_refusal, compressed_program
from gradsync.collectives.cost import CodecCost, CostModel, CostParams, Link
from gradsync.collectives.dense import allreduce_program
from gradsync.collectives.program import Program
from gradsync.collectives.topology import Topology
from gradsync.sync.buckets import Bucket, Slot, build_groups, codec_class_for
from gradsync.sync.carry import Carry, Layouts, gather_for_mean, overlapping, owed_by_parameter
from gradsync.sync.clipping import bucket_threshold, clip_, local_threshold
from gradsync.sync.closed_loop import (
    ClosedLoop,
    kept_streams,
    plan_seconds,
    refit,
    same_plan,
    samples_of,
)
from gradsync.sync.config import SyncConfig
from gradsync.sync.density_schedule import apply_schedule, schedule_for
from gradsync.sync.explain import PlanReport, explain_plan
from gradsync.sync.momentum import SyncMomentum
from gradsync.sync.plan import Plan
from gradsync.sync.planner import (
    FirstStep,
    first_step_groups,
    make_plan,
    plan_after_first_step,
    share_plan,
    time_codecs,
)
from gradsync.sync.scheme import Scheme
from gradsync.sync.sequence import UNEVEN_HINT, LagClock, sequence_program
from gradsync.sync.stats import BucketStats, StepStats
from gradsync.sync.tasks import Task, TaskError, TaskManager

log = logging.getLogger("gradsync")

STATE_FORMAT = "gradsync.sync/1"


class SyncError(RuntimeError):
    """Synchronization failed (a peer stopped, timed out, or the engine failed before)."""


def build_codecs(config: SyncConfig, scheme: Scheme) -> list[Compressor]:
    """The codecs an engine with ``config`` runs ``scheme`` with, error feedback included: the
    scheme's, then the one for large tensors (none for a dense scheme)."""
    codecs: list[Compressor] = []
    main = scheme.build(config.error_feedback)
    if main is not None:
        codecs.append(main)
        if config.large_codec is not None:
            large = Scheme.parse(f"allgather/{config.large_codec}").build(config.error_feedback)
            assert large is not None  # a compressed scheme always has a codec
            codecs.append(large)
    return codecs


def build_candidates(
    config: SyncConfig, scheme: Scheme, nodes: int, per_node: int
) -> list[tuple[Scheme, Compressor]]:
    """The other candidates of ``auto:candidates=...`` (none for other schemes): each resolved
    for the topology, with its codec (error feedback as :func:`build_codecs` adds it)."""
    out = []
    for alt in scheme.alternatives(nodes, per_node):
        codec = alt.build(config.error_feedback)
        assert codec is not None  # a candidate is a compressed scheme
        out.append((alt, codec))
    return out


def sync_momentum(codecs: list[Compressor]) -> SyncMomentum | None:
    """The dense side of momentum correction when the codecs carry the optimizer's momentum
    (``ef:momentum=M``), else None. Every codec must then carry the same momentum: a bucket
    under a codec without it would get none."""
    kinds = {
        (c.config.momentum, c.config.nesterov) if isinstance(c, ErrorFeedback) else (0.0, False)
        for c in codecs
    }
    if len(kinds) > 1:
        raise ValueError(
            "ef: momentum must be the same for every codec of the scheme (momentum correction moves "
            "the optimizer's momentum into the synchronization, so every bucket needs it), got "
            + ", ".join(sorted(c.spec() for c in codecs))
        )
    m, nesterov = kinds.pop() if kinds else (0.0, False)
    return SyncMomentum(m, nesterov) if m > 0 else None


class SyncEngine:
    """Synchronizes the gradients of ``params`` (name, parameter) over ``topology``."""

    def __init__(
        self,
        params: Iterable[tuple[str, torch.Tensor]],
        topology: Topology,
        config: SyncConfig,
        grad_scaler: Any | None = None,
    ) -> None:
        self.config = config
        self.topo = topology
        self.grad_scaler = grad_scaler
        self.scheme = Scheme.parse(config.scheme).resolve(topology.nodes, topology.per_node)
        self.codecs: list[Compressor] = build_codecs(config, self.scheme)
        self._class_codecs = len(self.codecs)  # the codecs a tensor belongs to by its size
        self.schemes: list[Scheme] = [self.scheme] * len(self.codecs)
        """The scheme each codec runs under (by codec id): the scheme's own, then the candidates'."""
        for alt, codec in build_candidates(config, self.scheme, topology.nodes, topology.per_node):
            self.schemes.append(alt)
            self.codecs.append(codec)
        self._candidates = list(range(self._class_codecs, len(self.codecs)))
        self.momentum = sync_momentum(self.codecs)
        """Momentum correction (``ef:momentum``): the optimizer's momentum for what is sent
        densely (see :mod:`gradsync.sync.momentum`); None for other schemes."""
        self.density_schedule = schedule_for(config.density_schedule, self.codecs, config.scheme)
        self._density: float | None = None  # what the last step ran at under the schedule
        self.slots = [Slot(i, n, p) for i, (n, p) in enumerate((n, p) for n, p in params if p.requires_grad)]
        self._numel = sum(s.numel for s in self.slots)
        self._clip_global = config.clip_local is not None and config.clip_local_mode == "global"
        """Local clipping over all gradients: no bucket may start before the backward pass ends."""
        self.active = topology.world > 1
        self.check_overflow = (
            config.check_overflow if config.check_overflow is not None else grad_scaler is not None
        )
        topology.check_devices(s.param.device for s in self.slots)
        self.manager = TaskManager("gradsync", topology.device)
        self.step = 0  # completed steps
        self.plan: Plan | None = None
        loop_on = config.plan == "auto" and self.scheme.kind != "dense" and bool(self.codecs)
        self.loop = ClosedLoop(
            config.replan if loop_on else 0, config.replan_steps, config.replan_gain,
            revert_above=1.0 + config.replan_gain,
        )  # fmt: skip
        """The closed loop's state: re-plans done, settled, what each round decided."""
        self._params: CostParams | None = None  # the links as calibrated after the first step
        self._first: FirstStep | None = None  # the first step's gradient order and ready times
        self._codec_costs: dict[int, CodecCost] = {}  # rank 0: the codecs as timed for the plan
        self.enabled = True  # False inside no_sync()
        self.history: list[StepStats] = []
        self._lock = threading.Lock()
        self._buckets: list[Bucket] = []
        self._bucket_of: list[int] = []
        self._compress: list[bool] = []
        self._parts: list[int] = []
        self._set_buckets(self._initial_groups(), None)
        self.carry = Carry()
        """What error feedback owed to streams that ended, until a step applies it
        (:mod:`gradsync.sync.carry`)."""
        self._dense_flushed = False  # dense_from_step: the streams were ended for dense training
        # per step
        self._in_step = False
        self._dense_step = True
        self._next = 0
        self._tasks: list[Task] = []
        self._ready_at: list[float | None] = [None] * len(self.slots)
        self._order: list[int] = []
        self._backward_end_at = 0.0
        self._nonfinite: list[torch.Tensor] = []  # per packed bucket: a 0-d bool, on its device
        self._loss_scale = 1.0
        self._shadow = False  # this step is taken without data (a joined rank under Join)
        self.forwards = 0
        """Forward passes that built a graph (train mode, gradients on): the step check compares
        them across ranks. :class:`~gradsync.integrate.GradSync` counts them."""
        self.join_work: Any = None  # Join's all-reduce of the ranks still training, this step
        self.join_divide_by_world = True
        self._error: BaseException | None = None  # the first failure; every later call re-raises it
        self.report: PlanReport | None = None
        self.observers: list[Callable[[StepStats, list[Task], list[int]], None]] = []
        """Called on the training thread after every synchronized step with its stats, its tasks
        and each task's bucket (-1: the step check or flags). A timeline sets
        ``manager.record`` so that the tasks keep their spans."""
        self._lag = LagClock()
        self._task_bucket: list[int] = []
        self._launched_at: list[float] = []
        if self.active:
            self._check_codecs_fit()

    # ------------------------------------------------------------------ layout
    def _set_buckets(self, groups: list[tuple[list[int], int]], plan: Plan | None) -> None:
        self._buckets, self._bucket_of = [], [0] * len(self.slots)
        self._compress, self._parts = [], []
        for b, (members, _) in enumerate(groups):
            slots = [self.slots[i] for i in members]
            first, last = slots[0].name, slots[-1].name
            key = first if first == last else f"{first}..{last}"
            self._buckets.append(Bucket(b, slots, key))
            for i in members:
                self._bucket_of[i] = b
            bp = plan.buckets[b] if plan is not None else None
            self._compress.append(bool(bp and bp.compress))
            self._parts.append(bp.partitions if bp and bp.compress else 1)

    def _initial_groups(self) -> list[tuple[list[int], int]]:
        """Before anything was measured: reverse registration order (roughly the order backward
        produces gradients), fused by size only; these buckets are synchronized densely."""
        order = [s.index for s in reversed(self.slots)]
        return build_groups(self.slots, order, None, [-1] * len(self.slots), self.config.bucket_bytes, 0.0)

    def _set_density(self) -> None:
        """Set each sparsifier's density for this step from the schedule (kept in ``_density``:
        the largest one, None when all run at their own). Logged when it changes."""
        if self.density_schedule is None:
            return
        density = apply_schedule(self.density_schedule, self.codecs, self.step)
        if density != self._density and self.config.log_plan and self.topo.rank == 0:
            if density is None:
                log.info(
                    "gradsync: step %d: density schedule %s over; every sparsifier at its own density",
                    self.step, self.density_schedule.text,
                )  # fmt: skip
            else:
                stage = self.step // self.density_schedule.stage_steps + 1
                log.info(
                    "gradsync: step %d: density schedule %s, stage %d: sparsifiers send %.4g %% of "
                    "each tensor (until step %d)", self.step, self.density_schedule.text, stage,
                    100 * density, stage * self.density_schedule.stage_steps,
                )  # fmt: skip
        self._density = density

    def _own_density(self) -> None:
        """Back to the codecs' own densities (what the planner and its timings assume)."""
        apply_schedule(None, self.codecs, self.step)

    def _check_codecs_fit(self) -> None:
        """Refuse, before anything communicates, a codec that could not compress even the
        largest bucket this model can form (e.g. ``topk:k=100000`` on tensors that hold fewer
        elements); smaller buckets it cannot take are left dense by the plan, which says so."""
        for cid in range(len(self.codecs)):
            kinds: dict[tuple[torch.dtype, torch.device], list[Slot]] = {}
            for s in self.slots:
                c = self.codec_class(s)
                if c == cid or (c >= 0 and cid in self._candidates):
                    kinds.setdefault(s.group, []).append(s)
            for members in kinds.values():
                itemsize = members[0].param.element_size()
                total = sum(s.numel for s in members)
                # a bucket closes once it holds bucket_bytes, so none exceeds this
                cap = (self.config.bucket_bytes - 1) // itemsize + max(s.numel for s in members)
                largest = min(total, cap)
                why = self._refusal(cid, largest, itemsize)
                if why is not None:
                    raise ValueError(
                        f"{why}: the largest bucket of this model's compressible {members[0].param.dtype} "
                        f"tensors ({len(members)} tensors, {largest} elements) is too small for it under "
                        f"{self.schemes[cid].name} on {self.topo.nodes} x {self.topo.per_node}; use a "
                        "density instead of k"
                    )

    def codec_class(self, slot: Slot) -> int:
        """-1: never compressed; 0: the scheme's codec; 1: the codec for large tensors."""
        cfg = self.config
        return codec_class_for(
            slot.nbytes, slot.param.is_floating_point(), self._class_codecs, cfg.min_compress_bytes,
            cfg.large_bytes,
        )  # fmt: skip

    # ------------------------------------------------------------------ the step
    def ready(self, index: int) -> None:
        """Slot ``index``'s gradient is final for this backward pass (called from its hook)."""
        if not self.active or not self.enabled:
            return
        with self._lock, self._failing():
            if not self._in_step:
                self._begin_step()
            if self._ready_at[index] is not None:
                raise SyncError(
                    f"gradsync: the gradient of {self.slots[index].name!r} became ready twice in one "
                    "synchronized backward pass (backward called twice without finish_sync()? "
                    "use no_sync() for gradient accumulation)"
                )
            self._ready_at[index] = time.perf_counter()
            self._order.append(index)
            bucket = self._buckets[self._bucket_of[index]]
            bucket.pending -= 1
            if self.config.overlap and not self._clip_global:
                while self._next < len(self._buckets) and self._buckets[self._next].pending == 0:
                    self._launch(self._next)

    def backward_ended(self) -> None:
        """The backward pass is over (its remaining work is this engine's)."""
        self._backward_end_at = time.perf_counter()

    def finish(self) -> StepStats | None:
        """Launch what is left, wait for every bucket and make ``.grad`` final. Idempotent."""
        if not self.active or not self.enabled:
            return None
        with self._lock, self._failing():
            if not self._in_step:
                return None
            if not self._backward_end_at:
                self._backward_end_at = time.perf_counter()
            in_backward = self._next
            if self._clip_global and not self._shadow:
                self._clip_all()  # nothing was launched yet: see ready()
            while self._next < len(self._buckets):
                self._launch(self._next)
            flags = self._flags_task()
        return self._complete(in_backward, flags)

    def _clip_all(self) -> None:
        """``clip_local`` in ``global`` mode: this rank's gradients, all together, before any
        bucket packs them (so before the error-feedback residual is added)."""
        assert self.config.clip_local is not None
        grads = [s.param.grad for s in self.slots if s.param.grad is not None]
        bound = local_threshold(self.config.clip_local, self.topo.world)
        clip_(grads, bound, self._loss_scale)

    @property
    def acts_alone(self) -> bool:
        """A world of one rank with something to do at the end of a backward pass (see
        :meth:`finish_alone`)."""
        return not self.active and (self.config.clip_local is not None or self.momentum is not None)

    def finish_alone(self) -> None:
        """A world of one rank synchronizes nothing, but ``clip_local`` still clips (plain
        clipping of the gradients) and momentum correction still applies the momentum: once per
        synchronizing backward pass (the wrapper calls this at its end)."""
        if self.active or not self.enabled:
            return
        scaler = self.grad_scaler
        scaled = scaler is not None and bool(scaler.is_enabled())
        self._loss_scale = float(scaler.get_scale()) if scaler is not None and scaled else 1.0
        if self.config.clip_local is not None:
            self._clip_all()
        if self.momentum is not None:
            live = [(s.name, g) for s in self.slots if (g := s.param.grad) is not None]
            if scaled and live:  # one read of the flags (kept on the device until then)
                home = live[0][1].device
                if not bool(torch.stack([torch.isfinite(g).all().to(home) for _, g in live]).all()):
                    return  # the GradScaler skips this step: the momentum stays as it was
            self.momentum.begin_round()
            self.momentum.dense([n for n, _ in live], [g for _, g in live], self._loss_scale)

    def shadow_step(self) -> StepStats | None:
        """Take part in one step's synchronization without data: every gradient counts as zero
        and no ``.grad`` is written (a rank that ran out of inputs, under
        ``torch.distributed.algorithms.Join``, mirrors the collectives of the others' step)."""
        if not self.active:
            return None
        with self._lock, self._failing():
            if self._in_step:
                raise SyncError("gradsync: a rank cannot join while its own step is unfinished")
            self._begin_step(shadow=True)
            self._backward_end_at = time.perf_counter()
            for b in self._buckets:
                b.pending = 0
            while self._next < len(self._buckets):
                self._launch(self._next)
            flags = self._flags_task()
        return self._complete(0, flags)

    def _complete(self, in_backward: int, flags: torch.Tensor | None) -> StepStats:
        with self._failing():
            self.manager.wait(self._tasks, timeout=self.config.timeout_s)
            self._own_density()
            overflow, unused = False, set[str]()
            if flags is not None:
                overflow, unused = self._apply_flags(flags)
            if self.join_work is not None:
                self._rescale_for_join()
            if self.carry and not overflow:
                self._apply_carry(unused)
            stats = self._stats(in_backward, overflow)
            for observe in list(self.observers):  # an observer may leave
                observe(stats, self._tasks, self._task_bucket)
            self.history.append(stats)
            if len(self.history) > 1000:
                del self.history[:-1000]
            self.step += 1
            self._in_step = False
            shadow, self._shadow = self._shadow, False
            if self.plan is None:
                self._make_plan()
            elif (
                self.loop.active
                and not stats.dense
                and stats.density is None  # a warm-up step costs what later steps will not
                and self._first is not None
                and self.loop.observe(stats, valid=not overflow and not shadow)
            ):
                self._replan()
            cfg = self.config
            if (
                cfg.dense_from_step is not None
                and self.step >= cfg.dense_from_step
                and not self._dense_flushed
            ):
                self._dense_flushed = True
                self._end_all_streams()
        return stats

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """Re-raise an earlier failure; record a new one (with a message that names its likely
        cause) and leave the engine out of its step, so every later call reports it too."""
        if self._error is not None:
            raise SyncError(
                f"gradsync: synchronization failed earlier on rank {self.topo.rank} "
                f"({type(self._error).__name__}: {self._error}); the ranks' collectives may no longer "
                "pair, so this engine cannot continue (restart from a checkpoint)"
            ) from self._error
        try:
            yield
        except BaseException as e:
            self._in_step = False
            self._shadow = False
            self._error = self._explained(e)
            if self._error is e:
                raise
            raise self._error from e

    def _explained(self, e: BaseException) -> BaseException:
        root = e.__cause__ if isinstance(e, TaskError) and e.__cause__ is not None else e
        if isinstance(root, (ValueError, TypeError, SyncError)) or not isinstance(root, Exception):
            return root  # a configuration error, a mismatch or misuse, already named; or an interrupt
        return SyncError(
            f"gradsync: rank {self.topo.rank} could not synchronize step {self.step} "
            f"({type(root).__name__}: {root}). Another rank stopped synchronizing: it failed, was "
            f"killed, or ran out of data; {UNEVEN_HINT}"
        )

    def _begin_step(self, shadow: bool = False) -> None:
        self._in_step = True
        self._shadow = shadow
        self._next = 0
        self._tasks = []
        self._task_bucket = []
        self._launched_at = [0.0] * len(self._buckets)
        self._ready_at = [None] * len(self.slots)
        self._order = []
        self._backward_end_at = 0.0
        self._nonfinite = []
        self.manager.take_traffic()
        for b in self._buckets:
            b.pending = len(b.slots)
        cfg = self.config
        self._dense_step = (
            self.plan is None
            or self.step < cfg.dense_warmup_steps
            or (cfg.dense_from_step is not None and self.step >= cfg.dense_from_step)
        )
        self._loss_scale = 1.0
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            self._loss_scale = float(self.grad_scaler.get_scale())
        for codec in self.codecs:
            codec.begin_round()
        self._set_density()
        if self.momentum is not None:
            self.momentum.begin_round()
        if cfg.check_steps:  # before any bucket: see gradsync.sync.sequence
            program = sequence_program(self.topo, self.step, None if shadow else self.forwards, self._lag)
            self._tasks.append(self.manager.submit(program, "step check"))
            self._task_bucket.append(-1)

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        compress = self._compress[b] and not self._dense_step
        parts = self._parts[b] if compress else 1
        bucket.parts_left = parts
        self._launched_at[b] = time.perf_counter()
        done = self._unpacker(bucket, compress)
        for part in range(parts):
            program = self._program(bucket, part, parts, compress)
            name = f"bucket {b} [{bucket.key}]" + (f" part {part + 1}/{parts}" if parts > 1 else "")
            self._tasks.append(self.manager.submit(program, name, done))
            self._task_bucket.append(b)
        self._next = b + 1

    def _unpacker(self, bucket: Bucket, compressed: bool) -> Callable[[], None]:
        shadow = self._shadow
        momentum, scale = self.momentum, self._loss_scale

        def done() -> None:  # on the compute thread, after each part's finisher
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

    def _program(self, bucket: Bucket, part: int, parts: int, compress: bool) -> Program:
        if part == 0:
            if self._shadow:
                bucket.detach()  # a joined rank's own gradients stay as they were
                bucket.flat.zero_()
            else:
                bucket.pack()
                if self.config.clip_local is not None and not self._clip_global:
                    bound = bucket_threshold(
                        self.config.clip_local, self.topo.world, bucket.numel, self._numel
                    )
                    clip_([bucket.flat], bound, self._loss_scale)
                if self.carry.local:  # what ended streams owed: sent with the gradient
                    for j, s in enumerate(bucket.slots):
                        region = bucket.flat[bucket.offsets[j] : bucket.offsets[j] + s.numel]
                        self.carry.inject(s.name, region, self._loss_scale)
            if self.check_overflow:  # stays on the device: read once, after the flags' all-reduce
                self._nonfinite.append(torch.isfinite(bucket.flat).all().logical_not())
        lo, hi = bucket.part_range(part, parts)
        view = bucket.flat[lo:hi]
        ws = bucket.workspace(part)
        scheme = self.scheme
        if not compress:
            if scheme.kind == "dense":
                algo, comm_dtype = scheme.algorithm, scheme.comm_dtype
            else:
                algo = self.plan.buckets[bucket.index].dense_algorithm if self.plan else "hybrid"
                comm_dtype = None
            return (yield from allreduce_program(view, self.topo, algo, "mean", comm_dtype, None, ws))
        codec_id = self.plan.buckets[bucket.index].codec_id if self.plan else 0
        codec, scheme = self.codecs[codec_id], self.schemes[codec_id]
        lowrank_parts = None
        if codec.lowrank:
            lowrank_parts = [(bucket.view(j), s.name) for j, s in enumerate(bucket.slots)]
        key = bucket.key if parts == 1 else f"{bucket.key}#{part}"
        return (
            yield from compressed_program(
                view, self.topo, codec, scheme.strategy or "allgather", bool(scheme.local), "mean", key,
                self._loss_scale, 4, ws, lowrank_parts, lo,
            )
        )  # fmt: skip

    # ------------------------------------------------------------------ flags
    def _flags_task(self) -> torch.Tensor | None:
        """Submit the step's flag all-reduce (overflow, used parameters) if it is needed."""
        unused = self.config.find_unused_parameters
        if not (self.check_overflow or unused):
            return None
        flags = torch.zeros(1 + (len(self.slots) if unused else 0), dtype=torch.float32, device="cpu")
        out = flags.to(self.topo.comm_device)

        def program() -> Program:
            # runs after every bucket's packing (tasks run their first segments in order)
            if unused:
                for i, t in enumerate(self._ready_at):
                    flags[1 + i] = float(t is not None)
                out.copy_(flags)
            if self._nonfinite:  # device flags: no host synchronization per bucket
                out[:1].copy_(torch.stack([f.to(out.device) for f in self._nonfinite]).any().reshape(1))
            yield lambda: P.all_reduce(out, self.topo.world_group, "world", op=dist.ReduceOp.MAX)
            return lambda: flags.copy_(out)

        self._tasks.append(self.manager.submit(program(), "step flags"))
        self._task_bucket.append(-1)
        return flags

    def _apply_flags(self, flags: torch.Tensor) -> tuple[bool, set[str]]:
        """Act on the agreed flags: an overflow on any rank skips the step everywhere; a parameter
        no rank used gets no gradient (returns the overflow and those parameters' names)."""
        values = flags.tolist()  # the flags came back to the host: one read of them all
        overflow = values[0] > 0
        if overflow:
            # some rank overflowed: every rank skips the step (its GradScaler sees NaN) and undoes
            # what this step did to the residuals
            for s in self.slots:
                if s.param.grad is not None:
                    s.param.grad.fill_(float("nan"))
            for codec in self.codecs:
                codec.rollback_round()
            if self.momentum is not None:
                self.momentum.rollback_round()
        unused: set[str] = set()
        if self.config.find_unused_parameters:
            unused = {s.name for i, s in enumerate(self.slots) if values[1 + i] == 0}
            for s in self.slots:
                if s.name in unused:
                    s.param.grad = None  # no rank used it: leave it as DDP would
            if unused and not overflow:
                self._rollback_unused(unused)
        return overflow, unused

    def _rollback_unused(self, unused: set[str]) -> None:
        """Parameters no rank used get no gradient, so what error feedback sent of them this step
        never reaches the model: their elements get their residual back (and their momentum:
        SGD skips a parameter without a gradient, so the momentum does not move either)."""
        layouts = self._layouts(self._buckets)
        for codec in self.codecs:
            for key, (offset, numel) in codec.homes().items():
                for start, stop in overlapping(layouts.spans(key, offset, numel), unused):
                    codec.rollback_elements(key, start, stop)
        if self.momentum is not None:
            self.momentum.rollback_round(unused)

    def _apply_carry(self, unused: set[str]) -> None:
        """After a step that was not skipped: the agreed carry (momentum correction) goes onto the
        synchronized gradients; what this step applied is settled. A parameter without a gradient
        (no rank used it, or a rank that joined) keeps its carry for a later step."""
        scale = self._loss_scale
        if self._shadow:  # the others applied the agreed carry; this rank takes their parameters
            self.carry.settle(list(self.carry.mean), local=False)
            return
        applied = []
        for s in self.slots:
            if s.param.grad is None or s.name in unused:
                continue
            self.carry.apply_mean(s.name, s.param.grad, scale)
            applied.append(s.name)
        self.carry.settle(applied)

    def _rescale_for_join(self) -> None:
        """Under ``Join(..., divide_by_initial_world_size=False)``: a mean over the ranks that
        still train, not over the whole world (the joined ranks contributed zeros)."""
        work, self.join_work = self.join_work, None
        work.wait()
        if self.join_divide_by_world or self._shadow:
            return
        active = int(work.result()[0].item())
        if 0 < active < self.topo.world:
            for s in self.slots:
                if s.param.grad is not None:
                    s.param.grad.mul_(self.topo.world / active)

    def attach_grads(self) -> None:
        """Zero-copy buckets (``grad_as_bucket_view``): before a training forward pass, point
        every gradient at its bucket's buffer (between steps only)."""
        if self.config.grad_as_bucket_view and self.active and not self._in_step:
            for bucket in self._buckets:
                bucket.attach()

    # ------------------------------------------------------------------ plan
    def _make_plan(self) -> None:
        """After the first step: measure, decide on rank 0, broadcast, rebuild the buckets."""
        t0 = time.perf_counter()
        first = FirstStep(list(self._order), list(self._ready_at))
        classes = [self.codec_class(s) for s in self.slots]
        plan, params, costs = plan_after_first_step(
            self.topo, self.config, self.scheme, self.slots, self.codecs, first, classes, self.codec_rejects,
            self.schemes, self._candidates,
        )  # fmt: skip
        self._params, self._first, self._codec_costs = params, first, costs
        self._install_plan(plan)
        self.loop.restart()
        self._report_plan(time.perf_counter() - t0)

    def _replan(self) -> None:
        """The closed loop's round (:mod:`gradsync.sync.closed_loop`): agree on the measured
        bucket costs, refit and re-plan on rank 0, and switch every rank to the new plan, or
        settle on the current one."""
        assert self.plan is not None and self._first is not None and self._params is not None
        t0 = time.perf_counter()
        cfg, old = self.config, self.plan
        measured, span = self.loop.agreed(self.topo, len(self._buckets))
        nbytes = [s.nbytes for s in self.slots]
        record: dict[str, Any] = {"step": self.step, "measured_ms": span * 1e3}
        if self.loop.worse_than_before(span):
            self._revert(record, t0)
            return
        if self.loop.replans >= self.loop.replan:  # the last switch measured no slower: keep it
            self.loop.settled, self.loop.before = True, None
            record.update(switched=False, verified=True, seconds=time.perf_counter() - t0)
            self.loop.history.append(record)
            if cfg.log_plan and self.topo.rank == 0:
                log.info(
                    "gradsync closed loop at step %d: the last re-plan measured %.1f ms per step, no "
                    "slower than before it; the plan stays", self.step, span * 1e3,
                )  # fmt: skip
            return

        def decide() -> Plan | None:
            assert self._first is not None and self._params is not None
            t, m, n = self.topo, self.topo.nodes, self.topo.per_node
            classes = [self.codec_class(s) for s in self.slots]
            timeout = cfg.bucket_timeout_ms / 1e3
            groups = first_step_groups(self.slots, self._first, classes, cfg.bucket_bytes, timeout)
            if not self._codec_costs:  # a run resumed from a checkpoint: time the codecs now
                self._codec_costs = time_codecs(
                    t, self.scheme, self.slots, self.codecs, groups, self.schemes, self._candidates
                )
            samples = samples_of(old, nbytes, measured)
            fit = refit(samples, self.scheme, self._params, m, n, self._codec_costs, self.schemes)
            model = CostModel(fit.params, m, n)
            candidate = make_plan(
                groups, nbytes, self.scheme, model, fit.codecs, cfg.plan, cfg.dense_algorithm, cfg.partitions,
                fuse_bytes=cfg.bucket_bytes, kinds=[s.group for s in self.slots], rejects=self.codec_rejects,
                margin=1.0 - cfg.replan_gain, dense_overhead=fit.dense_overhead, schemes=self.schemes,
                candidates=self._candidates,
            )  # fmt: skip
            before, after = (
                plan_seconds(p, nbytes, self.scheme, model, fit.codecs, fit.dense_overhead, self.schemes)
                for p in (old, candidate)
            )
            record.update(refit=fit.describe(), predicted_ms=[before * 1e3, after * 1e3])
            if same_plan(candidate, old) or after > (1.0 - cfg.replan_gain) * before:
                return None
            return candidate

        new = share_plan(self.topo, decide)
        record["switched"] = new is not None
        record["seconds"] = time.perf_counter() - t0
        self.loop.history.append(record)
        if new is None:
            self.loop.settled = True
            if cfg.log_plan and self.topo.rank == 0:
                log.info(
                    "gradsync closed loop at step %d: the plan stays (%s; predicted %.1f -> %.1f ms "
                    "of synchronization per step, a switch needs %.0f %%)", self.step, record.get("refit"),
                    *record.get("predicted_ms", [0.0, 0.0]), 100 * cfg.replan_gain,
                )  # fmt: skip
            return
        self.loop.replans += 1
        carried = self._switch_plan(new)
        # every switch is measured once more before the loop settles: the guard compares the
        # new plan's span with this one (or, after the last allowed switch, only that)
        self.loop.before = (old, span)
        if cfg.log_plan and self.topo.rank == 0:
            log.info(
                "gradsync closed loop at step %d: re-plan %d of at most %d (%s; predicted %.1f -> %.1f ms "
                "of synchronization per step; %d compression streams of changed buckets end, what they "
                "owed is carried to the next step)", self.step, self.loop.replans, self.loop.replan,
                record.get("refit"), *record.get("predicted_ms", [0.0, 0.0]), len(carried),
            )  # fmt: skip
        self._report_plan(time.perf_counter() - t0)

    def _revert(self, record: dict[str, Any], t0: float) -> None:
        """The guard of the closed loop: the last switch measured slower than the plan before
        it (the refitted model was wrong), so go back to that plan, on every rank, and settle."""
        assert self.loop.before is not None
        old, old_span = self.loop.before
        self.loop.before = None
        self.loop.settled = True
        carried = self._switch_plan(old)
        record.update(switched=True, reverted=True, seconds=time.perf_counter() - t0)
        self.loop.history.append(record)
        if self.config.log_plan and self.topo.rank == 0:
            log.info(
                "gradsync closed loop at step %d: the last re-plan measured %.1f ms per step against "
                "%.1f ms before it; going back to the previous plan and settling (%d compression "
                "streams end, what they owed is carried)", self.step, record["measured_ms"], old_span * 1e3,
                len(carried),
            )  # fmt: skip
        self._report_plan(time.perf_counter() - t0)

    def _switch_plan(self, plan: Plan) -> list[str]:
        """Install ``plan`` between steps. The compression state of the buckets it keeps stays;
        the streams of the buckets it changes end, and what they owed is carried to their
        parameters (their keys are returned)."""
        assert self.plan is not None
        old_plan, old = self.plan, self._buckets
        self._install_plan(plan)
        lowrank = {cid for cid, c in enumerate(self.codecs) if c.lowrank}
        names = [s.name for s in self.slots]
        keep, ended = kept_streams(
            old_plan, [b.key for b in old], plan, [b.key for b in self._buckets], names, lowrank
        )
        taken = self._end_streams(keep, ended, self._layouts(old))
        self.loop.restart()
        return taken

    def _end_all_streams(self) -> list[str]:
        """``dense_from_step``: every stream ends; what they owed goes into the dense steps."""
        assert self.plan is not None
        ended = sorted(i for b in self.plan.buckets if b.compress for i in b.slots)
        return self._end_streams({}, ended, self._layouts(self._buckets))

    def _end_streams(
        self, keep: dict[int, Callable[[str], bool]], ended: list[int], layouts: Layouts
    ) -> list[str]:
        """End every stream ``keep`` rejects (all of a codec without a filter) and carry what they
        owed (:mod:`gradsync.sync.carry`). ``ended``: the slots whose streams end, the same on every
        rank. With momentum correction the ranks agree on it here (one all-reduce)."""
        owed = []
        for cid, codec in enumerate(self.codecs):
            owed += codec.take_streams(keep.get(cid, lambda key: False))
        if self.momentum is None:
            self.carry.add_owed(owed, layouts)
        elif ended:
            slots = [self.slots[i] for i in ended]
            wide = any(s.param.dtype == torch.float64 for s in slots)
            total = gather_for_mean(
                owed, layouts, [(s.name, s.numel) for s in slots], torch.float64 if wide else torch.float32,
                self.topo.comm_device,
            )  # fmt: skip
            if self.active:
                P.all_reduce(total, self.topo.control_group, "world")
            total.div_(self.topo.world)
            half, at = total.numel() // 2, 0
            for s in slots:
                device = s.param.device
                self.carry.add_mean(s.name, total[at : at + s.numel].to(device))
                self.momentum.seed(s.name, total[half + at : half + at + s.numel].to(device))
                at += s.numel
        return [o.key for o in owed]

    @staticmethod
    def _layouts(buckets: list[Bucket]) -> Layouts:
        return Layouts((b.key, [(s.name, s.numel) for s in b.slots]) for b in buckets)

    def codec_rejects(self, codec_id: int, slots: list[int], parts: int) -> str | None:
        """Why codec ``codec_id`` cannot compress a bucket of ``slots`` in ``parts`` parts (None
        when it can): the element counts its encode calls would see, checked by the codec."""
        numel = sum(self.slots[i].numel for i in slots)
        for part in range(parts):
            why = self._refusal(codec_id, numel * (part + 1) // parts - numel * part // parts,
                                self.slots[slots[0]].param.element_size())  # fmt: skip
            if why is not None:
                return why
        return None

    def _refusal(self, codec_id: int, numel: int, itemsize: int) -> str | None:
        s, t, codec = self.schemes[codec_id], self.topo, self.codecs[codec_id]
        return codec_refusal(
            codec, numel, s.strategy or "allgather", bool(s.local), t.nodes, t.per_node, itemsize
        )

    def _report_plan(self, seconds: float) -> None:
        """Say what the plan compresses and why the rest is not: one line on rank 0 (logger
        ``gradsync``) and, on every rank, a warning where a compressed scheme compresses nothing
        or the user's ``plan="compress"`` cannot be honoured for some tensors."""
        assert self.plan is not None
        self.report = explain_plan(
            self.plan, self.slots, [self.codec_class(s) for s in self.slots], self.scheme, self.config,
            self.codecs, self.topo.nodes, self.codec_rejects, self.schemes,
        )  # fmt: skip
        if self.config.log_plan and self.topo.rank == 0:
            log.info(
                "gradsync plan (%s on %d x %d, made in %.2f s): %s", self.scheme.name, self.topo.nodes,
                self.topo.per_node, seconds, self.report.summary,
            )  # fmt: skip
            log.debug("gradsync plan, bucket by bucket:\n%s", self.plan_table())
        for text in self.report.warnings:
            warnings.warn(text, RuntimeWarning, stacklevel=2)

    def _install_plan(self, plan: Plan) -> None:
        n = len(self.slots)
        covered = sorted(i for b in plan.buckets for i in b.slots)
        if covered != list(range(n)) or any(b.codec_id >= len(self.codecs) for b in plan.buckets):
            raise ValueError("gradsync: the plan does not match this model's parameters or codecs")
        if any(b.compress and b.partitions > 1 and self.codecs[b.codec_id].lowrank for b in plan.buckets):
            raise ValueError("gradsync: a low-rank codec factors whole tensors; its buckets take one part")
        self.plan = plan
        self._set_buckets([(b.slots, b.codec_id) for b in plan.buckets], plan)

    def plan_table(self) -> str:
        """The plan as a readable table (empty before the first step)."""
        if self.plan is None:
            return ""
        return self.plan.table(
            [s.name for s in self.slots], [s.nbytes for s in self.slots], self.scheme,
            [c.spec() for c in self.codecs], self.schemes,
        )  # fmt: skip

    # ------------------------------------------------------------------ stats
    def _stats(self, launched_in_backward: int, overflow: bool) -> StepStats:
        now = time.perf_counter()
        tasks = self._tasks
        first_ready = min((t for t in self._ready_at if t is not None), default=self._backward_end_at)
        comm_starts = [t.first_comm_at for t in tasks if t.first_comm_at is not None]
        buckets = self._bucket_stats()
        raw = sum(b.raw_bytes for b in buckets)
        p = self.topo.world
        return StepStats(
            step=self.step,
            dense=self._dense_step,
            buckets=len(self._buckets),
            compressed_buckets=0 if self._dense_step else sum(self._compress),
            launched_in_backward=launched_in_backward,
            backward_s=self._backward_end_at - first_ready,
            exposed_s=now - self._backward_end_at,
            compute_s=sum(t.compute_s for t in tasks),
            decode_s=sum(t.finish_s for t in tasks),
            comm_s=sum(t.comm_s for t in tasks),
            sent_bytes=self.manager.take_traffic(),
            overflow=overflow,
            first_ready_at=first_ready,
            backward_end_at=self._backward_end_at,
            first_comm_at=min(comm_starts) if comm_starts else None,
            done_at=now,
            raw_bytes=raw,
            dense_wire_bytes=int(2 * (p - 1) / p * raw),
            check_wait_s=self._lag.wait_s if self.config.check_steps else None,
            lag_s=self._lag.lag_s if self.config.check_steps else None,
            bucket_stats=buckets,
            density=None if self._dense_step else self._density,
        )

    def _bucket_stats(self) -> list[BucketStats]:
        out = [
            BucketStats(
                index=b.index,
                key=b.key,
                raw_bytes=b.nbytes,
                wire_bytes=0,
                compressed=self._compress[b.index] and not self._dense_step,
                parts=0,
                ready_at=max(
                    (r for r in (self._ready_at[s.index] for s in b.slots) if r is not None),
                    default=self._launched_at[b.index],
                ),
                launched_at=self._launched_at[b.index],
                done_at=0.0,
                compute_s=0.0,
                decode_s=0.0,
                comm_s=0.0,
            )
            for b in self._buckets
        ]
        for task, b in zip(self._tasks, self._task_bucket, strict=True):
            if b < 0:
                continue
            st = out[b]
            st.parts += 1
            st.wire_bytes += task.sent_bytes
            st.compute_s += task.compute_s
            st.decode_s += task.finish_s
            st.comm_s += task.comm_s
            st.done_at = max(st.done_at, task.done_at or 0.0)
        return out

    def owed_gradients(self) -> dict[str, torch.Tensor]:
        """What this rank still owes the synchronized (mean) gradient, per parameter name, flat
        and unscaled: error feedback's residuals traced back to their parameters, and what is
        carried. The ranks' values add up to everything computed but not applied yet. A pass over
        the residuals: call it between steps, for checks and telemetry."""
        return owed_by_parameter(self.codecs, self._layouts(self._buckets), self.carry, self.topo.world)

    def residual_norm(self) -> float | None:
        """The L2 norm of every codec's error-feedback residuals (None without error feedback).
        A pass over the residuals: call it between steps, every few steps."""
        norms = [n for c in self.codecs if (n := c.residual_norm()) is not None]
        return math.sqrt(sum(n * n for n in norms)) if norms else None

    @property
    def last_stats(self) -> StepStats | None:
        return self.history[-1] if self.history else None

    # ------------------------------------------------------------------ state
    def signature(self) -> dict[str, Any]:
        """What a checkpoint must match: world, topology, scheme, codecs and parameters."""
        return {
            "world": self.topo.world,
            "nodes": self.topo.nodes,
            "per_node": self.topo.per_node,
            "scheme": self.scheme.name,
            "codecs": [c.spec() for c in self.codecs],
            "params": [f"{s.name}:{tuple(s.param.shape)}" for s in self.slots],
        }

    def state_dict(self) -> dict[str, Any]:
        """Engine and codec state: tensors and plain values only (``weights_only`` loads it).

        It is this rank's: residuals differ between ranks, so save one per rank."""
        if self._in_step:
            raise RuntimeError("gradsync: state_dict() during a step; call it after finish_sync()")
        return {
            "format": STATE_FORMAT,
            "rank": self.topo.rank,
            "signature": self.signature(),
            "step": self.step,
            "plan": None if self.plan is None else self.plan.to_state(),
            "codecs": [c.state_dict() for c in self.codecs],
            "closed_loop": self._loop_state(),
            "momentum": None if self.momentum is None else self.momentum.state_dict(),
            "carry": self.carry.state_dict(),
        }

    def _loop_state(self) -> dict[str, Any]:
        """The closed loop's progress and what a resumed run needs to go on re-planning: the
        calibrated links and the first step's order and ready times (plain values)."""
        state = self.loop.state_dict()
        if self._params is not None and self._first is not None:
            p = self._params
            state["links"] = [p.intra.alpha, p.intra.beta, p.inter.alpha, p.inter.beta, p.gamma]
            state["first_order"] = list(self._first.order)
            state["first_ready"] = [-1.0 if t is None else float(t) for t in self._first.ready_at]
        return state

    def _load_loop_state(self, state: dict[str, Any] | None) -> None:
        self.loop.load_state_dict(state)
        state = state or {}
        links, order, ready = state.get("links"), state.get("first_order"), state.get("first_ready")
        if links is None or order is None or ready is None or len(ready) != len(self.slots):
            self.loop.settled = True  # saved before the closed loop existed: keep the plan as it is
            return
        ai, bi, ao, bo, g = (float(v) for v in links)
        self._params = CostParams(Link(ai, bi), Link(ao, bo), g)
        self._first = FirstStep([int(i) for i in order], [None if t < 0 else float(t) for t in ready])

    def load_state_dict(self, state: dict[str, Any], reset_compression_state: bool = False) -> None:
        """Restore :meth:`state_dict`. A state saved under another world size, topology, scheme
        or model raises ``ValueError``, unless ``reset_compression_state``: then the step count
        is kept, the compression state starts afresh (with a warning) and the next step re-plans."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError(f"not a gradsync engine state (expected format {STATE_FORMAT!r})")
        mine, theirs = self.signature(), state.get("signature", {})
        diff = [k for k in mine if mine[k] != theirs.get(k)]
        if state.get("rank") != self.topo.rank and "world" not in diff:
            diff.append("rank")
        if diff:
            detail = "; ".join(f"{k}: saved {_short(theirs.get(k))} vs now {_short(mine[k])}" for k in diff)
            if not reset_compression_state:
                raise ValueError(
                    f"gradsync: the engine state was saved under a different setup ({detail}); pass "
                    "reset_compression_state=True to start the compression state afresh"
                )
            warnings.warn(
                f"gradsync: resetting the compression state, it was saved under a different setup ({detail})",
                stacklevel=2,
            )
            for codec in self.codecs:
                codec.reset_state()
            self.carry = Carry()
            self.momentum = sync_momentum(self.codecs)
            self.step = int(state.get("step", 0))
            self.plan = None
            self.loop.load_state_dict(None)
            self._set_buckets(self._initial_groups(), None)
            return
        for codec, cs in zip(self.codecs, state["codecs"], strict=True):
            codec.load_state_dict(cs)
        if self.momentum is not None and state.get("momentum") is not None:
            self.momentum.load_state_dict(state["momentum"])
        self.carry.load_state_dict(state.get("carry"))
        self.step = int(state["step"])
        if state["plan"] is not None:
            self._install_plan(Plan.from_state(state["plan"]))
            self._load_loop_state(state.get("closed_loop"))
            self._report_plan(0.0)

    def close(self) -> None:
        """Stop the threads and drop this step's tasks (nothing of them outlives the engine)."""
        self.manager.close()
        self._tasks = []
        self.join_work = None


def _short(v: object) -> str:
    text = repr(v)
    return text if len(text) < 120 else text[:117] + "..."
