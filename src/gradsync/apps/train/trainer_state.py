"""What a ``gradsync train`` worker keeps in a checkpoint and how it takes it back: the run's
identity (what a checkpoint must have been saved by), saving and resuming.

:class:`TrainerState` holds these methods of :class:`~gradsync.apps.train.loop.Trainer`, which sets
every attribute it declares; :mod:`gradsync.apps.train.checkpoint` writes and reads the files.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn

import gradsync
from gradsync.apps.data import DataBundle
from gradsync.apps.train import checkpoint
from gradsync.apps.train.metrics import EpochMeter
from gradsync.collectives import Topology


class TrainerState:
    """The trainer's checkpoints (a part of :class:`~gradsync.apps.train.loop.Trainer`)."""

    # set by Trainer.__init__
    args: argparse.Namespace
    data: DataBundle
    model_name: str
    topo: Topology
    rank: int
    world: int
    partitioned: bool
    device: torch.device
    net: nn.Module
    model: gradsync.GradSync
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler | None
    epoch: int
    batch: int
    global_step: int
    meter: EpochMeter
    history: list[dict[str, Any]]
    self_syncing: bool

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
        if self.self_syncing:  # error-feedback residuals and the momentum exchange are per rank
            local["optimizer"] = self.optimizer.state_dict()
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
        main, local = checkpoint.load(folder, self.rank)
        checkpoint.check_identity(main["identity"], self.identity())
        self.net.load_state_dict(main["model"])
        self.optimizer.load_state_dict(local["optimizer"] if self.self_syncing else main["optimizer"])
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
