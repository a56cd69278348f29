"""``gradsync bench fsdp``: FSDP2 with and without gradsync's compression, in one run.

On the world it is launched in (torchrun, or the emulated cluster with ``--emulate 2x2 --link
100mbit``), every contender trains the same Transformer language model (its blocks sharded one
by one, as FSDP2's tutorial does, AdamW) on the same random tokens. Contenders:

- ``hsdp``: PyTorch's HSDP, ``fully_shard`` on a 2-D mesh (replicate across nodes, shard inside
  a node); ``hsdp/SCHEME``: the same sharding with the all-reduce across nodes compressed by
  gradsync (:func:`gradsync.fsdp.compress_fsdp` with ``replicate_group``);
- ``fsdp``: ``fully_shard`` over the whole world; ``fsdp/SCHEME``: its reduce-scatter compressed;
- ``replicate``: PyTorch's ``replicate()``; ``replicate/SCHEME``: :func:`gradsync.fsdp.replicate`;
- ``ddp``: plain DistributedDataParallel, for scale.

Contenders alternate in rounds (the order reversed every other round) so that the machine's
drift does not favour one; per contender the median step over the rounds, and per round its
step time against the first contender's. Bytes that left each node per step are read from the
emulated cluster's NICs (everything: FSDP's parameter all-gathers too); gradsync's own count of
what its collectives sent is reported beside them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.apps.commands.bench.support.output import markdown_table, save_result
from gradsync.apps.commands.bench.support.sharding import shard_model
from gradsync.apps.commands.bench.support.world import (
    CableMeter,
    add_world_arguments,
    join_world,
    max_over_ranks,
    run_emulated,
)
from gradsync.apps.commands.bench.train import check_world_options, round_order
from gradsync.apps.models import parameter_count
from gradsync.apps.models.text import TransformerLanguageModel
from gradsync.codecs.config import split_spec_list
from gradsync.collectives import Topology
from gradsync.collectives.topology import default_device
from gradsync.whatif.sharded import sharded_contender

KINDS = ("hsdp", "fsdp", "replicate", "ddp")
DEFAULT_CONTENDERS = "hsdp,hsdp/topk:density=0.01,hsdp/onebit,fsdp,fsdp/topk:density=0.01"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--contenders",
        default=DEFAULT_CONTENDERS,
        help=f"comma-separated KIND or KIND/SCHEME, KIND one of {', '.join(KINDS)} (ddp takes no scheme); "
        "the first is the baseline",
    )
    p.add_argument("--dim", type=int, default=256, help="the Transformer's width")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per contender and round")
    p.add_argument("--steps", type=int, default=5, help="measured steps per contender and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--emulate", metavar="NxM", help="run on an emulated cluster of this shape (root)")
    p.add_argument("--link", default="100mbit", help="the emulated cluster's cable rate (with --emulate)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")
    add_world_arguments(p, 300.0)


def parse_contender(text: str) -> tuple[str, str | None]:
    """``hsdp/topk:density=0.01`` -> ("hsdp", "topk:density=0.01"); raises naming the option."""
    kind, slash, scheme = text.strip().partition("/")
    if kind not in KINDS:
        raise ValueError(f"--contenders: {text!r}: the kind must be one of {', '.join(KINDS)}")
    if slash and not scheme.strip():
        raise ValueError(
            f"--contenders: {text!r}: give a scheme after the slash, e.g. {kind}/topk:density=0.01"
        )
    if kind == "ddp" and slash:
        raise ValueError(
            f"--contenders: {text!r}: ddp takes no scheme (see gradsync bench train for DDP hooks)"
        )
    if slash:
        try:
            sharded_contender(text.strip())  # the same checks compress_fsdp makes
        except ValueError as e:
            raise ValueError(f"--contenders: {e}") from None
    return kind, scheme.strip() or None


def check(args: argparse.Namespace) -> None:
    """The option values, before any process group or emulated cluster."""
    for name in ("dim", "layers", "seq_len", "vocab", "batch_size", "steps", "rounds", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be at least 0, got {args.warmup}")
    if args.dim % 4:
        raise ValueError(f"--dim must be a multiple of 4 (the attention heads), got {args.dim}")
    check_world_options(args)
    names = split_spec_list(args.contenders)
    if not names:
        raise ValueError(f"--contenders must name at least one contender, got {args.contenders!r}")
    for c in names:
        parse_contender(c)
        if names.count(c) > 1:
            raise ValueError(f"--contenders names {c!r} more than once")


def _model(args: argparse.Namespace) -> TransformerLanguageModel:
    torch.manual_seed(0)
    return TransformerLanguageModel(args.vocab, args.seq_len, args.dim, 4, args.layers, 4 * args.dim, 0.0)


def _wrapped(
    kind: str, scheme: str | None, args: argparse.Namespace, topo: Topology
) -> tuple[nn.Module, Any]:
    """The model as the contender trains it, and gradsync's compression object (or None)."""
    from torch.nn.parallel import DistributedDataParallel

    model = _model(args).to(default_device())  # the rank's GPU under NCCL (join_world made it current)
    if kind == "ddp":
        return DistributedDataParallel(model), None
    return shard_model(model, kind if scheme is None else f"{kind}/{scheme}", topo)


def measure(
    name: str, args: argparse.Namespace, topo: Topology, tokens: torch.Tensor, meter: CableMeter
) -> dict[str, Any]:
    """One contender for one round: warm-up steps, then the measured steps."""
    kind, scheme = parse_contender(name)
    model, comp = _wrapped(kind, scheme, args, topo)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    for _ in range(args.warmup):
        step()
    sent_before = dict(comp.traffic.sent) if comp is not None else {}
    dist.barrier()
    meter.start()
    start = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    elapsed = time.perf_counter() - start
    dist.barrier()
    cable = meter.stop(args.steps)
    step_ms = max_over_ranks([elapsed / args.steps * 1e3])[0]
    counted = {}
    if comp is not None:
        for level, n in comp.traffic.sent.items():
            counted[level] = (n - sent_before.get(level, 0)) / args.steps / 1e6
    return {
        "contender": name,
        "step_ms": step_ms,
        "cable_mb": None if cable is None else cable / 1e6,
        "gradsync_mb": counted,
        "loss": statistics.fmean(losses),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    topo = join_world(args.timeout, args.nodes, args.per_node)
    names = split_spec_list(args.contenders)
    g = torch.Generator().manual_seed(1 + topo.rank)
    tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g).to(
        default_device()
    )
    meter = CableMeter(topo)
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in round_order(names, r):
            rounds[name].append(measure(name, args, topo, tokens, meter))
    base = names[0]
    rows = []
    for name in names:
        rs = rounds[name]
        ratios = [b["step_ms"] / m["step_ms"] for b, m in zip(rounds[base], rs, strict=True)]
        cables = [m["cable_mb"] for m in rs if m["cable_mb"] is not None]
        levels = sorted({k for m in rs for k in m["gradsync_mb"]})
        rows.append(
            {
                "contender": name,
                "step_ms": statistics.median(m["step_ms"] for m in rs),
                "round_step_ms": [m["step_ms"] for m in rs],
                "speedup": statistics.median(ratios),
                "speedup_range": [min(ratios), max(ratios)],
                "cable_mb": statistics.median(cables) if cables else None,
                "gradsync_mb": {
                    k: statistics.median(m["gradsync_mb"].get(k, 0.0) for m in rs) for k in levels
                },
                "loss": rs[-1]["loss"],
            }
        )
    model = _model(args)
    return {
        "benchmark": "fsdp",
        "nodes": topo.nodes,
        "per_node": topo.per_node,
        "model": f"transformer dim={args.dim} layers={args.layers} "
        f"({parameter_count(model) / 1e6:.2f} M parameters)",
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "rounds": args.rounds,
        "steps": args.steps,
        "baseline": base,
        "rows": rows,
    }


def _num(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def markdown(result: dict[str, Any]) -> str:
    head = (
        "contender",
        "step ms (median)",
        f"speed-up over {result['baseline']} (median, range over rounds)",
        "MB/step that left each node (NIC)",
        "MB/step gradsync sent per rank (level)",
        "mean loss, last round",
    )
    rows = []
    for r in result["rows"]:
        lo, hi = r["speedup_range"]
        counted = ", ".join(f"{k} {v:.3f}" for k, v in r["gradsync_mb"].items()) or "-"
        rows.append(
            [
                f"`{r['contender']}`",
                f"{r['step_ms']:.1f}",
                f"{r['speedup']:.2f}x ({lo:.2f}-{hi:.2f})",
                _num(r["cable_mb"], ".3f"),
                counted,
                f"{r['loss']:.3f}",
            ]
        )
    title = (
        f"FSDP2 on {result['nodes']} x {result['per_node']}, {result['model']}, "
        f"batch {result['batch_size']} x {result['seq_len']} tokens per rank, "
        f"{result['rounds']} rounds of {result['steps']} steps\n\n"
    )
    return title + markdown_table(head, rows)


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`)."""
    status = run_emulated(args, "bench fsdp")
    if status is not None:
        return status
    owned = not dist.is_initialized()
    result = run(args)
    if dist.get_rank() == 0:
        text = markdown(result)
        print(text)
        save_result(result, args.json, args.markdown, text)
    if owned:
        dist.destroy_process_group()
    return 0
