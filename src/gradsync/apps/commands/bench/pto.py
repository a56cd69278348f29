"""``gradsync bench pto``: the MSTopK paper's parallel tensor operator against every rank computing
the LARS trust ratios alone, on the world it is launched in (torchrun, or the emulated cluster with
``--emulate 2x2 --link 100mbit``, set up and taken down by the command).

The layers are a model's weights, the tensors that have a trust ratio (54 of ResNet-50's 161
tensors, 76 of BERT-base's 202), each layer's element count multiplied by ``--scales`` to find
where PTO starts to pay: the norm work shrinks with the scale, the all-gather's start-up cost
does not. Per scale, in interleaved
rounds, each contender computes every trust ratio of :class:`gradsync.optim.LARS` from the same
weights and gradients: ``local`` (all layers on each rank) and ``pto`` (each rank its share, then
one all-gather of the ratios). A timing is the slowest rank's. Next to the measured PTO time,
the cost model's prediction (:meth:`~gradsync.collectives.cost.CostModel.parallel_tensor_op`,
with the links and the start-up of a small world all-gather calibrated in the same run) and
whether it predicts a gain: the decision ``gradsync train --pto auto`` makes.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.apps.commands.bench.support.output import markdown_table, pick_names, save_result
from gradsync.apps.commands.bench.support.world import (
    add_world_arguments,
    emulated_shape,
    join_world,
    link_bytes_per_s,
    run_emulated,
)
from gradsync.apps.models.paper import bert_base, resnet50
from gradsync.collectives.cost import CostModel, calibrate, synchronize
from gradsync.optim import LARS, ParallelTensorOperator, layerwise_param_groups
from gradsync.optim.parallel import largest_share

MODELS: dict[str, Callable[[], nn.Module]] = {"resnet50": resnet50, "bert-base": bert_base}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", default="resnet50,bert-base", help=f"comma-separated, from {', '.join(MODELS)}"
    )
    p.add_argument(
        "--scales",
        default="0.001,0.01,0.1,1",
        help="multipliers of every layer's element count (comma-separated)",
    )
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=5, help="timed calls per contender per round (median kept)")
    p.add_argument(
        "--emulate", metavar="NODESxPER_NODE", help="run on an emulated cluster of this shape (root)"
    )
    p.add_argument("--link", default="100mbit", help="the emulated cluster's cable rate (with --emulate)")
    add_world_arguments(p, timeout_s=120.0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")


def _scales(text: str) -> list[float]:
    try:
        values = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"--scales takes positive numbers separated by commas, got {text!r}")
    return values


def check(args: argparse.Namespace) -> None:
    pick_names(args.models, MODELS, "--models")
    _scales(args.scales)
    for name in ("rounds", "reps", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout!r}")
    if args.emulate and "RANK" not in os.environ:
        emulated_shape(args.emulate)


def _layers(name: str, scale: float) -> list[nn.Parameter]:
    """The model's adapted layers (weights; biases and norms have no trust ratio), each a flat
    parameter of ``scale`` times its element count, with a gradient."""
    with torch.device("meta"):
        model = MODELS[name]()
    adapted = layerwise_param_groups(model, 0.0)[0]["params"]
    g = torch.Generator().manual_seed(1)
    layers = []
    for p in adapted:
        n = max(1, round(p.numel() * scale))
        q = nn.Parameter(torch.randn(n, generator=g))
        q.grad = torch.randn(n, generator=g) * 1e-3
        layers.append(q)
    return layers


def _timed(fn: Any, reps: int, device: torch.device) -> float:
    """Median of ``reps`` calls, each the slowest rank's (barrier before, max after)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        times.append(float(dt))
    return statistics.median(times)


def bench_scale(
    name: str, scale: float, args: argparse.Namespace, model: CostModel, p: int
) -> dict[str, Any]:
    params = _layers(name, scale)
    group = {"trust_coefficient": 0.001, "weight_decay": 5e-5, "eps": 1e-8, "lr": 0.1, "trust_clip": False}
    groups = [group] * len(params)
    grads = [q.grad for q in params if q.grad is not None]
    local = LARS([{"params": params, "weight_decay": 5e-5}], lr=0.1)
    pto = LARS([{"params": params, "weight_decay": 5e-5}], lr=0.1, parallel=ParallelTensorOperator())
    contenders = {
        "local": lambda: local.trust_ratios(params, grads, groups),
        "pto": lambda: pto.trust_ratios(params, grads, groups),
    }
    for fn in contenders.values():
        fn()
    assert torch.equal(contenders["local"](), contenders["pto"]())  # the same ratios, bit for bit
    times: dict[str, list[float]] = {c: [] for c in contenders}
    device = torch.device("cpu")
    for r in range(args.rounds):
        for c in contenders if r % 2 == 0 else list(contenders)[::-1]:
            times[c].append(_timed(contenders[c], args.reps, device))
    sizes = [q.numel() for q in params]
    share, width = largest_share(sizes, p)
    local_s = statistics.median(times["local"])
    predicted = model.parallel_tensor_op(local_s, share, width)
    ratios = [t / lo for t, lo in zip(times["pto"], times["local"], strict=True)]
    return {
        "model": name,
        "scale": scale,
        "layers": len(params),
        "elements": sum(sizes),
        "local_ms": local_s * 1e3,
        "pto_ms": statistics.median(times["pto"]) * 1e3,
        "pto_x_local": statistics.median(ratios),
        "pto_x_local_min": min(ratios),
        "pto_x_local_max": max(ratios),
        "predicted_pto_ms": predicted * 1e3,
        "predicted_pays": predicted < local_s,
        "largest_share": share,
    }


def markdown(result: dict[str, Any]) -> str:
    cols = ["model", "scale", "elements", "local ms", "pto ms", "pto / local (range)", "predicted pto ms",
            "pays (measured / predicted)"]  # fmt: skip
    rows = [
        [
            r["model"], f"{r['scale']:g}", f"{r['elements']:,}", f"{r['local_ms']:.3f}", f"{r['pto_ms']:.3f}",
            f"{r['pto_x_local']:.2f} ({r['pto_x_local_min']:.2f}-{r['pto_x_local_max']:.2f})",
            f"{r['predicted_pto_ms']:.3f}",
            f"{'yes' if r['pto_x_local'] < 1 else 'no'} / {'yes' if r['predicted_pays'] else 'no'}",
        ]
        for r in result["rows"]
    ]  # fmt: skip
    head = f"`{result['command']}`: {result['world']} ranks as {result['nodes']} x {result['per_node']}"
    gather = result.get("gather_start_s")
    measured = f", a world all-gather of one value per rank {gather * 1e3:.3f} ms" if gather else ""
    return head + f", link {result['link'] or 'unshaped'}{measured}\n\n" + markdown_table(cols, rows)


def main(args: argparse.Namespace) -> int:
    status = run_emulated(args, "bench pto")
    if status is not None:
        return status
    torch.set_num_threads(args.threads)
    topo = join_world(args.timeout, args.nodes, args.per_node)
    params = calibrate(topo)
    model = CostModel(params, topo.nodes, topo.per_node)
    rows = [
        bench_scale(name, scale, args, model, topo.world)
        for name in pick_names(args.models, MODELS, "--models")
        for scale in _scales(args.scales)
    ]
    link = os.environ.get("TB_RATE")  # set by the emulated cluster
    result = {
        "command": "gradsync bench pto " + " ".join(getattr(args, "argv", [])[2:] or []),
        "world": topo.world,
        "nodes": topo.nodes,
        "per_node": topo.per_node,
        "link": link,
        "link_bytes_per_s": link_bytes_per_s(link),
        "alpha_inter_s": params.inter.alpha,
        "gather_start_s": params.gather_start,
        "rows": rows,
    }
    if topo.rank == 0:
        text = markdown(result)
        print(text)
        save_result(result, args.json, args.markdown, text)
    dist.destroy_process_group()
    return 0
