"""``gradsync bench large-batch``: does a large global batch with LARS keep the small batch's
accuracy at the same number of epochs, where plain SGD at that batch falls behind (the MSTopK and
ImageNet-in-four-minutes papers)? And does it still with a sparsifying scheme underneath?

Per dataset, four ``gradsync train`` runs, one after the other, every one for the same epochs:

- ``sgd small``: SGD with momentum at the dataset's usual batch (32 per worker);
- ``sgd large``: SGD at ``--scale`` times that global batch (gradient accumulation where a
  worker's share exceeds 32), the learning rate scaled linearly (Goyal et al.) with its warm-up;
- ``lars large``: LARS at the large batch, polynomial decay (MLPerf's power 2), with the
  dataset's own learning rate and recipe options (:data:`LARS_RECIPE`: tuned per dataset, as
  the papers tune theirs);
- ``lars large + hitopk``: the same over ``hitopk:density=0.01`` instead of dense all-reduce.

The table gives each run's validation accuracy and its gap to ``sgd small`` in points.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- ImageNet-in-four-minutes paper: Jia et al., "Highly Scalable Deep Learning Training System with
  Mixed-Precision: Training ImageNet in Four Minutes", arXiv:1807.11205.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

from gradsync.apps.command_line import command_line
from gradsync.apps.commands import train
from gradsync.apps.commands.bench.convergence import RunFailed, train_args
from gradsync.apps.commands.bench.support.output import markdown_table, pick_names, save_result

SMALL = 32  # samples per worker per step in the small-batch run

DATASETS: dict[str, list[str]] = {
    # 1438 training images: 100 epochs are 1100 small steps, 175 large ones at x8 on 4 workers
    "digits": ["--data", "digits", "--model", "vgg-small", "--epochs", "100"],
    # 100 classes, noise 2: with 10 classes, or noise 1, these images are separable enough that
    # SGD at the large batch keeps up with the small one
    "images": ["--data", "synthetic-images:n=16384,size=16,channels=3,classes=100,noise=2", "--model",
               "resnet", "--epochs", "8"],
}  # fmt: skip

# LARS's learning rate and recipe options per dataset (swept: docs/benchmarks.md)
LARS_RECIPE: dict[str, list[str]] = {
    "digits": ["--lr", "2.0"],
    "images": ["--lr", "16", "--label-smoothing", "0.1"],
}

# run label -> options; {large}: the large global batch, {small}: the small one, {lr}: --lr
RUNS: dict[str, list[str]] = {
    "sgd small": ["--optimizer", "sgd", "--lr", "{lr}", "--scheme", "none"],
    "sgd large": ["--optimizer", "sgd", "--lr", "{lr}", "--global-batch", "{large}",
                  "--lr-scaling", "linear", "--reference-batch", "{small}", "--scheme", "none"],
    "lars large": ["--optimizer", "lars", "{lars}", "--global-batch", "{large}",
                   "--schedule", "poly", "--scheme", "none"],
    "lars large + hitopk": ["--optimizer", "lars", "{lars}", "--global-batch", "{large}",
                            "--schedule", "poly", "--scheme", "hitopk:density=0.01"],
}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--datasets", default=",".join(DATASETS), help=f"comma-separated, from {', '.join(DATASETS)}"
    )
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, from {', '.join(RUNS)}")
    p.add_argument(
        "--scale", type=int, default=8, help="the large global batch over the small one (default 8)"
    )
    p.add_argument("--lr", type=float, default=0.1, help="SGD's learning rate at the small batch")
    p.add_argument(
        "--lars-lr",
        type=float,
        default=None,
        help="LARS's learning rate at the large batch (default: per dataset)",
    )
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--epochs", type=int, default=None, help="override every dataset's epoch count")
    p.add_argument("--train-option", action="append", default=[], metavar="OPTION",
                   help="a further gradsync train option for every run")  # fmt: skip
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")


def _argv(dataset: str, run: str, args: argparse.Namespace, out: str) -> list[str]:
    world = args.nodes * args.per_node
    values = {
        "large": str(SMALL * world * args.scale),
        "small": str(SMALL * world),
        "lr": str(args.lr),
    }
    lars = list(LARS_RECIPE[dataset])
    if args.lars_lr is not None:
        lars[lars.index("--lr") + 1] = str(args.lars_lr)
    options: list[str] = []
    for o in RUNS[run]:
        options += lars if o == "{lars}" else [o.format(**values)]
    world_options = ["--nodes", str(args.nodes), "--per-node", str(args.per_node)]
    argv = ["train", *DATASETS[dataset], "--batch-size", str(SMALL), *options, "--plan", "compress",
            "--quiet", *world_options, "--json", out]  # fmt: skip
    if args.epochs is not None:
        argv += ["--epochs", str(args.epochs)]
    return argv + list(args.train_option)


def _runs(args: argparse.Namespace, folder: str) -> list[tuple[str, str, str, list[str]]]:
    runs = []
    for dataset in pick_names(args.datasets, DATASETS, "--datasets"):
        for run in pick_names(args.runs, RUNS, "--runs"):
            out = os.path.join(folder, f"{dataset}-{run.replace(' ', '-').replace('+', 'plus')}.json")
            runs.append((dataset, run, out, _argv(dataset, run, args, out)))
    return runs


def check(args: argparse.Namespace) -> None:
    """The options and every run's ``gradsync train`` options, before the first run starts."""
    for name in ("nodes", "per_node", "scale"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.epochs is not None and args.epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {args.epochs}")
    for name in ("lr", "lars_lr"):
        if getattr(args, name) is not None and not getattr(args, name) > 0:
            raise ValueError(
                f"--{name.replace('_', '-')} must be a positive number, got {getattr(args, name)}"
            )
    with tempfile.TemporaryDirectory() as tmp:
        for *_, argv in _runs(args, tmp):
            train.check(train_args(argv))


def main(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for dataset, run, out, argv in _runs(args, tmp):
            where = f"gradsync bench large-batch: {dataset} / {run}"
            print(f"{where}: gradsync {' '.join(argv)}", file=sys.stderr, flush=True)
            if train.main(train_args(argv)) != 0:
                raise RunFailed(f"the {dataset} / {run} run failed")
            with open(out) as fh:
                summary = json.load(fh)
            rows.append(
                {
                    "dataset": dataset,
                    "run": run,
                    "argv": argv,
                    "epochs": summary["epochs"],
                    "global_batch": summary["global_batch"],
                    "steps": summary["steps"],
                    "accuracy": summary["final"]["val_accuracy"],
                    "history": [h["val_accuracy"] for h in summary["history"]],
                }
            )
    for r in rows:
        base = next((b for b in rows if b["dataset"] == r["dataset"] and b["run"] == "sgd small"), None)
        r["gap_pp"] = None if base is None else 100 * (r["accuracy"] - base["accuracy"])
    result = {"command": command_line(args), "rows": rows}
    cols = ["dataset", "run", "global batch", "steps", "epochs", "val accuracy %", "vs sgd small"]
    table = [
        [r["dataset"], r["run"], str(r["global_batch"]), str(r["steps"]), str(r["epochs"]),
         f"{100 * r['accuracy']:.2f}", "" if r["gap_pp"] is None else f"{r['gap_pp']:+.2f} pp"]
        for r in rows
    ]  # fmt: skip
    text = markdown_table(cols, table)
    print(text)
    save_result(result, args.json, args.markdown, text)
    return 0
