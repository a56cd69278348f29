"""``gradsync bench convergence``: is compression safe? The same training run with every scheme.

For each dataset (the digits classifier and the text language model by default) and each
scheme, it runs ``gradsync train`` with identical options and seed (one torchrun world per run,
on this machine, topology emulated with ``--nodes/--per-node``) and reports the final validation
accuracy or perplexity next to the dense run's, with the gap: percentage points of accuracy,
percent of perplexity. Schemes with a recipe of their own get it: DGC carries the momentum in
its error feedback (momentum correction), so the optimizer's momentum is turned off for it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, NoReturn

from gradsync import train
from gradsync.bench.output import save_result

# scheme label -> (scheme spec, extra train options)
RECIPES: dict[str, tuple[str, list[str]]] = {
    "none": ("none", []),
    "topk": ("allgather/topk:density=0.01", []),
    "mstopk": ("allgather/mstopk:density=0.01", []),
    "hitopk": ("hitopk:density=0.01", []),
    "dgc": ("dgc:density=0.01+ef:momentum=0.9", ["--momentum", "0"]),
    "powersgd": ("powersgd:rank=4", []),
    "terngrad": ("terngrad", []),
    "onebit": ("onebit+ef", []),
}

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
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schemes", default=",".join(RECIPES), help=f"comma-separated, from {', '.join(RECIPES)}")
    p.add_argument(
        "--datasets", default=",".join(DATASETS), help=f"comma-separated, from {', '.join(DATASETS)}"
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


def _pick(text: str, allowed: dict[str, Any], option: str) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        raise ValueError(f"{option} takes names from {', '.join(allowed)}, got {text!r}")
    return names


def _train_argv(dataset: str, scheme: str, args: argparse.Namespace, json_path: str) -> list[str]:
    spec, extra = RECIPES[scheme]
    argv = [
        "train",
        *DATASETS[dataset],
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


def _train_args(argv: list[str]) -> argparse.Namespace:
    """A ``gradsync train ...`` command line as the train command's arguments, unchecked."""
    parser = _TrainOptionParser(prog="gradsync train")
    train.add_arguments(parser)
    args = parser.parse_args(argv[1:])
    args.argv = argv  # what the launcher hands its workers (``python -m gradsync`` + this)
    return args


def _runs(args: argparse.Namespace, folder: str) -> list[tuple[str, str, str, list[str]]]:
    """(dataset, scheme, JSON summary path in ``folder``, ``gradsync train`` command line) of
    every run."""
    runs = []
    for dataset in _pick(args.datasets, DATASETS, "--datasets"):
        for scheme in _pick(args.schemes, RECIPES, "--schemes"):
            out = os.path.join(folder, f"{dataset}-{scheme}.json")
            runs.append((dataset, scheme, out, _train_argv(dataset, scheme, args, out)))
    return runs


def check(args: argparse.Namespace) -> None:
    """The option values and every run's ``gradsync train`` options (``--train-option`` included),
    before the first run starts (``ValueError`` naming the option)."""
    _pick(args.schemes, RECIPES, "--schemes")
    _pick(args.datasets, DATASETS, "--datasets")
    for name in ("nodes", "per_node"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.epochs is not None and args.epochs < 1:
        raise ValueError(f"--epochs must be at least 1, got {args.epochs}")
    with tempfile.TemporaryDirectory() as tmp:  # --json must name a file in an existing folder
        for *_, argv in _runs(args, tmp):
            train.check(_train_args(argv))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every run, one after the other (options checked by :func:`check`)."""
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for dataset, scheme, out, argv in _runs(args, tmp):
            print(
                f"gradsync bench convergence: {dataset} / {scheme}: gradsync {' '.join(argv)}",
                file=sys.stderr,
                flush=True,
            )
            rc = train.main(_train_args(argv))
            if rc != 0:
                raise RunFailed(f"the {dataset} / {scheme} run failed (exit {rc})")
            with open(out) as fh:
                summary = json.load(fh)
            final = summary["final"]
            rows.append(
                {
                    "dataset": dataset,
                    "scheme": scheme,
                    "spec": RECIPES[scheme][0],
                    "task": summary["task"],
                    "epochs": summary["epochs"],
                    "accuracy": final.get("val_accuracy"),
                    "perplexity": final.get("val_perplexity"),
                    "train_loss": final["train_loss"],
                    "compression_ratio": final["compression_ratio"],
                    "bytes_per_step": {k: final[f"bytes_per_step_{k}"] for k in ("intra", "inter", "world")},
                }
            )
    for r in rows:
        dense = next((d for d in rows if d["dataset"] == r["dataset"] and d["scheme"] == "none"), None)
        r["gap"] = None
        if dense is not None and r["accuracy"] is not None:
            r["gap"] = 100 * (r["accuracy"] - dense["accuracy"])  # percentage points
        elif dense is not None and r["perplexity"] is not None:
            r["gap"] = 100 * (r["perplexity"] / dense["perplexity"] - 1)  # percent
    return {
        "command": "gradsync " + " ".join(getattr(args, "argv", []) or []),
        "nodes": args.nodes,
        "per_node": args.per_node,
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "| dataset | scheme | spec | epochs | val accuracy % / perplexity | vs dense | compression | "
        "MB/step per worker (intra, inter, world) |",
        "|---|---|---|---|---|---|---|---|",
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
            f"| {r['dataset']} | {r['scheme']} | `{r['spec']}` | {r['epochs']} | {metric} | {gap} | "
            f"x{r['compression_ratio']:.1f} | {sent} |"
        )
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`)."""
    result = run(args)
    text = markdown(result)
    print(text)
    save_result(result, args.json, args.markdown, text)
    return 0
