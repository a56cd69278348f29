"""``gradsync train``'s options: the argparse definition and the checks that run before any
process starts (a bad value is reported once, by the launcher, naming the option and what it
allows, instead of by every worker after the world was created)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from gradsync.codecs import Compressor, ErrorFeedback
from gradsync.data.cache.config import CacheConfig
from gradsync.integrate.wrap import check_trace_path
from gradsync.models import models_for
from gradsync.sync import Scheme, SyncConfig
from gradsync.sync.codec_set import build_candidates, build_codecs
from gradsync.sync.config import parse_options
from gradsync.sync.density_schedule import check_stages, schedule_for
from gradsync.train.resize import parse_resize_schedule

OPTIMIZERS = ("sgd", "adamw", "lars", "lamb")
SCHEDULES = ("cosine", "step", "constant", "poly")
LR_SCALING = ("none", "linear", "sqrt")
RESIZE_BATCH = ("constant", "memory")
PTO = ("off", "on", "auto")
CLIP_WHERE = ("auto", "sync", "local", "bucket")
PLANS = ("auto", "compress", "dense")
CACHE_SHUFFLE = ("partition", "global")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to train")
    g.add_argument(
        "--data",
        default="digits",
        help="digits | text | synthetic-images[:n=..] | synthetic-text[:n=..] | "
        "imagefolder:PATH | tokens:PATH (default: digits)",
    )
    g.add_argument(
        "--model",
        default=None,
        help=f"{', '.join(models_for('classify'))} (images); {', '.join(models_for('lm'))} (text); "
        "default: vgg-small for images, lstm for text",
    )
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sample for text data")
    g.add_argument(
        "--cache",
        default=None,
        metavar="DIR",
        help="read imagefolder/tokens data through the data cache: files fetched once per node into "
        "DIR ({node} in DIR becomes the node index), decoded samples kept in a shared memory store "
        "per node, and each node reading only its part of the data (see --cache-shuffle)",
    )
    g.add_argument(
        "--cache-memory",
        default="auto",
        metavar="SIZE",
        help="the memory store's limit per node: a size such as 512m or 4g, 'auto' (no limit beyond "
        "the node's part of the data) or 'off' (default: auto)",
    )
    g.add_argument(
        "--cache-disk",
        default="none",
        metavar="SIZE",
        help="the disk tier's limit (least recently used files are evicted): a size or 'none' (default)",
    )
    g.add_argument(
        "--cache-shuffle",
        default="partition",
        help="partition: each rank keeps a fixed part of the data, reshuffled every epoch, so a node "
        "caches only its part (default with --cache); global: every epoch reshuffles the whole data "
        "set over all ranks (each node may then cache all of it)",
    )
    g.add_argument("--epochs", type=int, default=12)
    g.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("optimization")
    g.add_argument("--optimizer", default="sgd", help=f"one of {', '.join(OPTIMIZERS)}")
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: 0.1 sgd, 0.002 adamw, 2.0 lars, 0.005 lamb)",
    )
    g.add_argument("--momentum", type=float, default=0.9, help="sgd and lars momentum")
    g.add_argument("--nesterov", action="store_true", help="sgd or lars with Nesterov momentum")
    g.add_argument(
        "--trust-coefficient",
        type=float,
        default=None,
        help="lars and lamb: the trust ratio's coefficient (default: 0.001 lars, 1.0 lamb)",
    )
    g.add_argument(
        "--pto",
        nargs="?",
        const="on",
        default="off",
        metavar="on|off|auto",
        help="lars and lamb: each rank computes the trust ratios of its share of the layers, "
        "then one all-gather (paper 01's parallel tensor operator); the result is the same. "
        "auto: measure both before training and let the cost model choose (--pto alone: on)",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=5e-4,
        help="decoupled for adamw; never applied to biases and norm weights",
    )
    g.add_argument("--warmup-epochs", type=float, default=1.0, help="linear learning-rate warm-up")
    g.add_argument(
        "--schedule",
        default="cosine",
        help=f"one of {', '.join(SCHEDULES)} (after warm-up; poly: (1 - progress)^--poly-power, MLPerf's)",
    )
    g.add_argument("--poly-power", type=float, default=2.0, help="the power of --schedule poly")
    g.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per optimizer step over all workers: each worker takes GLOBAL/workers, in "
        "micro-batches of --batch-size (gradient accumulation); default --batch-size x workers",
    )
    g.add_argument(
        "--lr-scaling",
        default="none",
        help="none | linear | sqrt: scale --lr by (global batch / --reference-batch) or its square root",
    )
    g.add_argument("--reference-batch", type=int, default=256, help="the batch --lr is given for")
    g.add_argument(
        "--resize-schedule",
        default=None,
        metavar="EPOCH:SIZE,...",
        help="images: progressive resizing, the input resolution from each epoch on (e.g. "
        "0:16,4:24,8:32); the model must take any size (resnet)",
    )
    g.add_argument(
        "--resize-batch",
        default="constant",
        help="constant | memory: under --resize-schedule, keep the batch, or keep a micro-batch's "
        "memory (--batch-size holds at the largest size, smaller sizes take (largest/size)^2 times "
        "as many samples; with --lr-scaling the learning rate follows each stage's batch)",
    )
    g.add_argument(
        "--label-smoothing", type=float, default=0.0, help="classifiers: cross-entropy label smoothing"
    )
    g.add_argument(
        "--clip-grad", type=float, default=None, help="clip the gradient's norm to this (see --clip-mode)"
    )
    g.add_argument(
        "--clip-mode",
        default="auto",
        choices=CLIP_WHERE,
        help="where --clip-grad clips: sync (the synchronized gradient), local (each rank's own "
        "gradient to CLIP/sqrt(N) once the backward pass ended, before error feedback: paper 04), "
        "bucket (local, bucket by bucket, keeping the overlap); auto: local when the scheme uses "
        "error feedback, else sync",
    )
    g.add_argument(
        "--amp",
        action="store_true",
        help="mixed precision: bf16 autocast on CPU, fp16 autocast + GradScaler on GPU",
    )

    g = p.add_argument_group("synchronization")
    g.add_argument(
        "--scheme",
        default="hitopk:density=0.01",
        help="a gradsync scheme: none, hierarchical, torus2d/fp16, hitopk:density=0.01, "
        "topk:density=0.01, dgc:density=0.01, powersgd:rank=4, ps/onebit, auto, ...",
    )
    g.add_argument(
        "--plan",
        default="compress",
        help="compress: compress every tensor the scheme may compress; auto: only where the "
        "measured cost model says it pays; dense: none",
    )
    g.add_argument(
        "--dense-warmup",
        type=float,
        default=0.0,
        metavar="EPOCHS",
        help="synchronize densely for the first EPOCHS epochs (at least the first step is)",
    )
    g.add_argument(
        "--density-schedule",
        default=None,
        metavar="STAGES@EPOCHS",
        help="sparsity warm-up (paper 04): exp@EPOCHS sends 25%%, 6.25%%, 1.5625%%, ... of each tensor, "
        "EPOCHS epochs per stage, down to the sparsifier's own density; or D1,D2,...@EPOCHS "
        "(e.g. 25%%,6.25%%@0.5)",
    )
    g.add_argument(
        "--switch-to-dense-at",
        type=float,
        default=None,
        metavar="EPOCH",
        help="switch from compressed to dense synchronization at this epoch (paper 01)",
    )
    g.add_argument(
        "--sync-option",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="any further gradsync SyncConfig option (repeatable)",
    )

    g = p.add_argument_group("processes")
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="worker processes on this machine (default: nodes x per-node, else 2)",
    )
    g.add_argument("--nodes", type=int, default=None, help="emulate this many nodes (with --per-node)")
    g.add_argument("--per-node", type=int, default=None, help="ranks per emulated node")
    g.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    g.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the workers this often after a failure (they resume from the last checkpoint)",
    )
    g.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")

    g = p.add_argument_group("output")
    g.add_argument("--checkpoint-dir", default=None, help="save a checkpoint at every epoch's end here")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="also save every STEPS optimizer steps (default: only at epoch ends)",
    )
    g.add_argument("--keep-checkpoints", type=int, default=2, help="how many checkpoints to keep")
    g.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in --checkpoint-dir"
    )
    g.add_argument("--json", default=None, metavar="PATH", help="write the run's summary as JSON")
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="write a timeline of the synchronization (Chrome trace JSON, opens in Perfetto); "
        "rank R also writes PATH's stem + .rankR.json",
    )
    g.add_argument(
        "--trace-steps",
        default="0:50",
        metavar="N|START:STOP",
        help="the synchronized steps --trace records: the first N, or START <= step < STOP (default 0:50)",
    )
    g.add_argument(
        "--log-every",
        type=int,
        default=None,
        metavar="K",
        help="rank 0 logs the step's telemetry every K steps (bytes per level, compression, encode/decode, "
        "exposed time, residual norm, slowest rank's lag); --json keeps these records",
    )
    # testing aid: the last rank kills itself (SIGKILL) at this global step on the first attempt,
    # to show that torchrun's restart resumes from the last checkpoint
    g.add_argument("--crash-at-step", type=int, default=None, help=argparse.SUPPRESS)


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


_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(option: str, text: str, words: tuple[str, ...]) -> int | str:
    """A byte count such as ``512m``, ``4g`` or ``123456``, or one of ``words``."""
    raw = str(text).strip().lower()
    if raw in words:
        return raw
    unit = raw[-1:] if raw[-1:] in _SIZE_UNITS else ""
    number = raw[: len(raw) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0) or int(value * _SIZE_UNITS[unit]) < 1:
        raise ValueError(
            f"{option} must be a size such as 512m, 4g or a number of bytes, or {' or '.join(words)}; "
            f"got {text!r}"
        )
    return int(value * _SIZE_UNITS[unit])


def cache_config(args: argparse.Namespace, node: int) -> CacheConfig | None:
    """The data cache ``--cache`` asks for (``None`` without it)."""
    if args.cache is None:
        return None
    memory = parse_size("--cache-memory", args.cache_memory, ("auto", "off"))
    disk = parse_size("--cache-disk", args.cache_disk, ("none",))
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
    _choice("--optimizer", args.optimizer, OPTIMIZERS)
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
    if args.nesterov and (args.optimizer not in ("sgd", "lars") or args.momentum == 0):
        raise ValueError("--nesterov needs --optimizer sgd or lars and a --momentum above 0")
    layerwise = args.optimizer in ("lars", "lamb")
    if args.trust_coefficient is not None:
        if not layerwise:
            raise ValueError("--trust-coefficient needs --optimizer lars or lamb")
        if not (math.isfinite(args.trust_coefficient) and args.trust_coefficient > 0):
            raise ValueError(f"--trust-coefficient must be a positive number, got {args.trust_coefficient!r}")
    _choice("--pto", args.pto, PTO)
    if args.pto != "off" and not layerwise:
        raise ValueError("--pto needs --optimizer lars or lamb (the trust ratios are what it shares out)")
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
    if args.json and os.environ.get("RANK", "0") == "0":
        # checked now rather than when the summary is written after the whole run (by rank 0,
        # whose machine is the one that needs the folder)
        folder = os.path.dirname(os.path.abspath(args.json))
        if os.path.isdir(args.json) or not os.path.isdir(folder):
            raise ValueError(f"--json must be a file path in an existing folder, got {args.json!r}")
    if args.log_every is not None and args.log_every < 1:
        raise ValueError(f"--log-every must be a positive number of steps, got {args.log_every}")
    trace_steps(args.trace_steps)
    if args.trace is not None:
        try:
            check_trace_path(args.trace)
        except ValueError as e:
            raise ValueError(f"--trace: {e}") from e
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
    (:func:`per_epoch`, or :meth:`~gradsync.train.epoch_plan.EpochPlan.to_steps` where epochs
    differ in length)."""
    options: dict[str, Any] = {
        "scheme": args.scheme,
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
    return [*build_codecs(config, scheme), *(c for _, c in build_candidates(config, scheme, 2, 2))]
