"""``gradsync bench optim``: the optimizer step of LARS and LAMB against a per-parameter loop,
plain SGD / AdamW and the memory floor, on the parameter shapes of the papers' models.

Contenders, each with its own copy of the model's parameters and the same gradients:

- ``floor``: one read pass over the parameters and the gradients (``torch._foreach_norm`` of
  both lists): no optimizer can step without reading them;
- ``sgd``, ``adamw``: ``torch.optim.SGD`` (momentum 0.9) and ``torch.optim.AdamW``, foreach;
- ``lars``, ``lamb``: :mod:`gradsync.optim`;
- ``lars-loop``: LARS as per-parameter implementations write it (timm's ``Lars``, NVIDIA's
  LARC): a Python loop computing two norms and the update per tensor, in the parameter's dtype.

They run in interleaved rounds (``--rounds``, every other round in reverse order) so that a slow
phase of this machine hits all of them; a round times ``--steps`` steps of each and keeps the
median. Ratios to SGD are taken per round; the table gives their median and range.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradsync.apps.commands.bench.support.output import markdown_table, pick_names, save_result
from gradsync.apps.models.paper import bert_base, resnet50
from gradsync.optim import LAMB, LARS, layerwise_param_groups

MODELS: dict[str, Callable[[], nn.Module]] = {"resnet50": resnet50, "bert-base": bert_base}
CONTENDERS = ("floor", "sgd", "lars", "lars-loop", "adamw", "lamb")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
WD = 5e-5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", default="resnet50,bert-base", help=f"comma-separated, from {', '.join(MODELS)}"
    )
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"from {', '.join(CONTENDERS)}")
    p.add_argument("--dtype", default="float32", help=f"the parameters' dtype: {', '.join(DTYPES)}")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per contender per round")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1, as the other benchmarks)"
    )
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")


def check(args: argparse.Namespace) -> None:
    pick_names(args.models, MODELS, "--models")
    contenders = pick_names(args.contenders, CONTENDERS, "--contenders")
    if "sgd" not in contenders:
        raise ValueError("--contenders must include sgd (every ratio is to it)")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    for name in ("rounds", "steps", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")


@torch.no_grad()
def lars_loop(params: list[nn.Parameter], state: dict[int, torch.Tensor], lr: float, coef: float) -> None:
    """LARS one tensor at a time, in the parameter's dtype (the per-parameter implementations'
    structure: two norms, a trust ratio and the momentum update per tensor)."""
    for p in params:
        g = p.grad
        assert g is not None
        w_norm, g_norm = p.norm(), g.norm()
        d = g.add(p, alpha=WD) if p.dim() > 1 else g.clone()
        if p.dim() > 1:
            ratio = torch.where(
                (w_norm > 0) & (g_norm > 0), coef * w_norm / (g_norm + WD * w_norm + 1e-8), 1.0
            )
            d.mul_(ratio)
        buf = state.get(id(p))
        if buf is None:
            state[id(p)] = buf = d.clone()
        else:
            buf.mul_(0.9).add_(d)
        p.add_(buf, alpha=-lr)


def _contender(name: str, model: nn.Module, grads: list[torch.Tensor]) -> Callable[[], object]:
    """One step of ``name`` on its own copy of ``model``'s parameters, with the shared gradients
    (no optimizer here writes into a gradient)."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    if name == "floor":
        both: list[torch.Tensor] = [*params, *grads]
        return lambda: torch._foreach_norm(both)
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=WD, foreach=True).step
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, weight_decay=WD, foreach=True).step
    if name == "lars-loop":
        state: dict[int, torch.Tensor] = {}
        return lambda: lars_loop(params, state, 0.1, 0.001)
    groups = layerwise_param_groups(model, WD)
    return (LARS(groups, lr=0.1) if name == "lars" else LAMB(groups, lr=1e-3)).step


def _median_step(step: Callable[[], object], steps: int) -> float:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_model(
    name: str, contenders: list[str], dtype: torch.dtype, rounds: int, steps: int
) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    model = MODELS[name]().to(dtype)
    params = list(model.parameters())
    grads = [torch.randn_like(p) * 1e-3 for p in params]
    steppers = {c: _contender(c, model, grads) for c in contenders}
    for step in steppers.values():  # state allocated, caches warm
        step()
    times: dict[str, list[float]] = {c: [] for c in contenders}
    for r in range(rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        for c in order:
            times[c].append(_median_step(steppers[c], steps))
    rows = []
    for c in contenders:
        ratios = [t / s for t, s in zip(times[c], times["sgd"], strict=True)]
        rows.append(
            {
                "model": name,
                "tensors": len(params),
                "parameters": sum(p.numel() for p in params),
                "dtype": str(dtype).removeprefix("torch."),
                "contender": c,
                "ms": statistics.median(times[c]) * 1e3,
                "ms_min": min(times[c]) * 1e3,
                "ms_max": max(times[c]) * 1e3,
                "x_sgd": statistics.median(ratios),
                "x_sgd_min": min(ratios),
                "x_sgd_max": max(ratios),
                "x_floor": statistics.median(
                    [t / f for t, f in zip(times[c], times["floor"], strict=True)]
                ) if "floor" in times else None,
            }
        )  # fmt: skip
    return rows


def markdown(result: dict[str, Any]) -> str:
    cols = ["model", "tensors", "dtype", "contender", "step ms (range)", "x SGD (range)", "x floor"]
    rows = [
        [
            r["model"], str(r["tensors"]), r["dtype"], r["contender"],
            f"{r['ms']:.1f} ({r['ms_min']:.1f}-{r['ms_max']:.1f})",
            f"{r['x_sgd']:.2f} ({r['x_sgd_min']:.2f}-{r['x_sgd_max']:.2f})",
            "" if r["x_floor"] is None else f"{r['x_floor']:.1f}",
        ]
        for r in result["rows"]
    ]  # fmt: skip
    return f"`{result['command']}` ({result['machine']})\n\n" + markdown_table(cols, rows)


def main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    contenders = pick_names(args.contenders, CONTENDERS, "--contenders")
    rows: list[dict[str, Any]] = []
    for name in pick_names(args.models, MODELS, "--models"):
        rows += bench_model(name, contenders, DTYPES[args.dtype], args.rounds, args.steps)
    command = "gradsync bench optim " + " ".join(
        f"--{k} {v}" for k, v in (("models", args.models), ("contenders", args.contenders),
                                  ("dtype", args.dtype), ("rounds", args.rounds), ("steps", args.steps),
                                  ("threads", args.threads))
    )  # fmt: skip
    result = {"command": command, "machine": f"{platform.machine()}, {args.threads} thread(s)", "rows": rows}
    text = markdown(result)
    print(text)
    save_result(result, args.json, args.markdown, text)
    return 0
