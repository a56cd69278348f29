"""One worker of ``gradsync train``: started by torchrun (or by ``gradsync train``, which runs
torchrun's launcher), it joins the world, builds data, model, gradsync and optimizer, and trains.

The trajectory is a function of the options and the seed: the model starts from ``seed`` on
every rank (and rank 0's copy is broadcast), every rank then draws from its own stream
(``seed + rank``, for dropout), the data order of an epoch comes from ``seed + epoch``, and the
codecs draw from their own seeded generators. A checkpoint stores all of that state, so a
resumed run continues exactly where the interrupted one was.

This module holds the :class:`Trainer`: its set-up, one step (micro-batches for gradient
accumulation, the optimizer step, the check that stops every rank together once the loss or the
parameters stop being finite), the validation pass, the run over the epochs and what it reports,
saving and resuming (:mod:`~gradsync.apps.train.checkpoint` writes and reads the files); and the
worker's entry point.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import signal
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.apps.command_line import command_line
from gradsync.apps.data import DataBundle, PrefetchLoader, ShardedSampler, build_data
from gradsync.apps.data.cache.partition import PartitionSampler
from gradsync.apps.data.loader import load_batch
from gradsync.apps.models import build_model_for, parameter_count
from gradsync.apps.process_group import init_default_group
from gradsync.apps.train import checkpoint
from gradsync.apps.train.epoch_plan import epoch_plan
from gradsync.apps.train.metrics import EpochMeter, cache_figures, epoch_record
from gradsync.apps.train.optim import (
    OptimizerOptions,
    build_optimizer,
    build_scheduler,
    compressed_options,
    optimizer_kind,
)
from gradsync.apps.train.options import (
    batch_plan,
    cache_config,
    clip_where,
    ft_lighthouse,
    ft_node_index,
    scaled_lr,
    sync_config,
    trace_steps,
)
from gradsync.apps.train.outer import NodeSync
from gradsync.apps.train.pto_choice import PtoChoice, choose_pto
from gradsync.apps.train.resize import resize
from gradsync.collectives import Topology
from gradsync.collectives.primitives import comm_device
from gradsync.observe.telemetry import format_line, step_record
from gradsync.observe.trace import TraceRecorder
from gradsync.optim.layerwise import LayerwiseOptimizer
from gradsync.sync import Scheme


class TrainingDiverged(RuntimeError):
    """The training loss (or the parameters) stopped being finite; raised on every rank at the
    same step."""


# one step's finiteness flags: the all-reduce (None in a world of one), its tensor (lowest and
# highest rank with a non-finite loss, whether it was NaN, lowest rank with non-finite
# parameters; ranks encoded so that MAX combines them), and where the step was
StepFlags = tuple[Any, torch.Tensor, str]

_HINT = "lower --lr, add --clip-grad, or check the data"


def _verdict(flags: StepFlags, world: int, quiet: bool = False) -> None:
    """Wait for one step's flags and raise :class:`TrainingDiverged` if they say so."""
    work, t, where = flags
    if work is not None:
        work.wait()
    if quiet:
        return
    low_loss, high_loss, nan, low_params = t.tolist()
    if low_loss > 0:
        lowest, highest = world - int(low_loss), int(high_loss) - 1
        ranks = f"rank {lowest}" if lowest == highest else f"ranks {lowest} to {highest}"
        kind = "nan" if nan > 0 else "inf"
        raise TrainingDiverged(f"the training loss became {kind} {where} on {ranks}; {_HINT}")
    if low_params > 0:
        raise TrainingDiverged(
            f"the model's parameters became non-finite (nan or inf) {where}, first seen on rank "
            f"{world - int(low_params)}; {_HINT}"
        )


def accumulated_backward(
    model: gradsync.GradSync | NodeSync,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    parts: int,
    autocast: Callable[[], AbstractContextManager[Any]] = nullcontext,
    scaler: torch.amp.GradScaler | None = None,
) -> float:
    """Forward and backward over a worker's batch in ``parts`` equal micro-batches (gradient
    accumulation, ``--global-batch``): all but the last under ``model.no_sync()``, so their
    gradients add up locally and the last backward synchronizes the sum; each loss is divided by
    ``parts``, so the gradient is that of the whole batch's mean loss. Returns that mean loss."""
    total = 0.0
    pieces = list(zip(x.chunk(parts), y.chunk(parts), strict=True))
    for i, (xs, ys) in enumerate(pieces):
        last = i == len(pieces) - 1
        with nullcontext() if last else model.no_sync():
            with autocast():
                loss = loss_fn(model(xs), ys) / len(pieces)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        total += float(loss.detach())
    return total


__all__ = [
    "DEFAULT_MODEL",
    "Trainer",
    "TrainingDiverged",
    "accumulated_backward",
    "default_model",
    "run_worker",
]

DEFAULT_MODEL = {"classify": "vgg-small", "lm": "lstm"}


def default_model(task: str) -> str:
    return DEFAULT_MODEL[task]


class Trainer:
    """The state of one worker's run; :meth:`run` trains and returns the summary (rank 0)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        torch.set_num_threads(args.threads)
        self.device = self._join()
        self.ft_node = ft_node_index(args) if args.fault_tolerant else None
        """This node's index under ``--fault-tolerant`` (then the world is the node's own)."""
        if self.ft_node is not None:
            self.topo = Topology(1, dist.get_world_size())
        else:
            self.topo = Topology(args.nodes, args.per_node) if args.nodes else Topology()
        self.rank, self.world = self.topo.rank, self.topo.world
        self.node = self.rank // self.topo.per_node if self.ft_node is None else self.ft_node
        # the data is sharded over every rank of every node (under --fault-tolerant the world is one node's)
        self.data_rank = self.rank if self.ft_node is None else self.ft_node * self.world + self.rank
        self.data_world = self.world if self.ft_node is None else args.nodes * self.world
        self.partitioned = args.cache is not None and args.cache_shuffle == "partition"
        """Each rank reads a fixed part of the data (``--cache``): the node's store holds only its part."""
        self.data: DataBundle = build_data(
            args.data, seq_len=args.seq_len, seed=args.seed, cache=cache_config(args, self.node)
        )
        self.model_name = args.model or default_model(self.data.task)
        torch.manual_seed(args.seed)  # identical initial weights everywhere (wrap broadcasts rank 0's)
        net = build_model_for(self.model_name, self.data.task, self.data.input_shape, self.data.num_classes)
        net = net.to(self.device)
        self.grad_bytes = sum(p.numel() * 4 for p in net.parameters() if p.requires_grad)
        self.sampler: ShardedSampler | PartitionSampler
        if self.partitioned:
            self.sampler = PartitionSampler(
                len(self.data.train), self.data_rank, self.data_world, seed=args.seed
            )
        else:
            self.sampler = ShardedSampler(
                len(self.data.train), self.data_rank, self.data_world, seed=args.seed
            )
        native = self.data.input_shape[-1] if self.data.task == "classify" else None
        self.plan = epoch_plan(args, self.data_world, len(self.sampler), native)
        self.accumulation = self.plan.accumulation
        self.loader = PrefetchLoader(self.data.train, self.sampler, self.plan.per_worker[0], drop_last=True)
        if min(self.plan.steps) == 0:
            epoch = self.plan.steps.index(0)
            raise ValueError(
                f"a worker's batch of {self.plan.per_worker[epoch]} is larger than its share of the "
                f"training data ({len(self.sampler)} samples on each of {self.world} workers)"
            )
        cuda = self.device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if args.amp and cuda else None
        self.config = sync_config(args, self.plan.to_steps)
        self.clip_after_sync = clip_where(args, self.config) == "sync"
        """``--clip-grad`` on the synchronized gradient (else the engine clips locally, or nothing)."""
        self.outer: gradsync.OuterLoop | None = None
        self.outer_trace: TraceRecorder | None = None
        self.model: gradsync.GradSync | NodeSync
        self._healed: dict[str, Any] | None = None  # a peer's position, until the optimizer exists
        self._repositioned = False  # healed inside a step: the data position jumped
        if args.outer is not None and self.ft_node is not None:  # torchft forms the meetings
            from gradsync.outer.ft import FaultTolerance, FaultTolerantOuterLoop

            lighthouse = ft_lighthouse(args)
            assert lighthouse is not None  # (checked with the options)
            fault = FaultTolerance(
                lighthouse=lighthouse, replica_id=f"node{self.ft_node}", nodes=args.nodes,
                min_nodes=args.min_nodes or 1, timeout_s=args.timeout,
                quorum_timeout_s=max(600.0, args.timeout), join_timeout_s=max(600.0, args.timeout),
            )  # fmt: skip
            self.outer = FaultTolerantOuterLoop(
                net, fault_tolerance=fault, every=args.outer, codec=args.outer_codec, outer_lr=args.outer_lr,
                outer_momentum=args.outer_momentum, fragments=args.fragments, topology=self.topo,
                extra_state={"gradsync.train": (self._load_position, self._position_state)},
            )  # fmt: skip
        elif args.outer is not None:  # each node alone for H steps, then the outer loop
            self.outer = gradsync.OuterLoop(
                net, every=args.outer, codec=args.outer_codec, outer_lr=args.outer_lr,
                outer_momentum=args.outer_momentum, fragments=args.fragments, delay=args.outer_delay,
                mix=args.outer_mix, topology=self.topo,
            )  # fmt: skip
        if args.outer is not None:
            assert self.outer is not None
            # inside the node: --scheme when it is dense (the default names none: a flat ring)
            dense = Scheme.parse(args.scheme).kind == "dense"
            inner = replace(self.config, scheme=args.scheme if dense else "flat")
            self.model = NodeSync(net, self.outer, inner, self.scaler)
            if args.trace:  # the inner steps on the training thread, the exchanges on gradsync's
                self.outer_trace = TraceRecorder(
                    self.topo, trace_steps(args.trace_steps) if args.trace_steps else None
                )
                self.outer.trace(self.outer_trace)
        else:
            self.model = gradsync.wrap(
                net,
                self.config,
                self.topo,
                grad_scaler=self.scaler,
                trace=args.trace,
                trace_steps=trace_steps(args.trace_steps) if args.trace else None,
            )
        self.net = net
        self.self_syncing = optimizer_kind(args.optimizer).self_syncing
        """The optimizer synchronizes the model (compressed momentum): the engine must not."""
        self._local_gradients = contextlib.ExitStack()
        if self.self_syncing:
            if self.scaler is not None:
                raise ValueError(
                    f"--optimizer {args.optimizer} does not support a GradScaler (--amp on a GPU)"
                )
            assert isinstance(self.model, gradsync.GradSync)  # (--outer refuses these optimizers)
            self._local_gradients.enter_context(self.model.no_sync())  # for the whole run
        lr = args.lr if args.lr is not None else optimizer_kind(args.optimizer).lr
        base_lr = scaled_lr(lr, args, self.data_world, self.plan.global_batch(0))
        self.optimizer = build_optimizer(
            net,
            args.optimizer,
            base_lr,
            args.weight_decay,
            OptimizerOptions(
                momentum=args.momentum,
                nesterov=args.nesterov,
                trust_coefficient=args.trust_coefficient,
                parallel=self._pto_group() if args.pto == "on" else None,
                compressed=compressed_options(args, self.plan.total_steps) if self.self_syncing else None,
                topology=self.topo,
            ),
        )
        self.pto_choice: PtoChoice | None = None
        if args.pto == "auto" and self.world > 1 and isinstance(self.optimizer, LayerwiseOptimizer):
            group = self._pto_group()
            assert group is not None  # a world of more than one
            self.pto_choice = choose_pto(self.optimizer, group, self.topo)
            if self.rank == 0:
                print(f"gradsync train: {self.pto_choice.line()}", file=sys.stderr, flush=True)
        ratios = [scaled_lr(lr, args, self.data_world, self.plan.global_batch(e)) / base_lr
                  for e in range(self.plan.epochs)]  # fmt: skip
        self.scheduler = build_scheduler(
            self.optimizer,
            args.schedule,
            self.plan.to_steps(args.warmup_epochs),
            self.plan.total_steps,
            args.poly_power,
            None if self.plan.uniform else (lambda s: ratios[self.plan.epoch_of_step(s)]),
        )
        torch.manual_seed(args.seed + 1 + self.rank)  # per-rank stream (dropout)
        self.epoch, self.batch, self.global_step = 0, 0, 0
        self.meter = EpochMeter()
        self.history: list[dict[str, Any]] = []
        self.telemetry: list[dict[str, Any]] = []  # rank 0's step records, every --log-every steps
        self._unchecked: StepFlags | None = None  # the last step's finiteness flags, in flight
        self.outer_met = False  # whether the outer loop's shared parameters moved at the last step
        if self._healed is not None:  # healed while joining: the peer's optimizer, schedule, position
            self._apply_position(self._healed, joining=True)
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if args.checkpoint_dir and (args.resume or restarted):
            self._resume()

    # ------------------------------------------------------------------ live recovery
    def _position_state(self) -> dict[str, Any]:
        """What a node healing from this one takes besides the outer loop's state (the model,
        the anchors): the inner optimizer, the schedule and the data position. Taken inside a
        meeting, before this step's counters advance."""
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "global_step": self.global_step,
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "scheduler": self.scheduler.state_dict(),
            "history": copy.deepcopy(self.history),
        }

    def _load_position(self, state: dict[str, Any]) -> None:
        if not hasattr(self, "scheduler"):  # joining: the optimizer is not built yet
            self._healed = state
            return
        self._apply_position(state, joining=False)

    def _apply_position(self, state: dict[str, Any], joining: bool) -> None:
        """Take a peer's position. Inside a step the loop then advances the counters as the
        peer's own loop does; a node that healed while joining starts at the next batch. The
        batches this node's shard had between its failure and now are skipped."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.history = list(state["history"])
        self.epoch, self.batch, self.global_step = (
            int(state["epoch"]),
            int(state["batch"]),
            int(state["global_step"]),
        )
        if joining:
            self.batch, self.global_step = self.batch + 1, self.global_step + 1
        else:
            self._repositioned = True
        self._healed = None
        if self.rank == 0:
            assert isinstance(self.outer, gradsync.OuterLoop)
            took = getattr(self.outer, "heal_seconds", [0.0])[-1:] or [0.0]
            print(
                f"gradsync train: node {self.ft_node} healed from a live peer in {took[0]:.2f} s; it goes on "
                f"at epoch {self.epoch + 1}, step {self.global_step + (0 if joining else 1)}",
                file=sys.stderr,
                flush=True,
            )

    # ------------------------------------------------------------------ set-up
    def _join(self) -> torch.device:
        if not dist.is_initialized():
            timeout = datetime.timedelta(seconds=self.args.timeout)
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
            if attempt is None:
                init_default_group(timeout)
            else:
                # torchrun keeps its store across restarts: without a prefix per attempt, the
                # restarted workers would find (and try to connect to) the dead workers' addresses
                store, rank, world = next(dist.rendezvous("env://", timeout=timeout))
                store = dist.PrefixStore(f"gradsync/attempt-{attempt}", store)
                init_default_group(timeout, store, rank, world)
        dev = comm_device(None)
        return dev

    def _pto_group(self) -> dist.ProcessGroup | None:
        """``--pto``: a group of its own for the trust ratios' all-gather (every rank creates it,
        at the same point), so that it never interleaves with the engine's collectives."""
        if self.args.pto == "off" or self.world == 1:
            return None
        return dist.new_group(list(range(self.world)))

    # ------------------------------------------------------------------ the run
    def run(self) -> dict[str, Any] | None:
        a = self.args
        show = self.rank == 0 and not a.quiet
        if self.rank == 0:
            print(self._banner(), file=sys.stderr, flush=True)
        from gradsync.apps.train.progress import EpochProgress

        while self.epoch < a.epochs:
            self.sampler.set_epoch(self.epoch)
            self.loader.batch_size = self.plan.per_worker[self.epoch]
            started = time.perf_counter()
            cache_before = self._cache_counters()
            with EpochProgress(show, self.epoch, a.epochs, self.steps_per_epoch, self.batch) as bar:
                waited = time.perf_counter()
                for x, y in self.loader.iter_from(self.batch):
                    t0 = time.perf_counter()
                    loss = self._step(x, y)
                    dt = time.perf_counter() - t0
                    self.meter.wait_s += t0 - waited
                    self.batch += 1
                    self.global_step += 1
                    save_now = bool(
                        a.checkpoint_dir
                        and a.checkpoint_every
                        and self.global_step % a.checkpoint_every == 0
                        and self.batch < self.steps_per_epoch
                    )
                    # the parameters are checked where they matter: before a checkpoint keeps
                    # them and at the epoch's end (the next loss would show them anyway), and
                    # there the verdict is awaited at once; elsewhere it comes one step later
                    self._check_finite(loss, save_now or self.batch == self.steps_per_epoch)
                    self.meter.add(loss, x.shape[0], dt, self.model.last_stats)
                    if isinstance(self.model, NodeSync):  # what the outer loop and DDP sent
                        self.meter.add_sent(self.model.sent_this_step(), self.outer_met)
                    if self.self_syncing:  # what the optimizer sent this step
                        compressing = self.optimizer.compressing  # type: ignore[attr-defined]
                        self.meter.add_sent(self.optimizer.traffic.take(), compressing)  # type: ignore[attr-defined]
                    if a.log_every and self.rank == 0 and self.global_step % a.log_every == 0:
                        self._log_telemetry(loss, dt, bar)
                    bar.advance(loss, x.shape[0] * self.world / dt if dt > 0 else 0.0)
                    if save_now:
                        self._save()
                    self._maybe_crash()
                    waited = time.perf_counter()
                    if self._repositioned and self.batch < self.steps_per_epoch:
                        break  # healed: go on from the peer's position (perhaps another epoch)
            if self._repositioned:
                self._repositioned = False
                if self.batch < self.steps_per_epoch:
                    continue
            self.synchronize_optimizer()  # evaluate one model (0/1 Adam's ranks drift between exchanges)
            record: dict[str, Any] = {"epoch": self.epoch + 1}
            record.update(
                epoch_record(
                    self.meter, time.perf_counter() - started, self.grad_bytes, self.world, self.device
                )
            )
            record.update(self.evaluate())
            if cache_before is not None:  # after the evaluation: its reads count too
                record.update(self._cache_record(cache_before))
            record["lr"] = self.optimizer.param_groups[0]["lr"]
            if a.resize_schedule:
                record["input_size"] = self._size()
                record["global_batch"] = self.plan.global_batch(self.epoch)
            self.history.append(record)
            if self.rank == 0:
                print(_epoch_line(record), file=sys.stderr, flush=True)
            self.epoch, self.batch, self.meter = self.epoch + 1, 0, EpochMeter()
            if a.checkpoint_dir:
                self._save()
        self.model.close()
        if self.outer_trace is not None:
            self.outer_trace.write(self.args.trace)  # (collective: every rank)
        first = self.rank == 0 and self.ft_node in (None, 0)  # under --fault-tolerant node 0 reports
        return self._summary() if first else None

    def _cache_counters(self) -> dict[str, float] | None:
        """The data cache's counters of this rank (``None`` for data read without the cache)."""
        counters = getattr(self.data.train, "cache_counters", None)
        return counters() if counters is not None else None

    def _cache_record(self, before: dict[str, float]) -> dict[str, float]:
        """The epoch's cache figures summed over ranks (evaluation included): where samples came
        from, bytes fetched from central storage, decode time."""
        now = self._cache_counters()
        assert now is not None
        keys = sorted(now)
        t = torch.tensor([now[k] - before[k] for k in keys], dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        got = dict(zip(keys, t.tolist(), strict=True))
        return cache_figures(got, self.meter.steps)

    def _log_telemetry(self, loss: float, step_s: float, bar: Any) -> None:
        """Rank 0's telemetry of the step just taken (local figures: no collective)."""
        stats = self.model.last_stats
        if stats is None or not isinstance(self.model, gradsync.GradSync):  # nothing synchronized
            return
        rec = step_record(stats, residual_norm=self.model.engine.residual_norm())
        rec.update(
            global_step=self.global_step, epoch=self.epoch + 1, loss=loss, step_ms=round(step_s * 1e3, 3)
        )
        self.telemetry.append(rec)
        bar.log(f"{format_line(rec)}, loss {loss:.4f}, {rec['step_ms']:.0f} ms/step")

    def _banner(self) -> str:
        d = self.data
        return (
            f"gradsync train: {self.model_name} ({parameter_count(self.net) / 1e6:.2f} M parameters) on "
            f"{d.name} ({len(d.train)} train / {len(d.val)} val), {self.data_world} workers as "
            f"{self._nodes} x {self.topo.per_node}, {self._sync_words()}, "
            f"{self.steps_per_epoch} steps per epoch, device {self.device}"
        )

    @property
    def _nodes(self) -> int:
        """The run's nodes (under ``--fault-tolerant`` this world is one node of them)."""
        return self.topo.nodes if self.ft_node is None else int(self.args.nodes)

    def _sync_words(self) -> str:
        if self.outer is not None:
            return self.outer.describe()
        if self.self_syncing:
            return f"no gradient sync (--optimizer {self.args.optimizer} synchronizes the model)"
        return f"scheme {self.args.scheme} (plan {self.args.plan})"

    def _summary(self) -> dict[str, Any]:
        a = self.args
        last = self.history[-1] if self.history else {}
        return {
            "command": command_line(a),
            "data": self.data.name,
            "data_source": self.data.source,
            "task": self.data.task,
            "model": self.model_name,
            "parameters": parameter_count(self.net),
            "scheme": self._scheme_words(),
            "optimizer": a.optimizer,
            "plan": a.plan,
            "plan_table": self.model.plan_table(),
            "plan_summary": self._plan_summary(),
            **({} if self.outer is None else {"outer": self.outer.describe()}),
            "world": self.data_world,
            "nodes": self._nodes,
            "per_node": self.topo.per_node,
            "batch_size": a.batch_size,
            "global_batch": self.plan.global_batch(self.plan.epochs - 1),
            **({} if self.plan.uniform else {"global_batches": self.plan.global_batches}),
            "accumulation": self.accumulation,
            **({} if self.pto_choice is None else {"pto_choice": self.pto_choice.summary()}),
            "epochs": a.epochs,
            "steps": self.global_step,
            "final": last,
            "history": self.history,
            "telemetry": self.telemetry,
            "trace": a.trace,
        }

    def _scheme_words(self) -> str:
        if self.outer is not None:
            codec = self.args.outer_codec or "dense"
            return f"outer:every={self.args.outer},fragments={self.args.fragments},codec={codec}"
        return "none" if self.self_syncing else self.args.scheme

    def _plan_summary(self) -> str:
        if not isinstance(self.model, gradsync.GradSync):
            return ""
        report = self.model.engine.report
        return report.summary if report else ""

    def synchronize_optimizer(self) -> None:
        """An optimizer that synchronizes the model itself (``--optimizer onebit-adam`` ...)
        brings the ranks' parameters into agreement (0/1 Adam's local steps), counting the bytes."""
        if self.self_syncing:
            self.optimizer.synchronize()  # type: ignore[attr-defined]
            self.meter.add_sent(self.optimizer.traffic.take())  # type: ignore[attr-defined]

    def identity(self) -> dict[str, Any]:
        """What a checkpoint must have been saved by (else resuming would misapply it)."""
        a = self.args
        ident = {
            "data": self.data.fingerprint,
            "model": self.model_name,
            "scheme": a.scheme,
            "world": self.world,
            "nodes": self.topo.nodes,
            "batch_size": a.batch_size,
            "seq_len": a.seq_len,
            "seed": a.seed,
            "optimizer": a.optimizer,
            "epochs": a.epochs,
        }
        # absent unless given, so that older checkpoints still match
        if a.global_batch is not None:
            ident["global_batch"] = a.global_batch
        if a.resize_schedule is not None:
            ident["resize_schedule"] = a.resize_schedule
        if a.resize_batch != "constant":
            ident["resize_batch"] = a.resize_batch
        if self.partitioned:
            ident["data_order"] = "partition"
        if self.outer is not None:
            ident["outer"] = self.outer.describe()
        return ident

    # ------------------------------------------------------------------ checkpoints
    def _save(self) -> None:
        self.synchronize_optimizer()  # main.pt keeps rank 0's parameters for every rank
        main = {
            "identity": self.identity(),
            "model": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "position": {"epoch": self.epoch, "batch": self.batch, "global_step": self.global_step},
            "history": self.history,
        }
        local = {
            "sync": self.model.sync_state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if self.device.type == "cuda" else None,
            "meter": self.meter.to_state(),
            # batch-norm statistics are per rank (each sees its own shard); main.pt has rank 0's
            "buffers": {n: b for n, b in self.net.named_buffers()},
        }
        if self.self_syncing or self.outer is not None:  # per rank: residuals, momentum, a node's copy
            local["optimizer"] = self.optimizer.state_dict()
        if self.outer is not None:  # between meetings each node has its own parameters
            local["model"] = self.net.state_dict()
        checkpoint.save(
            self.args.checkpoint_dir, self.global_step, main, local, self.rank, self.args.keep_checkpoints
        )

    def _resume(self) -> None:
        folder = checkpoint.agreed_latest(self.args.checkpoint_dir)  # the same folder on every rank
        if folder is None:
            if self.rank == 0:
                print(
                    f"gradsync train: no checkpoint in {self.args.checkpoint_dir}, starting afresh",
                    file=sys.stderr,
                )
            return
        if self.outer is not None and checkpoint.saved_world(folder) != self.world:
            self._resume_resized(folder)
            return
        main, local = checkpoint.load(folder, self.rank)
        checkpoint.check_identity(main["identity"], self.identity())
        self.net.load_state_dict(local.get("model", main["model"]))
        self.optimizer.load_state_dict(local["optimizer"] if "optimizer" in local else main["optimizer"])
        self.scheduler.load_state_dict(main["scheduler"])
        if self.scaler is not None and main["scaler"] is not None:
            self.scaler.load_state_dict(main["scaler"])
        pos = main["position"]
        self.epoch, self.batch, self.global_step = pos["epoch"], pos["batch"], pos["global_step"]
        self.history = list(main["history"])
        with torch.no_grad():
            for n, b in self.net.named_buffers():
                b.copy_(local["buffers"][n])
        self.model.load_sync_state_dict(local["sync"])
        torch.set_rng_state(local["rng"])
        if local["cuda_rng"] is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(local["cuda_rng"])
        self.meter = EpochMeter.from_state(local["meter"])
        if self.rank == 0:
            print(
                f"gradsync train: resumed from {folder} (epoch {self.epoch + 1}, batch {self.batch}, "
                f"step {self.global_step})",
                file=sys.stderr,
            )

    def _resume_resized(self, folder: Path) -> None:
        """Resume an outer-loop run with another number of nodes (or ranks per node).

        The outer loop takes its shared state from any old rank and what every old rank's error
        feedback owed, summed and split evenly over the new ranks
        (:meth:`gradsync.OuterLoop.load_resized`). Every node starts from the shared parameters
        (where the nodes last met: the inner steps after the last meeting are not kept, so
        checkpoint at meetings to keep everything) with rank 0's inner optimizer and buffers.
        The data position keeps the samples the epoch has consumed: the old world took them as
        a prefix of the epoch's order, so the new world starts at the first of its batches that
        is not wholly inside that prefix (less than one new global batch is seen again). The
        schedule follows the new plan's step count."""
        main, locals_ = checkpoint.load_every_rank(folder)
        old_world = len(locals_)
        keep = ("world", "nodes")
        saved = {k: v for k, v in main["identity"].items() if k not in keep}
        checkpoint.check_identity(saved, {k: v for k, v in self.identity().items() if k not in keep})
        assert self.outer is not None
        self.outer.load_resized([loc["sync"]["outer"] for loc in locals_])
        self.net.load_state_dict(main["model"])
        with torch.no_grad():
            for p, a in zip(self.outer.params, self.outer.anchors, strict=True):
                p.copy_(a.to(p.dtype))
        self.optimizer.load_state_dict(main["optimizer"])
        if self.scaler is not None and main["scaler"] is not None:
            self.scaler.load_state_dict(main["scaler"])
        pos = main["position"]
        self.epoch = int(pos["epoch"])
        old_batch, _ = batch_plan(self.args, old_world)
        consumed = int(pos["batch"]) * old_batch * old_world
        per_worker = self.plan.per_worker[min(self.epoch, self.plan.epochs - 1)]
        self.batch = consumed // (per_worker * self.data_world)
        self.global_step = sum(self.plan.steps[: self.epoch]) + self.batch
        with warnings.catch_warnings():  # (the schedule is stepped without optimizer steps)
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(self.global_step):
                self.scheduler.step()
        self.history = list(main["history"])
        if self.rank == 0:
            owed = sum(float(t.norm()) ** 2 for t in self.outer.owed().values()) ** 0.5
            print(
                f"gradsync train: resumed from {folder}, saved by {old_world} ranks "
                f"({main['identity']['nodes']} nodes), on {self.world} ({self.topo.nodes} nodes): the shared "
                "model and outer momentum kept, what error feedback owed split over the new ranks (this "
                f"rank's share: norm {owed:.3g}); epoch {self.epoch + 1}, batch {self.batch}, "
                f"step {self.global_step}",
                file=sys.stderr,
                flush=True,
            )

    # ------------------------------------------------------------------ steps
    def _autocast(self) -> AbstractContextManager[Any]:
        if not self.args.amp:
            return nullcontext()
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.float16)
        return torch.autocast("cpu", dtype=torch.bfloat16)

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        smoothing = self.args.label_smoothing if self.data.task == "classify" else 0.0
        return nn.functional.cross_entropy(
            out.reshape(-1, out.shape[-1]).float(), y.reshape(-1), label_smoothing=smoothing
        )

    def _backward(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return accumulated_backward(
            self.model, self._loss, x, y, self.accumulation, self._autocast, self.scaler
        )

    def _size(self) -> int | None:
        """This epoch's input resolution under ``--resize-schedule`` (None: the data's own)."""
        return self.plan.sizes[min(self.epoch, self.plan.epochs - 1)]

    @property
    def steps_per_epoch(self) -> int:
        """The optimizer steps of the current epoch (they differ under ``--resize-batch memory``)."""
        return self.plan.steps[min(self.epoch, self.plan.epochs - 1)]

    def _inputs(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.device, non_blocking=True)
        size = self._size()
        return resize(x, size) if size is not None else x

    def _step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        t0 = time.perf_counter()
        x, y = self._inputs(x), y.to(self.device, non_blocking=True)
        loss = self._backward(x, y)
        clip = self.args.clip_grad if self.clip_after_sync else None
        if self.scaler is not None:
            if clip:
                self.scaler.unscale_(self.optimizer)
                nn.utils.clip_grad_norm_(self.net.parameters(), clip)
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if clip:
                nn.utils.clip_grad_norm_(self.net.parameters(), clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.outer is not None:
            self.outer_met = self.outer.step()
            if self.outer_trace is not None:
                self.outer_trace.span("inner step", t0, time.perf_counter(), step=self.global_step + 1)
        return loss

    def _check_finite(self, loss: float, now: bool) -> None:
        """Stop every rank at the same step once any rank's loss is NaN or infinite.

        Each step's flags travel in one small all-reduce on the default group (gradsync's engine
        communicates on its own groups). It is started without waiting and read after the next
        step, so its latency hides behind that step's compute; every rank reads it at the same
        point, so all of them stop together, one step after the bad one. With ``now`` (before a
        checkpoint is saved, at an epoch's end) the parameters are checked too and the verdict
        is awaited at once: no checkpoint keeps a diverged model. A step that a GradScaler
        skipped for an overflowing gradient leaves the loss finite and passes."""
        bad_loss = not math.isfinite(loss)
        bad_params = False
        if now:
            finite = [torch.isfinite(p).all() for p in self.net.parameters()]
            bad_params = bool(finite) and not bool(torch.stack(finite).all())
        up = self.world - self.rank  # under MAX the largest value marks the lowest rank
        t = torch.tensor(
            [up * bad_loss, (self.rank + 1) * bad_loss, float(math.isnan(loss)), up * bad_params],
            dtype=torch.float64,
            device=self.device,
        )
        work = dist.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True) if self.world > 1 else None
        where = (
            f"at epoch {self.epoch + 1}, step {self.global_step} "
            f"(batch {self.batch} of {self.steps_per_epoch})"
        )
        mine: StepFlags = (work, t, where)
        earlier, self._unchecked = self._unchecked, mine
        if earlier is not None:
            try:
                _verdict(earlier, self.world)
            except TrainingDiverged:
                _verdict((work, t, ""), self.world, quiet=True)  # leave no collective in flight
                raise
        if now or work is None:
            self._unchecked = None
            _verdict(mine, self.world)

    def _maybe_crash(self) -> None:
        a = self.args
        first_try = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        last_node = self.ft_node is None or self.ft_node == a.nodes - 1  # (under --fault-tolerant)
        last_rank = self.rank == self.world - 1 and last_node
        if a.crash_at_step is not None and first_try and last_rank and self.global_step == a.crash_at_step:
            print(
                f"gradsync train: rank {self.rank} kills itself at step {self.global_step} (--crash-at-step)",
                file=sys.stderr,
                flush=True,
            )
            os.kill(os.getpid(), signal.SIGKILL)

    # ------------------------------------------------------------------ evaluation
    def _average_buffers(self) -> None:
        """Batch-norm statistics differ per rank (each saw its own shard): use their mean."""
        if self.world == 1:
            return
        for b in self.net.buffers():
            if b.is_floating_point():
                dist.all_reduce(b)
                b.div_(self.world)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Loss and accuracy (classification) or perplexity (language model) on the validation set,
        each rank taking every world-th sample (under ``--outer``: of the shared parameters, where
        the nodes last met)."""
        with self.outer.shared_parameters() if self.outer is not None else nullcontext():
            return self._evaluate()

    def _evaluate(self) -> dict[str, float]:
        self._average_buffers()
        self.net.eval()
        val = self.data.val
        idx = list(range(self.rank, len(val), self.world))
        loss_sum, correct, count = 0.0, 0.0, 0.0
        bs = max(self.args.batch_size, 64)
        for i in range(0, len(idx), bs):
            xs, ys = load_batch(val, idx[i : i + bs])
            x = self._inputs(xs)
            y = ys.to(self.device)
            with self._autocast():
                out = self.net(x)
            out = out.reshape(-1, out.shape[-1]).float()
            yy = y.reshape(-1)
            loss_sum += float(nn.functional.cross_entropy(out, yy, reduction="sum"))
            correct += float((out.argmax(-1) == yy).sum())
            count += yy.numel()
        self.net.train()
        t = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=self.device)
        if self.world > 1:
            dist.all_reduce(t)
        loss = float(t[0] / t[2]) if t[2] > 0 else float("nan")
        out = {"val_loss": loss}
        if self.data.task == "lm":
            out["val_perplexity"] = float(torch.tensor(loss).exp())
        else:
            out["val_accuracy"] = float(t[1] / t[2]) if t[2] > 0 else float("nan")
        return out


def _epoch_line(r: dict[str, Any]) -> str:
    metric = (
        f"val acc {100 * r['val_accuracy']:.2f}%"
        if "val_accuracy" in r
        else f"val ppl {r['val_perplexity']:.2f}"
    )
    return (
        f"epoch {r['epoch']}: train loss {r['train_loss']:.4f}, {metric}, "
        f"{r['samples_per_s']:.0f} samples/s, sent/step intra {r['bytes_per_step_intra'] / 1e6:.3f} MB "
        f"inter {r['bytes_per_step_inter'] / 1e6:.3f} MB world {r['bytes_per_step_world'] / 1e6:.3f} MB, "
        f"compression x{r['compression_ratio']:.1f}, "
        f"exposed sync {100 * r['exposed_sync_share']:.1f}% of step, "
        f"data wait {r['data_wait_ms']:.1f} ms/step"
        + (
            f", cache hits memory {100 * r['cache_memory_hit']:.0f}% disk {100 * r['cache_disk_hit']:.0f}%, "
            f"{r['central_bytes'] / 1e6:.1f} MB from central storage"
            if "cache_memory_hit" in r
            else ""
        )
    )


def save_costs(trainer: Trainer, path: str) -> None:
    """Rank 0: write the engine's refitted costs to ``path`` (atomically), or say why there are
    none (no closed-loop round ran: the plan was not ``auto``, the scheme dense, or the run too
    short for a round)."""
    costs = trainer.model.engine.costs() if isinstance(trainer.model, gradsync.GradSync) else None
    if costs is None:
        print(
            f"gradsync train: --save-costs {path}: nothing written: the closed loop never refitted the "
            "costs (it runs with --plan auto and a compressed scheme, after replan_steps + 2 compressed "
            "steps)",
            file=sys.stderr,
            flush=True,
        )
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    costs.save(tmp)
    os.replace(tmp, path)


def run_worker(args: argparse.Namespace) -> int:
    """The worker's entry point: train, print the summary on rank 0, write ``--json``. A run
    whose loss diverged returns 1 on every rank (the message is printed once per machine)."""
    try:
        trainer = Trainer(args)
        try:
            summary = trainer.run()
        except TrainingDiverged as e:
            trainer.model.close()
            if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # once per machine
                print(f"gradsync train: {e}", file=sys.stderr, flush=True)
            return 1
        if summary is not None:
            from gradsync.apps.train.progress import print_summary

            print_summary(summary)
            if args.json:
                tmp = f"{args.json}.tmp-{os.getpid()}"
                with open(tmp, "w") as fh:
                    json.dump(summary, fh, indent=1)
                os.replace(tmp, args.json)
            if args.save_costs:
                save_costs(trainer, args.save_costs)
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
