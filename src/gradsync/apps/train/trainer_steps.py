"""One step of a ``gradsync train`` worker, and its evaluation: the forward and backward passes
over micro-batches (gradient accumulation), the optimizer step, the check that stops every rank
together once the loss or the parameters stop being finite, and the validation pass.

:class:`TrainerSteps` holds these methods of :class:`~gradsync.apps.train.loop.Trainer`, which sets
every attribute it declares.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.apps.data import DataBundle
from gradsync.apps.data.loader import load_batch
from gradsync.apps.train.epoch_plan import EpochPlan
from gradsync.apps.train.resize import resize


class TrainingDiverged(RuntimeError):
    """The training loss (or the parameters) stopped being finite; raised on every rank at the
    same step."""


# one step's finiteness flags: the all-reduce (None in a world of one), its tensor (lowest and
# highest rank with a non-finite loss, whether it was NaN, lowest rank with non-finite
# parameters; ranks encoded so that MAX combines them), and where the step was
_Flags = tuple[Any, torch.Tensor, str]

_HINT = "lower --lr, add --clip-grad, or check the data"


def _verdict(flags: _Flags, world: int, quiet: bool = False) -> None:
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
    model: gradsync.GradSync,
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


class TrainerSteps:
    """The trainer's steps and evaluation (a part of :class:`~gradsync.apps.train.loop.Trainer`)."""

    # set by Trainer.__init__
    args: argparse.Namespace
    data: DataBundle
    device: torch.device
    net: nn.Module
    model: gradsync.GradSync
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    plan: EpochPlan
    accumulation: int
    clip_after_sync: bool
    rank: int
    world: int
    epoch: int
    batch: int
    global_step: int
    _unchecked: _Flags | None

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
        mine: _Flags = (work, t, where)
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
        last_rank = self.rank == self.world - 1
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
        each rank taking every world-th sample."""
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
