"""The sync engine: buckets of gradients, synchronized by the plan, overlapped with backward.

Life of a step (driven by :mod:`gradsync.integrate.wrap`, which calls :meth:`SyncEngine.ready`
from per-parameter post-accumulate-grad hooks and :meth:`SyncEngine.finish` at the end of the
backward pass):

1. a gradient becomes ready: its bucket's count drops; once the bucket is complete, and every
   bucket before it has been launched, it is launched: its step program(s) go to the task
   manager (packing, then the plan's dense or compressed collective, then unpacking into
   ``.grad``; :mod:`gradsync.sync.bucket_sync`);
2. at the end of backward every bucket still waiting is launched (a parameter without a
   gradient counts as zero), optionally followed by a tiny all-reduce of the overflow flag and
   the used-parameter map (:mod:`gradsync.sync.flags`), then by the broadcast of rank 0's
   buffers (``broadcast_buffers``), and the engine waits for all of them;
3. after the first step the engine measures the link levels, times the codec, makes the plan on
   rank 0 from the gradient-ready order and times it observed, and broadcasts it; later the
   closed loop re-plans from what the buckets cost (:mod:`gradsync.planner.replan`).

Parameters as DDP leaves them:

- a parameter frozen during training (``requires_grad_(False)``, on every rank: the step check
  compares) counts as zero, and its ``.grad`` is left alone (None stays None); what error
  feedback sent of it goes back to its residual, and what is carried for it waits, until it
  trains again (:meth:`SyncEngine.owed_gradients` reports it meanwhile);
- "used" means: got a gradient in some backward pass since the last synchronization (the
  micro-batches under ``no_sync()`` included). A parameter no rank used keeps ``grad = None``.
  With ``find_unused_parameters`` (or ``check_steps=False``) the ranks agree on the used ones at
  every step; else they agree at the first step, and at every step after one in which some rank
  had a parameter without a gradient (the step check carries that flag): a model whose every
  parameter is used pays nothing after the first step, and a parameter no rank ever uses ends
  every step with ``grad = None``;
- ``broadcast_buffers``: after every synchronized step the buffers (BatchNorm statistics) are
  rank 0's, as DDP makes them before each forward pass (the same values at the next forward
  pass; under ``Join`` the highest rank still training is the source, as with DDP). It is a task
  like the buckets, so it takes its place in the step's order of collectives on gradsync's own
  process group, whatever the ranks do between steps.

The first ``dense_warmup_steps`` steps (at least one) are dense. Buckets launch in a fixed
order, the same on every rank, and the task manager issues their collectives in that order.
The codecs are a :class:`~gradsync.sync.codec_set.CodecSet`; what error feedback owes (the
codecs' streams, the carry of ended streams, the round an overflow undoes) is the
:class:`~gradsync.sync.ledger.Ledger`, the same object the DDP hook and FSDP2 drive; the
checkpoint format is :meth:`SyncEngine.state_dict`'s (a state saved under another world size,
topology, scheme, set of codecs or model is refused, or reset with a warning on request).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from gradsync.codecs import Compressor
from gradsync.collectives import primitives as P
from gradsync.collectives.program import Program
from gradsync.collectives.topology import Topology
from gradsync.integrate.engine_failure import Failure, SyncError
from gradsync.integrate.engine_layout import BucketLayout
from gradsync.planner.closed_loop import ClosedLoop, kept_streams
from gradsync.planner.decide import FirstStep
from gradsync.planner.engine_costs import EngineCosts
from gradsync.planner.explain import PlanReport, report_plan
from gradsync.planner.plan import Plan
from gradsync.planner.replan import Replanner
from gradsync.sync import host_reads
from gradsync.sync.bucket_sync import bucket_program, nonfinite_flag, unpacker
from gradsync.sync.buckets import Bucket, Slot
from gradsync.sync.carry import Carry, whole
from gradsync.sync.checkpoint import front_state, must_reset
from gradsync.sync.clipping import bucket_threshold, clip_, local_threshold
from gradsync.sync.codec_set import CodecSet
from gradsync.sync.config import SyncConfig
from gradsync.sync.flags import flags_program, read_flags, rescale_for_join
from gradsync.sync.ledger import Ledger
from gradsync.sync.momentum import SyncMomentum
from gradsync.sync.round import Round, RoundFlags
from gradsync.sync.scheme import Scheme
from gradsync.sync.sequence import EngineWords, LagClock, sequence_program, warn_forwards_apart
from gradsync.sync.stats import BucketStats, StepState, StepStats, bucket_stats, step_stats
from gradsync.sync.tasks import Task, TaskManager

__all__ = ["SyncEngine"]

log = logging.getLogger("gradsync")


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
        self.codec_set = CodecSet(config, self.scheme, topology)
        self.codecs: list[Compressor] = self.codec_set.codecs
        assert self.codec_set.resident is not None  # chosen at build: the topology knows the device
        self.resident: bool = self.codec_set.resident
        """Resident mode (:attr:`SyncConfig.resident`): nothing on the path waits for the host."""
        self.schemes: list[Scheme] = self.codec_set.schemes
        """The scheme each codec runs under (by codec id): the scheme's own, then the candidates'."""
        self.ledger = Ledger(self.codecs)
        self.round = Round(self.ledger)
        """The iteration around the ledger: its state and its end (:mod:`gradsync.sync.round`)."""
        """What error feedback owes: the codecs' streams, momentum correction's momentum and the
        carry, with the round that can undo them (:mod:`gradsync.sync.ledger`)."""
        self.slots = [Slot(i, n, p) for i, (n, p) in enumerate((n, p) for n, p in params if p.requires_grad)]
        self._numel = sum(s.numel for s in self.slots)
        self._clip_global = config.clip_local is not None and config.clip_local_mode == "global"
        """Local clipping over all gradients: no bucket may start before the backward pass ends."""
        self.active = topology.world > 1 or config.rehearse
        """Whether the engine synchronizes: with peers, or alone rehearsing (``rehearse``)."""
        self.check_overflow = (
            config.check_overflow if config.check_overflow is not None else grad_scaler is not None
        )
        topology.check_devices(s.param.device for s in self.slots)
        self.manager = TaskManager("gradsync", topology.device)
        self.step = 0  # completed steps
        self.replanner = Replanner(topology, config, self.scheme, self.codec_set, self.slots)
        self.loop: ClosedLoop = self.replanner.loop
        """The closed loop's state: re-plans done, settled, what each round decided."""
        self.enabled = True  # False inside no_sync()
        self.history: list[StepStats] = []
        self._lock = threading.Lock()
        self.layout = BucketLayout(self.slots, config.bucket_bytes)
        self._dense_flushed = False  # dense_from_step: the streams were ended for dense training
        self._in_step = False
        self.cur = StepState(len(self.slots))
        """The step in flight, or the last one (its tasks, for the figures of its buckets)."""
        self.forwards = 0
        """Forward passes that built a graph (train mode, gradients on), named by the step check
        when it fails. :class:`~gradsync.integrate.GradSync` counts them."""
        self.passes = 0
        """Backward passes that reached these parameters (``no_sync()`` ones included): the step
        check compares them across ranks. :class:`~gradsync.integrate.GradSync` counts them."""
        self.buffer_source: Callable[[], Iterable[torch.Tensor]] | None = None
        """The module's buffers, broadcast from rank 0 after every synchronized step
        (``broadcast_buffers``; :class:`~gradsync.integrate.GradSync` sets it)."""
        self._used_between = [False] * len(self.slots)
        """Per slot: got a gradient under ``no_sync()`` since the last synchronization."""
        self._frozen: list[int] = []  # this step: the slots whose requires_grad is off
        self._missed = False  # this rank had a parameter without a gradient in some step
        self._agree_use = False  # some rank had one: agree on the used parameters at every step
        self._agreeing = False  # this step's flags carry the used-parameter map
        self._synced_once = False  # the first synchronized step of this engine always agrees
        self._words: EngineWords | None = None  # this step's step check, once it ran
        self._forwards_warned = False
        self._check_task: Task | None = None
        self.join_work: Any = None  # Join's all-reduce of the ranks still training, this step
        self.join_divide_by_world = True
        self.failure = Failure(topology.rank)  # the first failure; every later call re-raises it
        self.report: PlanReport | None = None
        self.observers: list[Callable[[StepStats, list[Task], list[int]], None]] = []
        """Called on the training thread after every synchronized step with its stats, its tasks
        and each task's bucket (-1: the step check or flags). A timeline sets
        ``manager.record`` so that the tasks keep their spans."""
        self._lag = LagClock()
        if self.active:
            self.codec_set.check_fit(self.slots)

    # ------------------------------------------------------------------ layout
    @property
    def momentum(self) -> SyncMomentum | None:
        """Momentum correction (``ef:momentum``): the optimizer's momentum for what is sent
        densely (see :mod:`gradsync.sync.momentum`); None for other schemes."""
        return self.ledger.momentum

    @property
    def carry(self) -> Carry:
        """What error feedback owed to streams that ended, until a step applies it
        (:mod:`gradsync.sync.carry`)."""
        return self.ledger.carry

    @property
    def plan(self) -> Plan | None:
        """The plan in use (None before the first step's measurements)."""
        return self.layout.plan

    @property
    def _buckets(self) -> list[Bucket]:
        return self.layout.buckets

    @property
    def _compress(self) -> list[bool]:
        """Whether the plan compresses each bucket (read by checks of the layout)."""
        return [b.compress for b in self.layout.buckets]

    def codec_class(self, slot: Slot) -> int:
        """-1: never compressed; 0: the scheme's codec; 1: the codec for large tensors."""
        return self.codec_set.codec_class(slot)

    def codec_rejects(self, codec_id: int, slots: list[int], parts: int) -> str | None:
        """Why codec ``codec_id`` cannot compress a bucket of ``slots`` in ``parts`` parts (None
        when it can): the element counts its encode calls would see, checked by the codec."""
        return self.codec_set.rejects(self.slots, codec_id, slots, parts)

    # ------------------------------------------------------------------ the step
    def ready(self, index: int) -> None:
        """Slot ``index``'s gradient is final for this backward pass (called from its hook)."""
        if not self.active or not self.enabled:
            return
        with self._lock, self._failing():
            if not self._in_step:
                self._begin_step()
            if self.cur.ready_at[index] is not None:
                raise SyncError(
                    f"gradsync: the gradient of {self.slots[index].name!r} became ready twice in one "
                    "synchronized backward pass (backward called twice without finish_sync()? "
                    "use no_sync() for gradient accumulation)"
                )
            self.cur.ready_at[index] = time.perf_counter()
            self.cur.order.append(index)
            bucket = self._buckets[self.layout.bucket_of[index]]
            bucket.pending -= 1
            if self.config.overlap and not self._clip_global:
                while self.cur.next < len(self._buckets) and self._buckets[self.cur.next].pending == 0:
                    self._launch(self.cur.next)

    def note_used(self, index: int) -> None:
        """Slot ``index`` got a gradient in a backward pass under ``no_sync()``: it counts as used
        at the next synchronization."""
        self._used_between[index] = True

    def backward_ended(self) -> None:
        """The backward pass is over (its remaining work is this engine's)."""
        self.cur.backward_end_at = time.perf_counter()

    def finish(self) -> StepStats | None:
        """Launch what is left, wait for every bucket and make ``.grad`` final. Idempotent."""
        if not self.active or not self.enabled:
            return None
        with self._lock, self._failing():
            if not self._in_step:
                return None
            if not self.cur.backward_end_at:
                self.cur.backward_end_at = time.perf_counter()
            in_backward = self.cur.next
            if self._clip_global and not self.cur.shadow:
                self._clip_all()  # nothing was launched yet: see ready()
            while self.cur.next < len(self._buckets):
                self._launch(self.cur.next)
            flags = self._flags_task()
            self._buffers_task()
        return self._complete(in_backward, flags)

    def _clip_all(self) -> None:
        """``clip_local`` in ``global`` mode: this rank's gradients, all together, before any
        bucket packs them (so before the error-feedback residual is added)."""
        assert self.config.clip_local is not None
        grads = [s.param.grad for s in self.slots if s.param.grad is not None]
        bound = local_threshold(self.config.clip_local, self.topo.world)
        clip_(grads, bound, self.cur.loss_scale)

    @property
    def acts_alone(self) -> bool:
        """A world of one rank with something to do at the end of a backward pass (see
        :meth:`finish_alone`)."""
        return not self.active and (self.config.clip_local is not None or self.momentum is not None)

    def finish_alone(self) -> None:
        """A world of one rank synchronizes nothing, but ``clip_local`` still clips and momentum
        correction still applies the momentum: once per synchronizing backward pass (the wrapper
        calls this at its end; :func:`finish_one_rank`)."""
        if not self.active and self.enabled:
            finish_one_rank(self.slots, self.config.clip_local, self.momentum, self.grad_scaler)

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
            self.cur.backward_end_at = time.perf_counter()
            for b in self._buckets:
                b.pending = 0
            while self.cur.next < len(self._buckets):
                self._launch(self.cur.next)
            flags = self._flags_task()
            self._buffers_task()
        return self._complete(0, flags)

    def _complete(self, in_backward: int, flags: torch.Tensor | None) -> StepStats:
        with self._failing():
            self.manager.wait(self.cur.tasks, timeout=self.config.timeout_s)
            self.codec_set.own_density(self.step)
            agreed = RoundFlags()
            if flags is not None:
                tracked = [s.name for s in self.slots] if self._agreeing else []
                agreed = RoundFlags.from_values(read_flags(flags), tracked)
            for s in self.slots:
                if s.name in agreed.unused:
                    s.param.grad = None  # no rank used it: leave it as DDP would
            # what error feedback sent of a frozen parameter never reaches it: owed still
            frozen = {self.slots[i].name for i in self._frozen}
            if not self.cur.shadow:
                self._note_missing()
            self._note_forwards()
            if self.join_work is not None:
                work, self.join_work = self.join_work, None
                rescale_for_join(
                    work, self.join_divide_by_world, self.cur.shadow, self.slots, self.topo.world
                )
            cur = self.cur
            self.round.end(
                agreed, poison=self._poison, layouts=self.layout.layouts, give_back=frozen,
                settle=lambda back: self.ledger.apply_agreed(self.slots, back, cur.shadow, cur.loss_scale),
            )  # fmt: skip
            stats = self._stats(in_backward, agreed.overflow)
            for observe in list(self.observers):  # an observer may leave
                observe(stats, self.cur.tasks, self.cur.task_bucket)
            self.history.append(stats)
            if len(self.history) > 1000:
                del self.history[:-1000]
            self.step += 1
            self._in_step = False
            self._synced_once = True
            self._used_between = [False] * len(self.slots)
            shadow, self.cur.shadow = self.cur.shadow, False
            if self.plan is None:
                self._make_plan()
            elif self.replanner.due(stats, not agreed.overflow and not shadow, self.cur.ready_at):
                t0 = time.perf_counter()
                if self.replanner.round(self.plan, len(self._buckets), self.step, self._switch_plan):
                    self._report_plan(time.perf_counter() - t0)
            dense_from = self.config.dense_from_step
            if dense_from is not None and self.step >= dense_from and not self._dense_flushed:
                self._dense_flushed = True
                self._end_all_streams()
        return stats

    def _poison(self) -> None:
        """Some rank overflowed: every rank skips the step (its GradScaler sees NaN)."""
        for s in self.slots:
            if s.param.grad is not None:
                s.param.grad.fill_(float("nan"))

    def _note_missing(self) -> None:
        """After a step: did a parameter get no gradient on this rank (frozen ones aside)? The
        next step checks tell every rank, and from then on each step agrees which were used."""
        missing = [
            s.name for i, s in enumerate(self.slots)
            if self.cur.ready_at[i] is None and not self._used_between[i] and s.param.requires_grad
        ]  # fmt: skip
        if not missing:
            return
        if not self._agreeing and not self._missed:
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            warnings.warn(
                f"gradsync: {missing[0]!r}{more} got no gradient on rank {self.topo.rank} in step "
                f"{self.step} and counted as zero in the mean (find_unused_parameters is off). From "
                "the next step on the ranks agree at every step which parameters some rank used; those "
                "no rank used keep grad None, as with DDP(find_unused_parameters=True). Pass "
                "find_unused_parameters=True to have that at every step",
                RuntimeWarning,
                stacklevel=2,
            )
        self._missed = True

    def _note_forwards(self) -> None:
        """Once: the ranks' forward counts were apart (see :func:`warn_forwards_apart`)."""
        if not self._forwards_warned:
            self._forwards_warned = warn_forwards_apart(self._words, f"step {self.step}")

    def _failing(self) -> contextlib.AbstractContextManager[None]:
        return self.failure.guard(lambda: self.step, self._leave_step)

    def _leave_step(self) -> None:
        self._in_step = False
        self.cur.shadow = False

    def _begin_step(self, shadow: bool = False) -> None:
        self._in_step = True
        self.manager.take_traffic()
        for b in self._buckets:
            b.pending = len(b.slots)
            b.launched_at = 0.0
        cfg = self.config
        dense = (
            self.plan is None
            or self.step < cfg.dense_warmup_steps
            or (cfg.dense_from_step is not None and self.step >= cfg.dense_from_step)
        )
        scale = 1.0
        if self.grad_scaler is not None and self.grad_scaler.is_enabled():
            scale = host_reads.read_loss_scale(self.grad_scaler)  # once per step
        self.cur = StepState(len(self.slots), dense, shadow, scale)
        self._frozen = [s.index for s in self.slots if not s.param.requires_grad]
        if self._frozen:
            frozen = set(self._frozen)
            for b in self._buckets:
                b.skip = frozenset(j for j, s in enumerate(b.slots) if s.index in frozen)
                b.pending -= len(b.skip)
        elif any(b.skip for b in self._buckets):
            for b in self._buckets:
                b.skip = frozenset()
        self.round.begin()
        self.codec_set.set_density(self.step, self.config.log_plan and self.topo.rank == 0)
        self._words, self._check_task = None, None
        if cfg.check_steps:  # before any bucket: see gradsync.sync.sequence
            words = EngineWords(None if shadow else self.passes, _signature(self._frozen), self._missed)
            program = sequence_program(
                self.topo, self.step, None if shadow else self.forwards, self._lag, words
            )
            self._words, self._check_task = words, self.manager.submit(program, "step check")
            self.cur.tasks.append(self._check_task)
            self.cur.task_bucket.append(-1)

    def _launch(self, b: int) -> None:
        bucket = self._buckets[b]
        compress = bucket.compress and not self.cur.dense
        parts = bucket.parts if compress else 1
        bucket.parts_left = parts
        bucket.launched_at = time.perf_counter()
        done = unpacker(bucket, compress, self.cur.shadow, self.momentum, self.cur.loss_scale)
        for part in range(parts):
            program = self._program(bucket, part, parts, compress)
            name = f"bucket {b} [{bucket.key}]" + (f" part {part + 1}/{parts}" if parts > 1 else "")
            self.cur.tasks.append(self.manager.submit(program, name, done))
            self.cur.task_bucket.append(b)
        self.cur.next = b + 1

    def _program(self, bucket: Bucket, part: int, parts: int, compress: bool) -> Program:
        if part == 0:
            if self.cur.shadow:
                bucket.detach()  # a joined rank's own gradients stay as they were
                bucket.flat.zero_()
            else:
                bucket.pack()
                if self.config.clip_local is not None and not self._clip_global:
                    bound = bucket_threshold(
                        self.config.clip_local, self.topo.world, bucket.numel, self._numel
                    )
                    clip_([bucket.flat], bound, self.cur.loss_scale)
                if self.carry.local:  # what ended streams owed: sent with the gradient
                    # (not a frozen parameter's: it waits until the parameter trains again)
                    members = [
                        ("" if j in bucket.skip else s.name, s.numel) for j, s in enumerate(bucket.slots)
                    ]
                    self.ledger.inject(bucket.flat, whole(members), self.cur.loss_scale)
            if self.check_overflow:  # stays on the device: read once, after the flags' all-reduce
                self.cur.nonfinite.append(nonfinite_flag(bucket.flat))
        lo, hi = bucket.part_range(part, parts)
        ws = bucket.workspace(part)
        rehearse = self.config.rehearse
        if not compress:
            return bucket_program(bucket.flat[lo:hi], self.topo, self.scheme, None, bucket.key,
                                  self.cur.loss_scale, ws, bucket.dense_algorithm,
                                  resident=self.resident, rehearse=rehearse)  # fmt: skip
        codec, scheme = self.codecs[bucket.codec_id], self.schemes[bucket.codec_id]
        lowrank_parts = None
        if codec.per_tensor:
            lowrank_parts = [(bucket.view(j), s.name) for j, s in enumerate(bucket.slots)]
        key = bucket.key if parts == 1 else f"{bucket.key}#{part}"
        return bucket_program(
            bucket.flat[lo:hi], self.topo, scheme, codec, key, self.cur.loss_scale, ws,
            lowrank_parts=lowrank_parts, offset=lo, rehearse=rehearse,
        )  # fmt: skip

    def _agrees_use(self) -> bool:
        """Whether this step agrees which parameters some rank used: always with
        ``find_unused_parameters`` (or without the step check, which would tell); else at the
        engine's first step, and at every step once some rank had a parameter without a gradient
        (the step check tells, the same on every rank)."""
        if self.config.find_unused_parameters or not self._synced_once or self._agree_use:
            return True
        if self._check_task is None or self._words is None:
            return True
        self.manager.wait([self._check_task], timeout=self.config.timeout_s)  # passed long ago
        self._agree_use = self._words.any_missed
        return self._agree_use

    def _flags_task(self) -> torch.Tensor | None:
        """Submit the step's flag all-reduce (overflow, used parameters) if it is needed."""
        self._agreeing = unused = self._agrees_use()
        if not (self.check_overflow or unused):
            return None

        ready_at, between = self.cur.ready_at, list(self._used_between)

        def used() -> list[float]:  # runs after every bucket's packing
            return [float(t is not None or u) for t, u in zip(ready_at, between, strict=True)]

        program, flags = flags_program(
            self.topo, self.cur.nonfinite, used if unused else None, len(self.slots) if unused else 0
        )
        self.cur.tasks.append(self.manager.submit(program, "step flags"))
        self.cur.task_bucket.append(-1)
        return flags

    def _buffers_task(self) -> None:
        """``broadcast_buffers``: submit the broadcast of the source rank's buffers (rank 0's;
        under ``Join`` the highest rank still training, found by one more all-reduce)."""
        if self.buffer_source is None:
            return
        buffers = [b for b in self.buffer_source() if b.numel()]
        if not buffers:  # the same on every rank: the same model
            return
        in_join = self.cur.shadow or self.join_work is not None
        program = buffers_program(buffers, self.topo, (not self.cur.shadow) if in_join else None)
        self.cur.tasks.append(self.manager.submit(program, "buffers"))
        self.cur.task_bucket.append(-1)

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
        plan = self.replanner.first_plan(FirstStep(list(self.cur.order), list(self.cur.ready_at)))
        self._install_plan(plan)
        self._report_plan(time.perf_counter() - t0)

    def use_plan(self, plan: Plan) -> list[str]:
        """Run ``plan`` from the next step on, a plan made elsewhere for this engine's slots and
        codecs (``Replanner.plan_for``: what ``auto`` would pick on another cluster; ``gradsync
        bench gpu-step`` rehearses it in a world of one). Between steps, on every rank alike, after
        the first step. As a re-plan switches: the streams of the buckets it changes end and what
        they owed is carried (their keys are returned); the closed loop goes on from it."""
        if self._in_step or self.plan is None:
            raise RuntimeError("gradsync: use_plan() between steps, after the first one")
        bad = sorted({i for b in plan.buckets for i in b.slots} ^ set(range(len(self.slots))))
        ids = {b.codec_id for b in plan.buckets if b.compress}
        if bad or any(not 0 <= i < len(self.codecs) for i in ids):
            raise ValueError("gradsync: use_plan(): the plan is not one of this engine's slots and codecs")
        carried = self._switch_plan(plan)
        self._report_plan(0.0)
        return carried

    def _switch_plan(self, plan: Plan) -> list[str]:
        """Install ``plan`` between steps. The compression state of the buckets it keeps stays;
        the streams of the buckets it changes end, and what they owed is carried to their
        parameters (their keys are returned)."""
        assert self.plan is not None
        old_plan, old = self.plan, self._buckets
        self._install_plan(plan)
        names = [s.name for s in self.slots]
        keep, ended = kept_streams(
            old_plan, [b.key for b in old], plan, [b.key for b in self._buckets], names,
            self.codec_set.per_tensor,
        )  # fmt: skip
        taken = self._end_streams(keep, ended, old)
        self.loop.restart()
        return taken

    def _end_all_streams(self) -> list[str]:
        """``dense_from_step``: every stream ends; what they owed goes into the dense steps."""
        assert self.plan is not None
        ended = sorted(i for b in self.plan.buckets if b.compress for i in b.slots)
        return self._end_streams({}, ended, self._buckets)

    def _end_streams(
        self, keep: dict[int, Callable[[str], bool]], ended: list[int], buckets: list[Bucket]
    ) -> list[str]:
        slots = [self.slots[i] for i in ended]
        return self.ledger.end_streams(keep, self.layout.layouts(buckets), ended=slots, topo=self.topo)

    def _report_plan(self, seconds: float) -> None:
        """Say what the plan compresses and why the rest is not (:func:`report_plan`)."""
        assert self.plan is not None
        self.report = report_plan(
            self.plan, self.slots, self.codec_set, self.config, self.topo, seconds, self.plan_table
        )

    def _install_plan(self, plan: Plan) -> None:
        self.layout.install(plan, self.codecs)

    def plan_table(self) -> str:
        """The plan as a readable table (empty before the first step)."""
        return self.layout.table(self.scheme, self.codecs, self.schemes)

    # ------------------------------------------------------------------ stats
    def _stats(self, launched_in_backward: int, overflow: bool) -> StepStats:
        lag = (self._lag.wait_s, self._lag.lag_s) if self.config.check_steps else (None, None)
        return step_stats(
            self.step, self.cur, self._buckets, launched_in_backward, overflow, self.manager.take_traffic(),
            self.topo.world, lag, self.codec_set.density,
        )  # fmt: skip

    def current_bucket_stats(self) -> list[BucketStats]:
        """Each bucket's figures of the current step, computed as the step's statistics compute them."""
        return bucket_stats(self._buckets, self.cur)

    def costs(self) -> EngineCosts | None:
        """What synchronization cost in this engine, as the closed loop's last round refitted it
        (:mod:`gradsync.planner.engine_costs`; ``gradsync whatif --costs`` reads it); None where no
        round ran, and on every rank but 0 (rank 0 refits)."""
        fit, t = self.replanner.last_refit, self.topo
        if fit is None:
            return None
        return EngineCosts.from_refit(
            fit, [c.spec() for c in self.codecs], t.nodes, t.per_node, self.scheme.name
        )

    def owed_gradients(self) -> dict[str, torch.Tensor]:
        """What this rank still owes the synchronized (mean) gradient, per parameter name, flat
        and unscaled: error feedback's residuals traced back to their parameters, and what is
        carried. The ranks' values add up to everything computed but not applied yet. A pass over
        the residuals: call it between steps, for checks and telemetry."""
        return self.ledger.owed_gradients(self.layout.layouts(), self.topo.world)

    def residual_norm(self) -> float | None:
        """The L2 norm of every codec's error-feedback residuals (None without error feedback).
        A pass over the residuals: call it between steps, every few steps."""
        return self.ledger.residual_norm()

    @property
    def last_stats(self) -> StepStats | None:
        return self.history[-1] if self.history else None

    # ------------------------------------------------------------------ state
    def signature(self) -> dict[str, Any]:
        """What a checkpoint must match: world, topology, scheme, codecs and parameters."""
        topo, codecs = self.topo, self.codec_set
        return {
            "world": topo.world,
            "nodes": topo.nodes,
            "per_node": topo.per_node,
            "scheme": codecs.scheme.name,
            "codecs": [c.spec() for c in codecs.codecs],
            "params": [f"{s.name}:{tuple(s.param.shape)}" for s in self.slots],
        }

    def state_dict(self) -> dict[str, Any]:
        """Engine and codec state (in the envelope of :mod:`gradsync.sync.checkpoint`): the codecs'
        streams (error-feedback residuals, PowerSGD factors, RNG states, reused thresholds), the
        momentum of momentum correction, what is carried for ended streams, the step count, the
        plan and the closed loop's progress. Tensors and plain values only (``weights_only``
        loads it). It is this rank's: residuals differ between ranks, so save one per rank."""
        if self._in_step:
            raise RuntimeError("gradsync: state_dict() during a step; call it after finish_sync()")
        return front_state(
            STATE_FORMAT, self.topo.rank, self.signature(), self.step, self.ledger,
            plan=None if self.plan is None else self.plan.to_state(),
            closed_loop=self.replanner.state_dict(),
        )  # fmt: skip

    def load_state_dict(self, state: dict[str, Any], reset_compression_state: bool = False) -> None:
        """Restore :meth:`state_dict`. A state saved under another world size, topology, scheme
        or model raises ``ValueError``, unless ``reset_compression_state``: then the step count
        is kept, the compression state starts afresh (with a warning) and the next step re-plans."""
        if must_reset(state, self.signature(), self.topo.rank, reset_compression_state, STATE_FORMAT):
            self.ledger.reset()
            self.step = int(state.get("step", 0))
            self.loop.load_state_dict(None)
            self.layout.reset()
            return
        self.ledger.load_state_dict(state)
        self.step = int(state["step"])
        if state["plan"] is not None:
            self.layout.install(Plan.from_state(state["plan"]), self.codecs)
            self.replanner.load_state_dict(state.get("closed_loop"))
        if self.plan is not None:
            self._report_plan(0.0)

    def close(self) -> None:
        """Stop the threads and drop this step's tasks (nothing of them outlives the engine)."""
        self.manager.close()
        self.cur.tasks = []
        self.join_work = None


STATE_FORMAT = "gradsync.sync/1"
"""The format of :meth:`SyncEngine.state_dict`."""


def _signature(frozen: list[int]) -> int:
    """A number that tells one set of frozen slot indices from another (the step check compares)."""
    return sum((i + 1) * 2654435761 % (1 << 31) for i in frozen) + len(frozen)


def buffers_program(buffers: list[torch.Tensor], topo: Topology, training: bool | None) -> Program:
    """Make every rank's ``buffers`` the source rank's: rank 0, or with ``training`` given (under
    ``Join``) the highest rank for which it is True. One broadcast per dtype and device."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for b in buffers:
        groups.setdefault((b.dtype, b.device), []).append(b)
    flats = [
        torch.cat([b.detach().reshape(-1) for b in group]).to(topo.comm_device) for group in groups.values()
    ]
    src = 0
    if training is not None:
        who = torch.tensor([topo.rank if training else -1], dtype=torch.int64, device=topo.comm_device)
        yield partial(P.all_reduce, who, topo.world_group, "world", op=dist.ReduceOp.MAX)
        src = int(who.item())
    for flat in flats:
        yield partial(P.broadcast, flat, topo.global_rank(src), topo.world_group, "world")

    def finish() -> None:
        if topo.rank == src:
            return
        with torch.no_grad():  # .data: no version bump (a graph that saved a buffer stays valid)
            for group, flat in zip(groups.values(), flats, strict=True):
                at = 0
                for b in group:
                    b.data.copy_(flat[at : at + b.numel()].view_as(b))
                    at += b.numel()

    return finish


def finish_one_rank(
    slots: Sequence[Slot], clip_local: float | None, momentum: SyncMomentum | None, grad_scaler: Any | None
) -> None:
    """``clip_local`` clips the gradients (plain clipping: the bound for one rank) and momentum
    correction applies the momentum, unless the GradScaler will skip this step (inf/NaN in the
    gradients: the momentum stays as it was)."""
    scaled = grad_scaler is not None and bool(grad_scaler.is_enabled())
    scale = float(grad_scaler.get_scale()) if grad_scaler is not None and scaled else 1.0
    if clip_local is not None:
        grads = [s.param.grad for s in slots if s.param.grad is not None]
        clip_(grads, local_threshold(clip_local, 1), scale)
    if momentum is None:
        return
    live = [(s.name, g) for s in slots if (g := s.param.grad) is not None]
    if scaled and live:  # one read of the flags (kept on the device until then)
        home = live[0][1].device
        if not bool(torch.stack([torch.isfinite(g).all().to(home) for _, g in live]).all()):
            return
    momentum.begin_round()
    momentum.dense([n for n, _ in live], [g for _, g in live], scale)
