"""``gradsync train``'s options: the checks that run before any process starts (a bad value is
reported once, by the launcher, naming the option and what it allows, instead of by every worker
after the world was created), and what the options become: the engine's configuration, the data
cache's, the batch plan and the learning rate. The argparse definition is in
:mod:`gradsync.apps.train.arguments`."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from gradsync.apps.data.cache.config import CacheConfig
from gradsync.apps.train.arguments import (
    CACHE_SHUFFLE,
    DEFAULT_MAX_SYNC_INTERVAL,
    DEFAULT_SCHEME,
    LR_SCALING,
    PLANS,
    PTO,
    RESIZE_BATCH,
    SCHEDULES,
)
from gradsync.apps.train.optim import optimizer_kind, optimizer_names
from gradsync.apps.train.resize import parse_resize_schedule
from gradsync.codecs import Compressor, ErrorFeedback, build_codec
from gradsync.integrate.wrap import check_trace_path
from gradsync.outer.schedule import outer_step_for
from gradsync.sync import Scheme, SyncConfig
from gradsync.sync.codec_set import scheme_codecs
from gradsync.sync.config import parse_options
from gradsync.sync.density_schedule import check_stages, schedule_for
from gradsync.units import parse_size

__all__ = [
    "batch_plan",
    "cache_config",
    "clip_where",
    "density_schedule_steps",
    "per_epoch",
    "scaled_lr",
    "sync_config",
    "sync_options",
    "trace_steps",
    "validate",
]


def sync_options(args: argparse.Namespace) -> dict[str, str]:
    """``--sync-option KEY=VALUE`` items as a dict (``ValueError`` for a malformed one)."""
    return parse_options(args.sync_option)


def _choice(option: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{option} must be one of {', '.join(allowed)}, got {value!r}")


def _at_least(option: str, value: float | None, lo: float, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or not math.isfinite(value) or value < lo:
        raise ValueError(f"{option} must be a number >= {lo:g}, got {value!r}")


def trace_steps(text: str) -> tuple[int, int]:
    """``--trace-steps``: ``N`` (the first N steps) or ``START:STOP``."""
    start, colon, stop = text.partition(":")
    try:
        window = (int(start), int(stop)) if colon else (0, int(start))
    except ValueError:
        window = (-1, -1)
    if not 0 <= window[0] < window[1]:
        raise ValueError(
            "--trace-steps takes N (the first N steps, N >= 1) or START:STOP with 0 <= START < STOP, "
            f"got {text!r}"
        )
    return window


def cache_config(args: argparse.Namespace, node: int) -> CacheConfig | None:
    """The data cache ``--cache`` asks for (``None`` without it)."""
    if args.cache is None:
        return None
    memory = parse_size(args.cache_memory, "--cache-memory", ("auto", "off"))
    disk = parse_size(args.cache_disk, "--cache-disk", ("none",))
    return CacheConfig(
        directory=args.cache,
        disk_max_bytes=disk if isinstance(disk, int) else None,
        memory=memory != "off",
        memory_max_bytes=memory if isinstance(memory, int) else None,
        node=node,
    )


def _read_pointer(path: str) -> str:
    try:
        with open(path, errors="replace") as fh:
            return repr(fh.read(64).strip())
    except OSError as e:
        return f"unreadable: {e}"


def validate(args: argparse.Namespace) -> None:
    """Every check that needs no process and no data (``ValueError`` naming the option)."""
    _choice("--cache-shuffle", args.cache_shuffle, CACHE_SHUFFLE)
    if args.cache is not None and not str(args.cache).strip():
        raise ValueError("--cache must be a directory path")
    cache_config(args, 0)
    for name in ("epochs", "batch_size", "seq_len", "threads"):
        _at_least("--" + name.replace("_", "-"), getattr(args, name), 1)
    optimizer_kind(args.optimizer)  # ValueError naming every choice
    _check_self_syncing(args)
    _check_outer(args)
    _choice("--schedule", args.schedule, SCHEDULES)
    _choice("--lr-scaling", args.lr_scaling, LR_SCALING)
    if not (math.isfinite(args.poly_power) and args.poly_power > 0):
        raise ValueError(f"--poly-power must be a positive number, got {args.poly_power!r}")
    _at_least("--reference-batch", args.reference_batch, 1)
    _at_least("--global-batch", args.global_batch, 1, allow_none=True)
    if args.resize_schedule is not None:
        parse_resize_schedule(args.resize_schedule)
    _choice("--resize-batch", args.resize_batch, RESIZE_BATCH)
    if args.resize_batch != "constant" and args.resize_schedule is None:
        raise ValueError(f"--resize-batch {args.resize_batch} needs --resize-schedule (the sizes it follows)")
    if not 0.0 <= args.label_smoothing < 1.0:
        raise ValueError(f"--label-smoothing must be in [0, 1), got {args.label_smoothing!r}")
    _choice("--plan", args.plan, PLANS)
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr > 0):
        raise ValueError(f"--lr must be a positive number, got {args.lr!r}")
    if not (0.0 <= args.momentum < 1.0):
        raise ValueError(f"--momentum must be in [0, 1), got {args.momentum!r}")
    kind = optimizer_kind(args.optimizer)
    with_momentum = " or ".join(n for n in optimizer_names() if optimizer_kind(n).momentum)
    layerwise = " or ".join(n for n in optimizer_names() if optimizer_kind(n).layerwise)
    if args.nesterov and (not kind.momentum or args.momentum == 0):
        raise ValueError(f"--nesterov needs --optimizer {with_momentum} and a --momentum above 0")
    if args.trust_coefficient is not None:
        if not kind.layerwise:
            raise ValueError(f"--trust-coefficient needs --optimizer {layerwise}")
        if not (math.isfinite(args.trust_coefficient) and args.trust_coefficient > 0):
            raise ValueError(f"--trust-coefficient must be a positive number, got {args.trust_coefficient!r}")
    _choice("--pto", args.pto, PTO)
    if args.pto != "off" and not kind.layerwise:
        raise ValueError(f"--pto needs --optimizer {layerwise} (the trust ratios are what it shares out)")
    _at_least("--weight-decay", args.weight_decay, 0.0)
    _at_least("--warmup-epochs", args.warmup_epochs, 0.0)
    _at_least("--dense-warmup", args.dense_warmup, 0.0)
    _at_least("--switch-to-dense-at", args.switch_to_dense_at, 0.0, allow_none=True)
    if args.clip_grad is not None and not (math.isfinite(args.clip_grad) and args.clip_grad > 0):
        raise ValueError(f"--clip-grad must be a positive number, got {args.clip_grad!r}")
    if args.clip_mode not in ("auto", "sync") and args.clip_grad is None:
        raise ValueError(f"--clip-mode {args.clip_mode} needs --clip-grad (the threshold)")
    _at_least("--max-restarts", args.max_restarts, 0)
    if args.checkpoint_every is not None and args.checkpoint_every < 1:
        raise ValueError(
            "--checkpoint-every must be a positive number of steps (omit it to save only at epoch "
            f"ends), got {args.checkpoint_every}"
        )
    _at_least("--keep-checkpoints", args.keep_checkpoints, 1)
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout!r}")
    if (args.nodes is None) != (args.per_node is None):
        raise ValueError("--nodes and --per-node go together")
    if args.nodes is not None:
        _at_least("--nodes", args.nodes, 1)
        _at_least("--per-node", args.per_node, 1)
    if args.nproc is not None:
        _at_least("--nproc", args.nproc, 1)
        if args.nodes is not None and args.nproc != args.nodes * args.per_node:
            raise ValueError(
                f"--nproc ({args.nproc}) must equal --nodes x --per-node ({args.nodes} x {args.per_node})"
            )
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if args.checkpoint_every is not None and not args.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir")
    if args.checkpoint_dir and os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        raise ValueError(f"--checkpoint-dir must be a folder, {args.checkpoint_dir!r} is a file")
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    pointer = os.path.join(args.checkpoint_dir or "", "latest")
    if args.checkpoint_dir and not args.resume and not restarted and os.path.isfile(pointer):
        # a fresh run there would overwrite and prune that run's checkpoints as its own
        raise ValueError(
            f"--checkpoint-dir {args.checkpoint_dir!r} already holds the checkpoints of a run (latest: "
            f"{_read_pointer(pointer)}); pass --resume to continue it, or give another (or empty) folder "
            "to start afresh"
        )
    for option, path in (("--json", args.json), ("--save-costs", args.save_costs)):
        if path and os.environ.get("RANK", "0") == "0":
            # checked now rather than when the file is written after the whole run (by rank 0,
            # whose machine is the one that needs the folder)
            folder = os.path.dirname(os.path.abspath(path))
            if os.path.isdir(path) or not os.path.isdir(folder):
                raise ValueError(f"{option} must be a file path in an existing folder, got {path!r}")
    if args.log_every is not None and args.log_every < 1:
        raise ValueError(f"--log-every must be a positive number of steps, got {args.log_every}")
    trace_steps(args.trace_steps)
    if args.trace is not None:
        try:
            check_trace_path(args.trace)
        except ValueError as e:
            raise ValueError(f"--trace: {e}") from e
    _check_fault_tolerance(args)
    Scheme.parse(args.scheme)
    config = sync_config(args, per_epoch(1))  # every SyncConfig field and value
    codecs = _codecs(config)
    schedule_for(config.density_schedule, codecs, config.scheme)  # a codec that follows it
    corrected = [c.spec() for c in codecs if isinstance(c, ErrorFeedback) and c.config.momentum > 0]
    if corrected and (args.optimizer != "sgd" or args.momentum > 0):
        raise ValueError(
            f"--scheme {args.scheme!r} carries the optimizer's momentum in its error feedback "
            f"(momentum correction: {corrected[0]}); it needs --optimizer sgd with --momentum 0, "
            "or drop ef:momentum and keep the optimizer's"
        )


def _check_outer(args: argparse.Namespace) -> None:
    """``--outer`` and its options (the ranges the library checks too, named as options here)."""
    outer = getattr(args, "outer", None)
    if outer is None:
        given = [
            name for name, value, default in (
                ("--outer-codec", args.outer_codec, None), ("--fragments", args.fragments, 1),
                ("--outer-delay", args.outer_delay, 0), ("--outer-mix", args.outer_mix, None),
                ("--outer-lr", args.outer_lr, None), ("--outer-momentum", args.outer_momentum, None),
            ) if value != default
        ]  # fmt: skip
        if given:
            raise ValueError(f"{', '.join(given)} need --outer H (the inner steps between two meetings)")
        return
    _at_least("--outer", outer, 1)
    lr, momentum = outer_step_for(outer)  # what the period asks for, where not named
    args.outer_lr = lr if args.outer_lr is None else args.outer_lr
    args.outer_momentum = momentum if args.outer_momentum is None else args.outer_momentum
    _at_least("--fragments", args.fragments, 1)
    if not 0 <= args.outer_delay < outer:
        raise ValueError(f"--outer-delay must be in [0, --outer) = [0, {outer}), got {args.outer_delay}")
    if args.outer_mix is not None and not 0.0 <= args.outer_mix <= 1.0:
        raise ValueError(f"--outer-mix must be in [0, 1], got {args.outer_mix!r}")
    if not (math.isfinite(args.outer_lr) and args.outer_lr > 0):
        raise ValueError(f"--outer-lr must be a positive number, got {args.outer_lr!r}")
    if not 0.0 <= args.outer_momentum < 1.0:
        raise ValueError(f"--outer-momentum must be in [0, 1), got {args.outer_momentum!r}")
    if args.outer_codec is not None:
        build_codec(args.outer_codec)  # ValueError naming the codecs
    if optimizer_kind(args.optimizer).self_syncing:
        raise ValueError(
            f"--outer with --optimizer {args.optimizer}: that optimizer exchanges compressed momentum across "
            "ranks every step; inside an outer loop use a local one (adamw, sgd, lamb...)"
        )
    if args.scheme != DEFAULT_SCHEME and Scheme.parse(args.scheme).kind != "dense":
        raise ValueError(
            f"--outer with --scheme {args.scheme}: the scheme would compress across nodes every step; with "
            "--outer the ranks of a node synchronize densely every step and only the outer loop crosses "
            "nodes (compress its pseudo-gradients with --outer-codec)"
        )


FT_NODE_ENV = "GRADSYNC_FT_NODE"
"""The node index ``gradsync train --fault-tolerant`` gives each node's workers."""
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
"""torchft's own variable for the lighthouse's address."""


def ft_node_index(args: argparse.Namespace) -> int | None:
    """This worker's node under ``--fault-tolerant`` (``--node-index``, else the launcher's
    variable), or None."""
    if args.node_index is not None:
        return int(args.node_index)
    value = os.environ.get(FT_NODE_ENV)
    return int(value) if value not in (None, "") else None


def ft_lighthouse(args: argparse.Namespace) -> str | None:
    """The lighthouse's address under ``--fault-tolerant`` (``--lighthouse``, else torchft's variable)."""
    return args.lighthouse or os.environ.get(LIGHTHOUSE_ENV) or None


def _check_fault_tolerance(args: argparse.Namespace) -> None:
    """``--fault-tolerant`` and the options that go with it."""
    pairs = [("--lighthouse", args.lighthouse), ("--node-index", args.node_index)]
    given = [name for name, value in [*pairs, ("--min-nodes", args.min_nodes)] if value is not None]
    if not args.fault_tolerant:
        if given:
            raise ValueError(f"{', '.join(given)} need --fault-tolerant")
        return
    if args.outer is None:
        raise ValueError(
            "--fault-tolerant needs --outer H: it recovers the outer loop's meetings across nodes"
        )
    if args.nodes is None:
        raise ValueError(
            "--fault-tolerant needs --nodes N and --per-node P: every node is a replica group of its own"
        )
    if args.outer_delay:
        raise ValueError(
            f"--fault-tolerant with --outer-delay {args.outer_delay}: a delayed exchange would be in flight "
            "across a change of the nodes that meet; use --outer-delay 0 (--fragments still staggers them)"
        )
    if args.outer_codec is not None:
        codec = build_codec(args.outer_codec)
        if codec.lowrank or codec.per_tensor:
            raise ValueError(
                f"--fault-tolerant with --outer-codec {args.outer_codec}: it needs whole matrices and each "
                "rank of a node sends a slice; use chunktopk, topk, onebit, terngrad or bf16"
            )
    min_nodes = 1 if args.min_nodes is None else args.min_nodes
    _at_least("--min-nodes", min_nodes, 1)
    if min_nodes > args.nodes:
        raise ValueError(f"--min-nodes must be at most --nodes ({args.nodes}), got {min_nodes}")
    for option, value in (("--checkpoint-dir", args.checkpoint_dir), ("--trace", args.trace)):
        if value:
            raise ValueError(
                f"--fault-tolerant with {option}: not offered yet (a node that dies heals from a live peer "
                "instead of restarting from a checkpoint; the trace is written by one world)"
            )
    index = ft_node_index(args)
    if index is not None and not 0 <= index < args.nodes:
        raise ValueError(f"--node-index must be in [0, --nodes) = [0, {args.nodes}), got {index}")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # a worker: it must know where it belongs
        if index is None:
            raise ValueError(
                "--fault-tolerant under your own torchrun needs --node-index N (this node's index)"
            )
        if ft_lighthouse(args) is None:
            raise ValueError(
                f"--fault-tolerant under your own torchrun needs --lighthouse ADDR (or ${LIGHTHOUSE_ENV})"
            )
    from gradsync.outer.ft import import_torchft

    try:
        import_torchft()
    except ImportError as e:
        raise ValueError(f"--fault-tolerant: {e}") from None


def _check_self_syncing(args: argparse.Namespace) -> None:
    """The options of the optimizers that synchronize the model themselves (compressed momentum)."""
    zeroone = {"--var-freeze-step": args.var_freeze_step, "--sync-growth": args.sync_growth}
    if args.max_sync_interval != DEFAULT_MAX_SYNC_INTERVAL:
        zeroone["--max-sync-interval"] = args.max_sync_interval
    given = {"--freeze-step": args.freeze_step, **zeroone}
    if args.momentum_codec != "onebit":
        given["--momentum-codec"] = args.momentum_codec
    given = {k: v for k, v in given.items() if v is not None}
    if not optimizer_kind(args.optimizer).self_syncing:
        if given:
            syncing = ", ".join(n for n in optimizer_names() if optimizer_kind(n).self_syncing)
            raise ValueError(f"{next(iter(given))} needs --optimizer {syncing}")
        return
    if args.scheme not in (DEFAULT_SCHEME, "none"):
        raise ValueError(
            f"--optimizer {args.optimizer} synchronizes the model itself (compressed momentum): leave "
            f"--scheme out (or give none), got --scheme {args.scheme!r}"
        )
    wrong = [k for k, v in zeroone.items() if v is not None]
    if args.optimizer != "zeroone-adam" and wrong:
        raise ValueError(f"{wrong[0]} needs --optimizer zeroone-adam")
    for option in ("--freeze-step", "--var-freeze-step", "--sync-growth", "--max-sync-interval"):
        value = getattr(args, option[2:].replace("-", "_"))
        if value is not None and value < 1:
            raise ValueError(f"{option} must be a positive number of steps, got {value}")
    if (
        args.var_freeze_step is not None
        and args.freeze_step is not None
        and args.var_freeze_step < args.freeze_step
    ):
        raise ValueError(
            f"--var-freeze-step ({args.var_freeze_step}) must be >= --freeze-step ({args.freeze_step})"
        )
    from gradsync.optim.compressed_momentum import build_exchange_codec

    try:
        build_exchange_codec(args.momentum_codec)
    except ValueError as e:
        raise ValueError(f"--momentum-codec: {e}") from None
    if args.amp and torch.cuda.is_available():
        raise ValueError(
            f"--amp on a GPU uses a GradScaler, which --optimizer {args.optimizer} does not support "
            "(a rank skipping an overflowing step would leave the others in a collective)"
        )


def batch_plan(args: argparse.Namespace, workers: int) -> tuple[int, int]:
    """``(per_worker, accumulation)``: the samples each worker takes per optimizer step, and in
    how many micro-batches of ``--batch-size`` (``--global-batch``'s gradient accumulation)."""
    if args.global_batch is None:
        return args.batch_size, 1
    if args.global_batch % workers:
        raise ValueError(
            f"--global-batch {args.global_batch} must be a multiple of the number of workers ({workers})"
        )
    per_worker = args.global_batch // workers
    micro = min(args.batch_size, per_worker)
    if per_worker % micro:
        raise ValueError(
            f"--global-batch {args.global_batch} gives {per_worker} samples per worker, which must be a "
            f"multiple of --batch-size {args.batch_size} (the micro-batch)"
        )
    return per_worker, per_worker // micro


def scaled_lr(lr: float, args: argparse.Namespace, workers: int, global_batch: int | None = None) -> float:
    """``--lr`` under ``--lr-scaling`` for ``global_batch`` (default: this run's, from
    :func:`batch_plan`), by Goyal et al.'s linear rule or the square-root rule that LAMB's
    authors use."""
    if global_batch is None:
        per_worker, _ = batch_plan(args, workers)
        global_batch = per_worker * workers
    ratio = global_batch / args.reference_batch
    if args.lr_scaling == "linear":
        return lr * ratio
    if args.lr_scaling == "sqrt":
        return lr * math.sqrt(ratio)
    return lr


def per_epoch(steps_per_epoch: int) -> Callable[[float], int]:
    """Epochs to optimizer steps when every epoch has ``steps_per_epoch`` of them."""
    return lambda epochs: round(epochs * steps_per_epoch)


def sync_config(args: argparse.Namespace, to_steps: Callable[[float], int]) -> SyncConfig:
    """The engine's configuration; epoch-valued options become step counts through ``to_steps``
    (:func:`per_epoch`, or :meth:`~gradsync.apps.train.epoch_plan.EpochPlan.to_steps` where epochs
    differ in length)."""
    options: dict[str, Any] = {
        "scheme": "none" if optimizer_kind(args.optimizer).self_syncing else args.scheme,
        "plan": args.plan,
        "dense_warmup_steps": max(1, to_steps(args.dense_warmup)),
    }
    if args.switch_to_dense_at is not None:
        options["dense_from_step"] = to_steps(args.switch_to_dense_at)
    if args.density_schedule is not None:
        options["density_schedule"] = density_schedule_steps(args.density_schedule, to_steps)
    extra = sync_options(args)
    own = {
        "scheme", "plan", "dense_warmup_steps", "dense_from_step", "clip_local", "clip_local_mode",
        "density_schedule",
    }  # fmt: skip
    clash = sorted(set(extra) & own)
    if clash:
        raise ValueError(
            f"--sync-option {clash[0]}=... has its own option (--scheme, --plan, --dense-warmup, "
            "--switch-to-dense-at, --density-schedule, --clip-grad with --clip-mode)"
        )
    config = SyncConfig.from_options({**options, **extra})
    where = clip_where(args, config)
    if where in ("local", "bucket"):
        mode = "global" if where == "local" else "bucket"
        config = replace(config, clip_local=args.clip_grad, clip_local_mode=mode)
    return config


def density_schedule_steps(text: str, to_steps: Callable[[float], int]) -> str:
    """``--density-schedule STAGES@EPOCHS`` as the engine's ``STAGES@STEPS`` (at least 1 step)."""
    stages, at, length = text.partition("@")
    try:
        epochs = float(length)
    except ValueError:
        epochs = -1.0
    if not at or not (math.isfinite(epochs) and epochs > 0):
        raise ValueError(
            "--density-schedule takes STAGES@EPOCHS: exp@EPOCHS or D1,D2,...@EPOCHS with EPOCHS > 0 "
            f"per stage (e.g. exp@1 or 25%,6.25%@0.5), got {text!r}"
        )
    check_stages(text, "--density-schedule")
    return f"{stages}@{max(1, to_steps(epochs))}"


def clip_where(args: argparse.Namespace, config: SyncConfig) -> str | None:
    """Where ``--clip-grad`` clips: ``sync``, ``local`` or ``bucket`` (None: no clipping).
    ``auto`` is ``local`` for a scheme with error feedback (clipping the synchronized gradient
    would rescale the residual updates error feedback releases), else ``sync``."""
    if args.clip_grad is None:
        return None
    if args.clip_mode != "auto":
        return str(args.clip_mode)
    return "local" if any(c.error_feedback for c in _codecs(config)) else "sync"


def _codecs(config: SyncConfig) -> list[Compressor]:
    """Every codec the scheme may run (its own, the one for large tensors, the candidates')."""
    scheme = Scheme.parse(config.scheme)
    return scheme_codecs(config, scheme, (2, 2)).all
