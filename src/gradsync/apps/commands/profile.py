"""``gradsync profile``: when each gradient of a model's training step becomes ready, on this machine.

It runs one model's training step ``--warmup`` times unmeasured and ``--steps`` times measured
(:func:`gradsync.observe.profiler.profile_step`), prints the phases and the largest parameters
with the time their gradient was ready, and writes the JSON profile that the what-if simulator
replays (``--out``; ``docs/profile.md`` describes it). Unless ``--no-overhead``, every measured
step is paired with an unprofiled one and the profile records what the measuring cost.

``--model`` is a built-in model (``gradsync.apps.models``: ``vgg``, ``vgg-small``, ``resnet``,
``resnet50``, ``resnet101``, ``vgg16`` take a batch of random images and labels, of
``--classes`` classes; ``lstm``, ``transformer`` and ``bert-base`` random token ids, over
``--vocab-size`` values, whose next-token targets are the same ids shifted by one), or
``package.module:factory``: a function called with no arguments that returns

- ``(model, batch)``: ``batch`` a tuple of tensors ``(inputs..., target)``; each step computes
  ``cross_entropy(model(*inputs), target)`` over the output's last dimension;
- ``(model, loss_fn)``: ``loss_fn(model)`` runs the whole forward pass (making its own inputs on
  the model's device) and returns the scalar loss;
- ``(model, loader)``: an iterable of such batches (a ``DataLoader``); a batch is drawn every
  step and the data phase is measured;

optionally followed by a third element, the ``torch.optim.Optimizer`` to step (SGD with
momentum otherwise).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable
from typing import Any, cast

import torch
from torch import nn

from gradsync.apps.command_line import command_line
from gradsync.apps.models import build_model, model_names, models_for
from gradsync.observe.profile_format import Profile
from gradsync.observe.profiler import BatchOrLossFn, profile_step

DEVICES = ("cpu", "cuda")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULTS = {"batch_size": 16, "image_size": 32, "seq_len": 64}
CLASSES, VOCABULARY = 10, 256


class FactoryError(Exception):
    """A ``--model package.module:factory`` that cannot be imported, called, or returned something
    other than ``(model, batch | loss_fn | loader[, optimizer])``: ``gradsync`` exits 1."""


def _is_factory(spec: str) -> bool:
    return ":" in spec


def _check_factory_spec(spec: str) -> None:
    module, _, func = spec.partition(":")
    parts = module.split(".")
    if not module or not func or not all(p.isidentifier() for p in parts) or not func.isidentifier():
        raise ValueError(
            f"--model {spec!r}: expected a built-in model ({', '.join(model_names())}) or "
            "package.module:factory (a function of no arguments returning (model, batch) or (model, loss_fn))"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    models = ", ".join(model_names())
    p.add_argument("--model", default="vgg", help=f"{models} or package.module:factory (default: vgg)")
    p.add_argument("--batch-size", type=int, help="built-in models: samples per step (default 16)")
    p.add_argument("--image-size", type=int, help="built-in image models: square images' side (default 32)")
    p.add_argument("--seq-len", type=int, help="built-in language models: tokens per sample (default 64)")
    p.add_argument("--classes", type=int, help=f"built-in image models: classes (default {CLASSES})")
    p.add_argument(
        "--vocab-size", type=int, help=f"built-in language models: vocabulary (default {VOCABULARY})"
    )
    p.add_argument("--steps", type=int, default=20, help="measured steps (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="unmeasured steps before them (default 5)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's own setting)")
    p.add_argument("--device", help="cpu or cuda (default: cuda where available, else cpu)")
    p.add_argument("--dtype", default="float32", help="parameters' and inputs' dtype: float32 or bfloat16")
    p.add_argument("--out", metavar="PATH.json", help="write the profile here")
    p.add_argument(
        "--no-overhead", action="store_true", help="skip the unprofiled steps that measure the overhead"
    )
    p.add_argument("--top", type=int, default=10, help="parameters listed, largest first (default 10)")
    p.add_argument(
        "--powersgd-hook-ranks",
        metavar="R1,R2",
        help="also time PyTorch's PowerSGD hook at these ranks on this model (DDP on a one-rank group), "
        "for gradsync whatif's ddp-powersgd:rank=R",
    )


def hook_ranks(text: str | None) -> list[int]:
    """``--powersgd-hook-ranks 1,4`` as ranks (``ValueError`` naming the option)."""
    if text is None:
        return []
    ranks = []
    for piece in text.split(","):
        piece = piece.strip()
        if not piece.isdigit() or int(piece) < 1:
            raise ValueError(
                f"--powersgd-hook-ranks {text!r}: expected comma-separated ranks of at least 1, e.g. 1,4"
            )
        ranks.append(int(piece))
    return sorted(set(ranks))


def check(args: argparse.Namespace) -> None:
    """The option values, before anything runs (``ValueError`` naming the option and what it allows)."""
    spec = args.model
    factory = _is_factory(spec)
    if factory:
        _check_factory_spec(spec)
        for name in ("batch_size", "image_size", "seq_len", "vocab_size", "classes"):
            if getattr(args, name) is not None:
                raise ValueError(
                    f"--{name.replace('_', '-')} applies to built-in models only; "
                    f"the factory {spec!r} makes its own batch"
                )
    elif spec not in model_names():
        raise ValueError(
            f"--model {spec!r} is not a built-in model; choose one of {', '.join(model_names())} "
            "or give package.module:factory"
        )
    else:
        lm = spec in models_for("lm")
        for name, for_lm in (
            ("image_size", False),
            ("classes", False),
            ("seq_len", True),
            ("vocab_size", True),
        ):
            if lm != for_lm and getattr(args, name) is not None:
                kind = "language models" if for_lm else "image models"
                allowed = ", ".join(models_for("lm" if for_lm else "classify"))
                raise ValueError(f"--{name.replace('_', '-')} applies to {kind} ({allowed})")
    for name in ("batch_size", "image_size", "seq_len", "vocab_size", "classes", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    if args.top < 0:
        raise ValueError(f"--top must be at least 0, got {args.top}")
    if args.device is not None and args.device not in DEVICES:
        raise ValueError(f"--device {args.device!r}: allowed values are {', '.join(DEVICES)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: CUDA is not available on this machine (allowed here: cpu)")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype {args.dtype!r}: allowed values are {', '.join(DTYPES)}")
    hook_ranks(args.powersgd_hook_ranks)
    if args.out:
        folder = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(folder):
            raise ValueError(f"--out {args.out!r}: the folder {folder!r} does not exist")


# --------------------------------------------------------------------------- what is profiled


def builtin(
    name: str,
    batch_size: int,
    image_size: int,
    seq_len: int,
    vocab_size: int = VOCABULARY,
    classes: int = CLASSES,
) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A built-in model and an example batch of the right kind, from a fixed seed."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name in models_for("lm"):
        kwargs: dict[str, Any] = {"vocab_size": vocab_size}
        if name == "transformer":
            kwargs["seq_len"] = seq_len
        elif name == "bert-base" and seq_len > 512:
            kwargs["seq_len"] = seq_len  # BERT's 512 positions otherwise, as the real model
        model = build_model(name, **kwargs)
        tokens = torch.randint(0, vocab_size, (batch_size, seq_len + 1), generator=g)
        return model, (tokens[:, :-1], tokens[:, 1:])  # next-token targets
    kwargs = {"num_classes": classes}
    if name.startswith("vgg"):
        kwargs["image_size"] = image_size
    model = build_model(name, **kwargs)
    images = torch.randn(batch_size, 3, image_size, image_size, generator=g)
    return model, (images, torch.randint(0, classes, (batch_size,), generator=g))


def from_factory(spec: str) -> tuple[nn.Module, BatchOrLossFn, torch.optim.Optimizer | None]:
    """Import and call ``package.module:factory``; check what it returned (:class:`FactoryError`)."""
    module_name, _, func_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise FactoryError(
            f"--model {spec}: cannot import {module_name!r} ({e}); is it on PYTHONPATH?"
        ) from e
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise FactoryError(f"--model {spec}: module {module_name!r} has no function {func_name!r}")
    made = factory()
    contract = (
        "expected (model, batch), (model, loss_fn) or (model, loader), optionally with an optimizer third"
    )
    kinds = (
        "it must be a tuple of tensors (inputs..., target), a function loss_fn(model) -> loss, "
        "or an iterable of such batches"
    )
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        what = f"a tuple of {len(made)}" if isinstance(made, tuple) else type(made).__name__
        raise FactoryError(f"--model {spec}: the factory returned {what}; {contract}")
    model, source = made[0], made[1]
    if not isinstance(model, nn.Module):
        raise FactoryError(
            f"--model {spec}: the factory's first element is {type(model).__name__}, "
            f"not a torch.nn.Module; {contract}"
        )
    if isinstance(source, (tuple, list)) and source and all(isinstance(t, torch.Tensor) for t in source):
        if len(source) < 2:
            raise FactoryError(
                f"--model {spec}: the batch has {len(source)} tensor; "
                "it needs the inputs and, last, the target"
            )
    elif isinstance(source, (nn.Module, torch.Tensor, str, bytes, dict)) or not (
        callable(source) or isinstance(source, Iterable)
    ):
        # a module is callable and a tensor iterable, but neither is what the contract means
        raise FactoryError(
            f"--model {spec}: the factory's second element is {type(source).__name__}; {kinds}"
        )
    optimizer = made[2] if len(made) == 3 else None
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise FactoryError(
            f"--model {spec}: the factory's third element is {type(optimizer).__name__}, "
            "not a torch.optim.Optimizer"
        )
    return model, source, optimizer


def time_powersgd_hook(
    model: nn.Module, source: BatchOrLossFn, rank: int, device: torch.device, dtype: torch.dtype
) -> float:
    """PyTorch's PowerSGD hook's work on ``model`` (seconds per gradient byte), in DDP's default
    buckets, on one batch of ``source`` (:func:`gradsync.observe.hook_costs.powersgd_hook_rate`)."""
    from gradsync.observe.hook_costs import one_rank_world, powersgd_hook_rate
    from gradsync.observe.profiler import Batch, batch_to, default_loss

    if callable(source) and not isinstance(source, (tuple, list)):
        loss_of = source  # loss_fn(model): the whole forward pass
    else:
        batch = source if isinstance(source, (tuple, list)) else next(iter(source))
        *inputs, target = batch_to(cast(Batch, batch), device, dtype if dtype != torch.float32 else None)

        def loss_of(m: nn.Module) -> torch.Tensor:
            return default_loss(m(*inputs), target)

    with one_rank_world():
        return powersgd_hook_rate(model, loss_of, rank, None, device)


# --------------------------------------------------------------------------- output


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def print_profile(profile: Profile, top: int) -> None:
    """The phases, the ``top`` largest parameters with their ready times, and the overhead."""
    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=160)
    batch = (
        f"batch {profile.batch_size}" if profile.batch_size is not None else "batch from the loss function"
    )
    dev = profile.device
    title = (
        f"{profile.model}, {batch}, {'/'.join(profile.dtypes)}, {dev.type} ({dev.name}, "
        f"{dev.threads} threads), median of {profile.steps} steps after {profile.warmup}"
    )
    phases = Table(title=title)
    for col in ("phase", "median ms", "p10 ms", "p90 ms", "min ms", "max ms"):
        phases.add_column(col, justify="left" if col == "phase" else "right")
    for name, s in profile.phases.items():
        label = name if name != "data" or profile.data_measured else "data (not measured)"
        phases.add_row(label, _ms(s.median), _ms(s.p10), _ms(s.p90), _ms(s.min), _ms(s.max))
    console.print(phases)

    with_grad = [p for p in profile.parameters if p.ready is not None]
    if top and with_grad:
        largest = sorted(with_grad, key=lambda p: (-p.bytes, p.backward_rank))[:top]
        table = Table(
            title=f"the {len(largest)} largest of {len(with_grad)} gradients (ready: from backward start)"
        )
        for col in ("parameter", "shape", "dtype", "MiB", "ready ms", "p10..p90 ms", "backward rank"):
            table.add_column(col, justify="left" if col in ("parameter", "shape", "dtype") else "right")
        for p in largest:
            assert p.ready is not None
            table.add_row(
                p.name, "x".join(map(str, p.shape)) or "scalar", p.dtype, f"{p.bytes / 2**20:.2f}",
                _ms(p.ready.median), f"{_ms(p.ready.p10)}..{_ms(p.ready.p90)}", str(p.backward_rank),
            )  # fmt: skip
        console.print(table)
    total = profile.total_bytes()
    print(f"gradients: {len(with_grad)} tensors, {total / 2**20:.2f} MiB per step")
    if profile.overhead is not None:
        r = profile.overhead.ratio
        print(
            f"overhead: profiled / unprofiled step = {r.median:.4f} (p10 {r.p10:.4f}, p90 {r.p90:.4f}) "
            f"over {profile.overhead.rounds} interleaved rounds; unprofiled step "
            f"{_ms(profile.overhead.unprofiled_step.median)} ms"
        )


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype]
    meta: dict[str, Any] = {"command": command_line(args)}
    optimizer = None
    if _is_factory(args.model):
        model, source, optimizer = from_factory(args.model)
        meta["factory"] = args.model
    else:
        batch_size = args.batch_size or DEFAULTS["batch_size"]
        image_size = args.image_size or DEFAULTS["image_size"]
        seq_len = args.seq_len or DEFAULTS["seq_len"]
        vocab_size = args.vocab_size or VOCABULARY
        classes = args.classes or CLASSES
        model, source = builtin(args.model, batch_size, image_size, seq_len, vocab_size, classes)
        if args.model in models_for("lm"):
            meta["seq_len"] = seq_len
            meta["vocab_size"] = vocab_size
        else:
            meta["image_size"] = image_size
            meta["classes"] = classes
    print(
        f"gradsync profile: {args.model} on {device.type}, "
        f"{args.warmup} warm-up + {args.steps} measured steps"
        + ("" if args.no_overhead else ", each paired with an unprofiled step"),
        file=sys.stderr,
        flush=True,
    )
    profile = profile_step(
        model, source, optimizer, steps=args.steps, warmup=args.warmup, device=device,
        dtype=dtype if dtype != torch.float32 else None, overhead=not args.no_overhead,
        model_name=args.model, meta=meta,
    )  # fmt: skip
    for rank in hook_ranks(args.powersgd_hook_ranks):
        profile.powersgd_hook[rank] = time_powersgd_hook(model, source, rank, device, dtype)
        work = profile.powersgd_hook[rank] * profile.total_bytes()
        print(
            f"PyTorch's PowerSGD hook at rank {rank}: {work * 1e3:.1f} ms of work per step", file=sys.stderr
        )
    print_profile(profile, args.top)
    if args.out:
        profile.save(args.out)
        print(f"profile written to {args.out}", file=sys.stderr)
    return 0
