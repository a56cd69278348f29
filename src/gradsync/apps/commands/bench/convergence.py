"""``gradsync bench convergence``: is compression safe? The same training run with every scheme.

For each dataset (the digits classifier and the text language model by default) and each
scheme, it runs ``gradsync train`` with identical options and seed (one torchrun world per run,
on this machine, topology emulated with ``--nodes/--per-node``) and reports the final validation
accuracy or perplexity next to the dense run's, with the gap: percentage points of accuracy,
percent of perplexity. Schemes with a recipe of their own get it: DGC carries the momentum in
its error feedback (momentum correction), so the optimizer's momentum is turned off for it.

A dataset may have a recipe for compressed training (:data:`WARMUP`: the sparsity warm-up for
every sparsifier; the text runs clip locally, following the RedSync paper, as ``--clip-grad`` does
for every error-feedback scheme). ``--ablation SCHEMES`` also runs those schemes without each
ingredient (:data:`VARIANTS`), so that what each one is worth can be read off one table.

References:

- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, NoReturn

from gradsync.apps.command_line import command_line
from gradsync.apps.commands import train
from gradsync.apps.commands.bench.support.output import pick_names, save_result
from gradsync.sync import Scheme
from gradsync.sync.density_schedule import DensitySchedule

OUTER = ["--outer", "10", "--outer-lr", "1.0", "--outer-momentum", "0"]
# the outer step with a little Nesterov momentum: on text-adam (seed 0, dense pseudo-gradients)
# momentum 0.3 ended at perplexity 4.147, the plain average (0) at 4.184, 0.5 at 4.233; an outer
# lr of 1.3 without momentum at 4.181 (single runs of gradsync train with these options)
OUTER_M03 = ["--outer", "10", "--outer-lr", "1.0", "--outer-momentum", "0.3"]
OUTER_H20 = ["--outer", "20", "--outer-lr", "1.0", "--outer-momentum", "0.3"]

# scheme label -> (scheme spec, extra train options)
RECIPES: dict[str, tuple[str, list[str]]] = {
    "none": ("none", []),
    "topk": ("allgather/topk:density=0.01", []),
    # top-k within chunks of 4096 (DeMo, SparseLoCo): the same density, a fixed-size payload
    "chunktopk": ("allgather/chunktopk:density=0.01", []),
    "mstopk": ("allgather/mstopk:density=0.01", []),
    "hitopk": ("hitopk:density=0.01", []),
    "dgc": ("dgc:density=0.01+ef:momentum=0.9", ["--momentum", "0"]),
    "powersgd": ("powersgd:rank=4", []),
    "terngrad": ("terngrad", []),
    "onebit": ("onebit+ef", []),
    # optimizers that synchronize the model themselves (no scheme): dense warm-up, frozen
    # variance, momentum exchanged as onebit with error feedback (gradsync.optim)
    "onebit-adam": ("none", ["--optimizer", "onebit-adam"]),
    "zeroone-adam": ("none", ["--optimizer", "zeroone-adam"]),
    # LAMB's step is lr x |w| per layer, not lr per element: it needs a larger rate than AdamW
    # (on text-adam: perplexity 110 after one epoch at 0.002, 19 at 0.02; 0.05 was worse by epoch 3)
    "onebit-lamb": ("none", ["--optimizer", "onebit-lamb", "--lr", "0.02"]),
    # the DiLoCo-family outer loop (gradsync.OuterLoop): each node alone for 10 inner steps, its
    # ranks synchronized densely; the nodes average their pseudo-gradients (dense, onebit or
    # chunked top-k, with error feedback; streamed in 4 fragments with a 2-step delay). The outer
    # step is a plain average (lr 1, no momentum): at this scale (612 inner steps) DiLoCo's
    # 0.7 / 0.9 Nesterov gave perplexity 11.9 after 3 epochs on text-adam, the average 8.0 (dense 7.2)
    "outer": ("none", OUTER),
    "outer-onebit": ("none", [*OUTER, "--outer-codec", "onebit"]),
    "outer-chunktopk": ("none", [*OUTER, "--outer-codec", "chunktopk:density=0.1"]),
    # 4-bit stochastic quantization (terngrad:bits=4, unbiased: no error feedback) as Streaming
    # DiLoCo sends its outer gradients, with the momentum-0.3 outer step; and its dense counterpart
    "outer-m03": ("none", OUTER_M03),
    "outer-int4": ("none", [*OUTER_M03, "--outer-codec", "terngrad:bits=4"]),
    # meeting every 20 inner steps (on text-adam, seed 1: perplexity 4.147 against 4.177 at 10,
    # 4.189 at 40 and 4.346 at 5, dense pseudo-gradients), dense and with 4-bit ones
    "outer-h20": ("none", OUTER_H20),
    "outer-int4-h20": ("none", [*OUTER_H20, "--outer-codec", "terngrad:bits=4"]),
    # the same streamed (4 fragments, each landing 2 inner steps late): what the speed runs time
    "outer-int4-h20-streamed": (
        "none",
        [*OUTER_H20, "--outer-codec", "terngrad:bits=4", "--fragments", "4", "--outer-delay", "2"],
    ),
    # the sparseloco codec (chunked top-k, 16-bit positions, few-bit values, error feedback), as
    # tuned at this scale (text-adam, seed 1: density 0.2 and 4-bit values, plain error feedback
    # and the momentum-0.3 outer step: 4.172, below the dense outer loop's 4.177 at H = 10) and
    # as SparseLoCo runs it (64 of 4096 with 2-bit values, error feedback decaying at 0.95 in
    # place of outer momentum: 5.58 on seed 0 at H = 10, far behind at 612 inner steps)
    "outer-sparseloco": ("none", [*OUTER_M03, "--outer-codec", "sparseloco:density=0.2,bits=4+ef"]),
    "outer-sparseloco-paper": (
        "none",
        [*OUTER, "--outer-codec", "sparseloco:density=0.015625,bits=2+ef:decay=0.95"],
    ),
    "outer-streaming": (
        "none",
        [*OUTER, "--outer-codec", "onebit", "--fragments", "4", "--outer-delay", "2"],
    ),
}

TEXT_ADAM = [
    "--data", "text", "--model", "transformer", "--epochs", "12", "--batch-size", "32",
    "--seq-len", "64", "--optimizer", "adamw", "--lr", "0.002", "--weight-decay", "0.01",
    "--clip-grad", "1.0",
]  # fmt: skip

DATASETS: dict[str, list[str]] = {
    "digits": ["--data", "digits", "--model", "vgg-small", "--epochs", "12", "--batch-size", "32"],
    # SGD with momentum and clipping: error feedback assumes SGD-like updates (with AdamW the
    # sparse schemes ended 85-155 % above dense perplexity after 4 epochs; with SGD about 22 %)
    "text": [
        "--data",
        "text",
        "--model",
        "lstm",
        "--epochs",
        "6",
        "--batch-size",
        "32",
        "--seq-len",
        "64",
        "--optimizer",
        "sgd",
        "--lr",
        "0.5",
        "--momentum",
        "0.9",
        "--clip-grad",
        "1.0",
        "--weight-decay",
        "0",
    ],
    # the Transformer LM with AdamW (its "none" is dense AdamW), for the Adam-family optimizers
    "text-adam": TEXT_ADAM,
}

DEFAULT_DATASETS = ("digits", "text")
DEFAULT_SCHEMES = ("none", "topk", "mstopk", "hitopk", "dgc", "powersgd", "terngrad", "onebit")


# dataset -> the stages of the sparsity warm-up its sparsifiers get (``--density-schedule``)
WARMUP: dict[str, str] = {"text": "exp@1"}

# ablation variant -> what it changes in a run's ``gradsync train`` options
VARIANTS: dict[str, str] = {
    "recipe": "the dataset's recipe",
    "no clip": "without --clip-grad",
    "clip after sync": "--clip-mode sync (the synchronized gradient, not each rank's own)",
    "no warm-up": "without the sparsity warm-up",
    "dense warm-up": "dense synchronization for as long as the sparsity warm-up would last",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--schemes",
        default=",".join(DEFAULT_SCHEMES),
        help=f"comma-separated, from {', '.join(RECIPES)} (default: {', '.join(DEFAULT_SCHEMES)})",
    )
    p.add_argument(
        "--datasets",
        default=",".join(DEFAULT_DATASETS),
        help=f"comma-separated, from {', '.join(DATASETS)} (default: {', '.join(DEFAULT_DATASETS)})",
    )
    p.add_argument(
        "--ablation",
        default="",
        metavar="SCHEMES",
        help="also run these schemes (comma-separated) without each ingredient of the recipe: "
        + "; ".join(f"{k}: {v}" for k, v in VARIANTS.items() if k != "recipe"),
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--epochs", type=int, default=None, help="override every dataset's epoch count")
    p.add_argument(
        "--train-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="a further gradsync train option for every run, e.g. --train-option=--seed=1",
    )
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")


def _sparsifies(spec: str) -> bool:
    """Whether a scheme has a codec a density schedule applies to."""
    scheme = Scheme.parse(spec)
    codecs = [scheme.build(None), *(alt.build(None) for alt in scheme.alternatives(2, 2))]
    return any(c is not None and c.plain.schedulable for c in codecs)


def _drop(argv: list[str], option: str) -> list[str]:
    """``argv`` without ``option`` and its value."""
    out = list(argv)
    if option in out:
        i = out.index(option)
        del out[i : i + 2]
    return out


def _variant_options(dataset: str, scheme: str, variant: str) -> list[str] | None:
    """The dataset's options for ``scheme`` under an ablation ``variant``; None when the variant
    changes nothing for it (no clipping or no warm-up to take away)."""
    options = list(DATASETS[dataset])
    warmup = WARMUP.get(dataset) if _sparsifies(RECIPES[scheme][0]) else None
    if warmup is not None:
        options += ["--density-schedule", warmup]
    if variant == "recipe":
        return options
    if variant in ("no clip", "clip after sync"):
        if "--clip-grad" not in options:
            return None
        return _drop(options, "--clip-grad") if variant == "no clip" else [*options, "--clip-mode", "sync"]
    if warmup is None:
        return None
    options = _drop(options, "--density-schedule")
    if variant == "dense warm-up":
        stages, _, epochs = warmup.partition("@")
        codec = Scheme.parse(RECIPES[scheme][0]).build(None)
        assert codec is not None  # a sparsifier
        own = codec.plain.config.density  # type: ignore[attr-defined]
        count = len(DensitySchedule.parse(f"{stages}@1").stages_for(own))
        options += ["--dense-warmup", f"{count * float(epochs):g}"]
    return options


def _train_argv(
    dataset: str, scheme: str, args: argparse.Namespace, json_path: str, options: list[str] | None = None
) -> list[str]:
    spec, extra = RECIPES[scheme]
    argv = [
        "train",
        *(DATASETS[dataset] if options is None else options),
        "--scheme",
        spec,
        *extra,
        "--plan",
        "compress",
        "--quiet",
        "--nodes",
        str(args.nodes),
        "--per-node",
        str(args.per_node),
        "--json",
        json_path,
    ]
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    return argv + list(args.train_option)


class RunFailed(RuntimeError):
    """One of the benchmark's training runs failed (its workers said why on stderr)."""


class _TrainOptionParser(argparse.ArgumentParser):
    """``gradsync train``'s own options; what argparse refuses becomes a ValueError naming
    ``--train-option`` (the only way a user's text reaches it) instead of an exit."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"--train-option: {message}")


def train_args(argv: list[str]) -> argparse.Namespace:
    """A ``gradsync train ...`` command line as the train command's arguments, unchecked."""
    parser = _TrainOptionParser(prog="gradsync train")
    train.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    args.argv = argv  # what the launcher hands its workers (``python -m gradsync`` + this)
    return args


def _runs(args: argparse.Namespace, folder: str) -> list[tuple[str, str, str, str, list[str]]]:
    """(dataset, scheme, variant, JSON summary path in ``folder``, ``gradsync train`` command
    line) of every run: each scheme's recipe, then the ablation's variants."""
    runs = []
    ablated = pick_names(args.ablation, RECIPES, "--ablation") if args.ablation.strip() else []
    for dataset in pick_names(args.datasets, DATASETS, "--datasets"):
        schemes = pick_names(args.schemes, RECIPES, "--schemes")
        for scheme in schemes + [s for s in ablated if s not in schemes]:
            for variant in VARIANTS if scheme in ablated else ["recipe"]:
                options = _variant_options(dataset, scheme, variant)
                if options is None:
                    continue
                tag = variant.replace(" ", "-")
                out = os.path.join(folder, f"{dataset}-{scheme}-{tag}.json")
                runs.append((dataset, scheme, variant, out, _train_argv(dataset, scheme, args, out, options)))
    return runs


def check(args: argparse.Namespace) -> None:
    """The option values and every run's ``gradsync train`` options (``--train-option`` included),
    before the first run starts (``ValueError`` naming the option)."""
    pick_names(args.schemes, RECIPES, "--schemes")
    pick_names(args.datasets, DATASETS, "--datasets")
    if args.ablation.strip():
        pick_names(args.ablation, RECIPES, "--ablation")
    for name in ("nodes", "per_node"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.epochs is not None and args.epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {args.epochs}")
    with tempfile.TemporaryDirectory() as tmp:  # --json must name a file in an existing folder
        for *_, argv in _runs(args, tmp):
            train.check(train_args(argv))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every run, one after the other (options checked by :func:`check`)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for dataset, scheme, variant, out, argv in _runs(args, tmp):
            label = f"{dataset} / {scheme}" + ("" if variant == "recipe" else f" ({variant})")
            print(
                f"gradsync bench convergence: {label}: gradsync {' '.join(argv)}", file=sys.stderr, flush=True
            )
            rc = train.main(train_args(argv))
            if rc != 0:
                raise RunFailed(f"the {label} run failed (exit {rc})")
            with open(out) as fh:
                summary = json.load(fh)
            final = summary["final"]
            rows.append(
                {
                    "dataset": dataset,
                    "scheme": scheme,
                    "variant": variant,
                    "spec": " ".join([RECIPES[scheme][0], *RECIPES[scheme][1]]),
                    "argv": argv,
                    "task": summary["task"],
                    "epochs": summary["epochs"],
                    "accuracy": final.get("val_accuracy"),
                    "perplexity": final.get("val_perplexity"),
                    "train_loss": final["train_loss"],
                    "compression_ratio": final["compression_ratio"],
                    "bytes_per_step": {k: final[f"bytes_per_step_{k}"] for k in ("intra", "inter", "world")},
                    **whole_run_traffic(summary["history"]),
                    **crossing_traffic(summary, args.nodes),
                }
            )
    for r in rows:
        dense = next(
            (
                d
                for d in rows
                if d["dataset"] == r["dataset"] and d["scheme"] == "none" and d["variant"] == "recipe"
            ),
            None,
        )
        r["gap"] = None
        if dense is not None and r["accuracy"] is not None:
            r["gap"] = 100 * (r["accuracy"] - dense["accuracy"])  # percentage points
        elif dense is not None and r["perplexity"] is not None:
            r["gap"] = 100 * (r["perplexity"] / dense["perplexity"] - 1)  # percent
    return {
        "command": command_line(args),
        "nodes": args.nodes,
        "per_node": args.per_node,
        "rows": rows,
    }


def whole_run_traffic(history: list[dict[str, Any]]) -> dict[str, float]:
    """Over every epoch of a run (warm-ups included): the bytes each worker sent (mean over
    workers, all levels) and the run's compression ratio, what a flat float32 ring all-reduce of
    the gradients would have sent on every step over that (the per-epoch ratios weighted by
    bytes, not averaged)."""
    sent = dense = 0.0
    for e in history:
        per_step = sum(e[f"bytes_per_step_{k}"] for k in ("intra", "inter", "world"))
        sent += per_step * e["steps"]
        dense += e["compression_ratio"] * per_step * e["steps"]
    return {"run_bytes": sent, "run_compression": dense / sent if sent > 0 else 1.0}


def crossing_traffic(summary: dict[str, Any], nodes: int) -> dict[str, float]:
    """Over the whole run, the bytes each worker sent across nodes (``inter``) and how many
    times fewer that is than PyTorch DDP's ring all-reduce would have sent across nodes: with
    ranks placed node by node, ``nodes`` of the ring's ``world`` links cross, each carrying
    2 (world - 1) / world of the float32 gradient per step."""
    world = summary["world"]
    steps = sum(e["steps"] for e in summary["history"])
    inter = sum(e["bytes_per_step_inter"] * e["steps"] for e in summary["history"])
    ddp = nodes / world * 2 * (world - 1) / world * 4 * summary["parameters"] * steps if nodes > 1 else 0.0
    return {
        "run_inter_bytes": inter,
        "ddp_crossing_bytes": ddp,
        "crossing_reduction": ddp / inter if inter else 0.0,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| dataset | scheme | spec | variant | epochs | val accuracy % / perplexity | vs dense | "
        "compression | "
        "MB/step per worker (intra, inter, world) | whole run: MB per worker, compression | "
        "whole run across nodes: MB per worker, x fewer than DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        sent = ", ".join(f"{r['bytes_per_step'][k] / 1e6:.3f}" for k in ("intra", "inter", "world"))
        metric = f"{100 * r['accuracy']:.2f}" if r["accuracy"] is not None else f"{r['perplexity']:.3f}"
        gap = (
            ""
            if r["gap"] is None
            else (f"{r['gap']:+.2f} pp" if r["accuracy"] is not None else f"{r['gap']:+.2f} %")
        )
        lines.append(
            f"| {r['dataset']} | {r['scheme']} | `{r['spec']}` | {r['variant']} | {r['epochs']} | "
            f"{metric} | {gap} | "
            f"x{r['compression_ratio']:.1f} | {sent} | "
            + (f"{r['run_bytes'] / 1e6:.1f}, x{r['run_compression']:.1f} |" if "run_bytes" in r else " |")
            + (
                f" {r['run_inter_bytes'] / 1e6:.2f}, x{r['crossing_reduction']:.0f} |"
                if r.get("run_inter_bytes")
                else " |"
            )
        )
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`)."""
    result = run(args)
    text = markdown(result)
    print(text)
    save_result(result, args.json, args.markdown, text)
    return 0
