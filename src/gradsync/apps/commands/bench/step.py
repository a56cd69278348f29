"""``gradsync bench step``: where a training step's time goes, per synchronization scheme.

Launch it like the collectives benchmark (torchrun, or ``launch.sh`` on the emulated cluster).
For one model and per-worker batch it runs, in the same session and on the same data:

- ``local``: no synchronization at all (the compute-only reference);
- ``ddp``: PyTorch DistributedDataParallel, dense all-reduce, default buckets;
- every gradsync scheme given (``gradsync.wrap(model, scheme)``);
- the optimizers that synchronize the model themselves (``onebit-adam``, ``zeroone-adam``,
  ``onebit-lamb``, measured in their compressed phase) and the DiLoCo-family outer loop
  (``outer@every=H@...``, DDP inside each node).

The model is an image classifier (``--model vgg``, random images and labels) or a language model
(``--model transformer``, random token ids, the next token as the label; ``--dim``/``--layers``
size the Transformer).

Per contender it reports the median over the measured steps of the slowest rank's times:
forward, backward (``loss.backward()``, which includes waiting for the synchronization), the
optimizer step, and the whole step (with the ranks' mean step beside it, how far the slowest
rank lags); the **exposed synchronization** (the part of the step the
synchronization added: for gradsync the engine's measurement from the end of the backward pass
to the last synchronized gradient, for DDP its backward time minus ``local``'s); gradsync's
compression time (packing, encoding, decoding on its threads) and communication time; the bytes
sent per worker per step by level and, on the emulated cluster, the bytes that left each node.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync
from gradsync.apps.command_line import command_line
from gradsync.apps.commands.bench.support import nic as bench_nic
from gradsync.apps.commands.bench.support.output import markdown_table, save_result
from gradsync.apps.commands.bench.support.sharding import shard_model
from gradsync.apps.commands.bench.support.world import (
    CableMeter,
    add_world_arguments,
    join_world,
    slowest_and_mean,
)
from gradsync.apps.models import build_model, build_model_for, models_for, parameter_count
from gradsync.codecs.config import split_spec_list
from gradsync.collectives import Topology
from gradsync.integrate.wrap import check_trace_path
from gradsync.observe.profiler import default_loss
from gradsync.sync import SyncConfig
from gradsync.sync.config import parse_options
from gradsync.whatif.modes import (
    SELF_SYNCING,
    is_outer,
    is_self_syncing,
    outer_options,
    self_syncing_options,
)
from gradsync.whatif.sharded import is_sharded, sharded_contender

DEFAULT_CONTENDERS = "local,ddp,hierarchical,hitopk:density=0.01,powersgd:rank=4"


@dataclass
class StepRow:
    contender: str
    step_ms: float
    forward_ms: float
    backward_ms: float
    optimizer_ms: float
    exposed_ms: float | None
    compress_ms: float | None = None
    comm_ms: float | None = None
    sent_mb: dict[str, float] = field(default_factory=dict)
    cable_mb: float | None = None
    compressed_buckets: str = ""
    steps: int = 0
    round_step_ms: list[float] = field(default_factory=list)
    """With interleaved rounds: the step time of each round (``step_ms`` is their median)."""
    mean_step_ms: float | None = None
    """The ranks' mean step, where ``step_ms`` is the slowest rank's: how far the slowest rank lags
    (``gradsync bench whatif`` reads it from ``local``, :attr:`gradsync.whatif.simulate.Cpu.lag_s`)."""
    # with --nic (see gradsync.apps.commands.bench.support.nic): the communication phase's
    # throughput, mean over nodes
    nic_mb_per_s: float | None = None
    nic_link_pct: float | None = None
    nic_peak_pct: float | None = None
    nic_busy_pct: float | None = None


def check_contender(name: str) -> str:
    """Validate a contender name: ``local``, ``ddp``, ``ddp-fp16``, ``ddp-powersgd[:rank=R]`` or a
    gradsync scheme, optionally with its own sync options after ``@``
    (``hierarchical@grad_as_bucket_view=true@bucket_bytes=26214400``)."""
    if name in ("local", "ddp", "ddp-fp16"):
        return name
    if name.startswith("ddp-powersgd"):
        _powersgd_rank(name)
        return name
    if is_outer(name):
        outer_options(name)
        return name
    if is_self_syncing(name):
        self_syncing_options(name)
        return name
    if is_sharded(name):
        sharded_contender(name)
        return name
    scheme, options = contender_options(name)
    SyncConfig.from_options({"scheme": scheme, **options})  # validates both
    return name


def contender_options(name: str) -> tuple[str, dict[str, str]]:
    """``scheme@key=value@...`` -> the scheme and the contender's own sync options."""
    scheme, *items = name.split("@")
    try:
        return scheme, parse_sync_options(items)
    except ValueError:
        raise ValueError(f"contender {name!r}: options after '@' take KEY=VALUE") from None


def is_ddp(name: str) -> bool:
    return name == "ddp" or name.startswith("ddp-")


INNER_OPTIMIZERS = ("sgd", "adamw")


def inner_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """Every contender's optimizer but the self-syncing ones: ``--optimizer sgd`` (lr 0.01,
    momentum 0.9) or ``adamw`` (lr 1e-3, what the self-syncing Adam family is compared with)."""
    if getattr(args, "optimizer", "sgd") == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


def measured_steps(name: str, steps: int) -> int:
    """Steps to measure: ``steps``, or for an outer contender whole outer periods (at least one),
    so that its meetings weigh in as often as they happen."""
    if not is_outer(name):
        return steps
    every = outer_options(name)["every"]
    return every * max(1, -(-steps // every))


def _powersgd_rank(name: str) -> int:
    rest = name[len("ddp-powersgd") :]
    if rest == "":
        return 1
    key, eq, value = rest.lstrip(":").partition("=")
    if not rest.startswith(":") or key != "rank" or not eq or not value.isdigit() or int(value) < 1:
        raise ValueError(f"contender {name!r}: expected ddp-powersgd or ddp-powersgd:rank=R with R >= 1")
    return int(value)


@dataclass
class Carry:
    """What a contender keeps from one round of interleaved measurement to the next (its model is
    built afresh for each round, so that only one contender's buffers are alive at a time):
    gradsync's engine state (the plan and the compression state: a later round neither re-plans
    nor restarts error feedback) or the state of PyTorch's PowerSGD hook (its step count and
    error feedback: the hook's dense start is not repeated)."""

    engine_state: dict[str, Any] | None = None
    engine_costs: dict[str, Any] | None = None  # the closed loop's refit, as engine.costs() gave it
    hook_state: Any = None
    rounds: int = 0


def powersgd_bucket_mb(model: nn.Module) -> float | None:
    """DDP's bucket size for PyTorch's PowerSGD hook here: one bucket holding the whole model on
    gloo (see :func:`ddp_model`), DDP's default (None) under NCCL."""
    if torch.cuda.is_available():
        return None
    return sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1


def ddp_model(name: str, model: nn.Module, warmup: int, carry: Carry | None = None) -> nn.Module:
    """PyTorch DDP, with PyTorch's own fp16 or PowerSGD communication hook when asked. The
    PowerSGD hook's dense warm-up (``start_powerSGD_iter``) ends inside the unmeasured steps."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

    if name.startswith("ddp-powersgd"):
        # one bucket: under gloo the hook's second all-reduce of a bucket is issued from a
        # completion callback, which can interleave with the next bucket's first all-reduce
        # differently on each rank (a collective mismatch); with one bucket there is nothing to
        # interleave. (NCCL orders them on its stream, so GPU runs keep DDP's default buckets.)
        ddp = DDP(model, bucket_cap_mb=powersgd_bucket_mb(model))
    else:
        ddp = DDP(model)
    if name == "ddp-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif name.startswith("ddp-powersgd"):
        state = carry.hook_state if carry is not None and carry.hook_state is not None else None
        if state is None:
            state = psgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=_powersgd_rank(name),
                start_powerSGD_iter=max(2, warmup),
            )
        if carry is not None:
            carry.hook_state = state
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    return ddp


SETTLE_STEPS = 160
"""At most this many more unmeasured steps while a gradsync contender's closed loop is still
re-planning (by default it settles within 3 x 4 steps of the first plan and 2 x 13 of its
trials' duels, and where the steps are noisy within 3 x 4 + 2 x 69: each duel then runs its two
plans in five blocks of 8, 16, 16, 16 and 8 steps, each after one unmeasured step): the
measured steps are those of the plan the run goes on with."""


def _settling(synced: gradsync.GradSync | None) -> bool:
    return synced is not None and synced.engine.loop.active


ROUND_WARMUP = 1
"""Unmeasured steps of a contender in every round after its first: the model is new (DDP
rebuilds its buckets in its first step), the plan and the compression state are carried."""


def unmeasured_steps(name: str, warmup: int, later: bool) -> int:
    """Steps before the measured ones: ``warmup`` in a contender's first round, ``ROUND_WARMUP``
    in a later one, except for a self-syncing optimizer, which nothing carries from round to
    round (it is made afresh): every round it warms up as in the first, and at least through its
    dense warm-up and its first compressed step, which allocates and first touches its buffers
    (on VGG 1.2 s more than the steps after it): the measured steps are its steady state, the
    step whatif predicts. An outer loop is made afresh every round too, and its first meeting of
    each fragment allocates and first touches the outer optimizer's buffers (on VGG alone 108 ms
    of the loop's own work in the first period, 45-55 ms in the later ones; on the 4 x 1 cluster
    0.15-0.5 s more for the exchange step): every round it warms up through a whole period and its
    delay, so that every fragment has met and landed once."""
    if is_self_syncing(name):
        options = self_syncing_options(name)
        dense = int(options.get("var_freeze_step", options["freeze_step"]))
        return max(warmup, dense + 1)
    if is_outer(name):
        options = outer_options(name)
        return max(warmup, options["every"] + options.get("delay", 0))
    return ROUND_WARMUP if later else warmup


def measure_contender(
    name: str, base: nn.Module, topo: Topology, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace,
    carry: Carry | None = None,
) -> tuple[StepRow, dict[str, Any]]:  # fmt: skip
    """One contender's steps: ``args.warmup`` unmeasured then ``args.steps`` measured, or, in a
    later round of interleaved measurement (``carry`` from the earlier rounds), ``ROUND_WARMUP``
    unmeasured ones on a model built afresh with the carried state."""
    later = carry is not None and carry.rounds > 0
    warmup = unmeasured_steps(name, args.warmup, later)
    model: nn.Module = copy.deepcopy(base)
    synced = None
    outer = None
    self_syncing = is_self_syncing(name)
    if is_ddp(name):
        model = ddp_model(name, model, args.warmup, carry)
    elif is_outer(name):  # each node alone (DDP inside it), the nodes meet every H steps
        outer = gradsync.OuterLoop(model, topology=topo, **outer_options(name))
        if outer.inner_group is not None and outer.topo.per_node > 1:
            model = DDP(model, process_group=outer.inner_group)
    elif is_sharded(name):  # FSDP2, HSDP or replicate, unit by unit
        model, _compression = shard_model(model, name, topo)
    elif name != "local" and not self_syncing:
        scheme, own = contender_options(name)
        options = dict(
            SyncConfig.from_options(
                {**parse_sync_options(args.sync_option), **own, "scheme": scheme}
            ).to_dict()
        )
        trace = trace_path(args.trace, name) if getattr(args, "trace", None) and not later else None
        window = (warmup, warmup + args.steps)  # the measured steps
        synced = gradsync.wrap(
            model, topology=topo, trace=trace, trace_steps=window if trace else None, **options
        )
        if later and carry is not None and carry.engine_state is not None:
            synced.engine.load_state_dict(carry.engine_state)
        model = synced
    if self_syncing:  # the optimizer synchronizes the (unwrapped) model itself
        kind = name.split("@")[0]
        opt = SELF_SYNCING[kind](model.parameters(), topology=topo, **self_syncing_options(name))
    else:
        opt = inner_optimizer(model, args)
    samples: list[list[float]] = []
    mean_steps: list[float] = []  # the ranks' mean step (each step's ``samples`` are the slowest rank's)
    sent: list[dict[str, int]] = []
    meter = CableMeter(topo)
    probe = bench_nic.NicProbe(args, topo)
    step, measuring = 0, False
    count = measured_steps(name, args.steps)
    while len(samples) < count:
        if not measuring and step >= warmup and not (_settling(synced) and step < warmup + SETTLE_STEPS):
            measuring = True
            meter.start()
            probe.start()
        dist.barrier()
        t0 = time.perf_counter()
        loss = default_loss(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if outer is not None:
            outer.step()
        t3 = time.perf_counter()
        st = synced.last_stats if synced is not None else None
        if measuring:
            # the communication phase: from backward's start to the end of the synchronization
            # (gradsync's engine says when; DDP's is over when backward returns)
            end = st.done_at if st is not None and t1 <= st.done_at <= t2 else t2
            probe.record(t0, t1, end, t3)
        row = [t3 - t0, t1 - t0, t2 - t1, t3 - t2]
        row += [st.exposed_s, st.compute_s + st.decode_s, st.comm_s] if st is not None else [0.0, 0.0, 0.0]
        row, mean = slowest_and_mean(row)
        if measuring:
            samples.append(row)
            mean_steps.append(mean[0])
            if st is not None:
                sent.append(st.sent_bytes)
            elif outer is not None:
                sent.append(outer.traffic.take())
            elif self_syncing:
                sent.append(opt.traffic.take())
        elif outer is not None:
            outer.traffic.take()
        elif self_syncing:
            opt.traffic.take()
        step += 1
    if outer is not None:
        outer.close()
    cable = meter.stop(count)
    nic_row, nic_details = probe.finish()
    # an outer contender's steps differ (most compute alone, one in H meets), as 0/1 Adam's do
    # (it skips synchronizations): their mean
    middle = statistics.mean if outer is not None or self_syncing else statistics.median
    med = [middle(col) * 1e3 for col in zip(*samples, strict=True)]
    levels = sorted({k for s in sent for k in s})
    result = StepRow(
        contender=name, step_ms=med[0], forward_ms=med[1], backward_ms=med[2], optimizer_ms=med[3],
        exposed_ms=med[4] if synced is not None else None,
        compress_ms=med[5] if synced is not None else None, comm_ms=med[6] if synced is not None else None,
        sent_mb={k: middle(s.get(k, 0) for s in sent) / 2**20 for k in levels},
        cable_mb=cable / 2**20 if cable is not None else None, steps=count,
        mean_step_ms=middle(mean_steps) * 1e3,
    )  # fmt: skip
    for key, value in nic_row.items():
        setattr(result, key, value)
    extra: dict[str, Any] = {}
    if synced is not None:
        st = synced.last_stats
        assert st is not None  # the wrapped model synchronized every step above
        result.compressed_buckets = f"{st.compressed_buckets}/{st.buckets}"
        plan = synced.engine.plan
        extra = {
            "plan": synced.plan_table(),
            "plan_buckets": plan.to_state() if plan is not None else [],
            "last_step": st.to_dict(),
            "closed_loop": {**synced.engine.loop.state_dict(), "rounds": synced.engine.loop.history},
        }
        # the closed loop's last refit (rank 0; None before a round, and in a later round's new
        # engine, which goes on from the carried plan: the first round's refit is kept)
        costs = synced.engine.costs()
        refitted = costs.to_dict() if costs is not None else None
        if carry is not None:
            refitted = refitted or carry.engine_costs
            carry.engine_costs = refitted
        if refitted is not None:
            extra["engine_costs"] = refitted
        if carry is not None:
            carry.engine_state = synced.engine.state_dict()
        synced.close()
    if self_syncing:  # the optimizer's steps measured (0/1 Adam's exchanges follow its step count)
        extra["optimizer_steps"] = [warmup + 1, warmup + count]
    if carry is not None and carry.hook_state is not None:  # what PyTorch's PowerSGD hook sent
        from gradsync.observe.hook_costs import powersgd_hook_sent

        extra["hook_sent"] = powersgd_hook_sent(carry.hook_state, sum(p.numel() for p in base.parameters()))
    if carry is not None:
        carry.rounds += 1
    if nic_details:
        extra["nic"] = nic_details
    return result, extra


def parse_sync_options(items: list[str] | None) -> dict[str, str]:
    return parse_options(items)


def join_with_batch(args: argparse.Namespace) -> tuple[Topology, nn.Module, torch.Tensor, torch.Tensor]:
    """What every training benchmark starts from: this rank in the world, the model (the same
    weights on every rank) and this rank's batch of random images and labels."""
    torch.set_num_threads(args.threads)
    topo = join_world(args.timeout, args.nodes, args.per_node)
    torch.manual_seed(0)
    base = bench_model(args)
    x, y = bench_batch(args, torch.Generator().manual_seed(topo.rank))
    return topo, base, x, y


def bench_batch(args: argparse.Namespace, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One worker's batch for the benchmark's model: random images and labels, or random token
    ids with each position's label the next one."""
    if is_language_model(args.model):
        tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=g)
    y = torch.randint(0, args.classes, (args.batch_size,), generator=g)
    return x, y


def is_language_model(name: str) -> bool:
    return name in models_for("lm")


def bench_model(args: argparse.Namespace) -> nn.Module:
    """The benchmark's model: an image classifier for ``--image-size``/``--classes`` or a language
    model for ``--seq-len``/``--vocab`` (the Transformer sized by ``--dim``/``--layers``)."""
    if not is_language_model(args.model):
        return build_model_for(args.model, "classify", (3, args.image_size, args.image_size), args.classes)
    if args.model == "transformer" and (args.dim is not None or args.layers is not None):
        size = {"dim": args.dim or 128, "layers": args.layers or 2}
        return build_model(
            "transformer", vocab_size=args.vocab, seq_len=args.seq_len, heads=4, ff=4 * size["dim"], **size
        )
    return build_model_for(args.model, "lm", (args.seq_len,), args.vocab)


def model_label(args: argparse.Namespace) -> str:
    """``vgg``, or ``transformer dim=512 layers=4`` when sized."""
    sized = [f"{k}={getattr(args, k)}" for k in ("dim", "layers") if getattr(args, k, None) is not None]
    return " ".join([args.model, *sized])


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    contenders = [check_contender(c) for c in split_spec_list(args.contenders)]
    topo, base, x, y = join_with_batch(args)
    rank0 = topo.rank == 0
    if rank0:
        print(
            f"gradsync bench step: {model_label(args)} ({parameter_count(base) / 1e6:.1f} M parameters), "
            f"batch {args.batch_size} per worker, {topo.nodes} x {topo.per_node} ranks, "
            f"link {os.environ.get('TB_RATE', 'unknown')}",
            file=sys.stderr,
            flush=True,
        )
    rows, extras = [], {}
    local_backward = None
    for name in contenders:
        row, extra = measure_contender(name, base, topo, x, y, args)
        if name == "local":
            local_backward = row.backward_ms
        if is_ddp(name) and local_backward is not None:
            row.exposed_ms = max(row.backward_ms - local_backward, 0.0)
        rows.append(row)
        extras[name] = extra
        if rank0:
            print(f"  {name:36s} step {row.step_ms:9.1f} ms", file=sys.stderr, flush=True)
    result = {
        "command": command_line(),
        "model": model_label(args),
        "parameters": parameter_count(base),
        "batch_size": args.batch_size,
        "nodes": topo.nodes,
        "per_node": topo.per_node,
        "link": os.environ.get("TB_RATE"),
        "rows": [asdict(r) for r in rows],
        "details": extras,
    }
    if bench_nic.enabled(args):
        result["nic"] = bench_nic.summary(result)
    ddp = next((r for r in rows if r.contender == "ddp"), None)
    ours = [
        r for r in rows if r.contender != "local" and not is_ddp(r.contender) and r.exposed_ms is not None
    ]
    if ddp is not None and ddp.exposed_ms and ours:
        best = min(ours, key=lambda r: r.exposed_ms or 0.0)
        result["best"] = {
            "contender": best.contender,
            "exposed_over_ddp": (best.exposed_ms or 0.0) / ddp.exposed_ms,
            "speedup_over_ddp": ddp.step_ms / best.step_ms,
        }
    return result if rank0 else None


COLUMNS = ("contender", "step ms", "forward ms", "backward ms", "optimizer ms", "exposed sync ms",
           "compress ms", "comm ms", "MB sent/step (intra, inter, world)", "cable MB/step",
           "compressed buckets")  # fmt: skip


def _cells(r: dict[str, Any]) -> list[str]:
    def f(v: float | None, fmt: str = ".1f") -> str:
        return "" if v is None else format(v, fmt)

    sent = r["sent_mb"]
    levels = ", ".join(f(sent.get(k), ".2f") or "0" for k in ("intra", "inter", "world")) if sent else ""
    return [r["contender"], f(r["step_ms"]), f(r["forward_ms"]), f(r["backward_ms"]), f(r["optimizer_ms"]),
            f(r["exposed_ms"]), f(r["compress_ms"]), f(r["comm_ms"]), levels, f(r["cable_mb"], ".2f"),
            r["compressed_buckets"]]  # fmt: skip


def columns(result: dict[str, Any]) -> tuple[str, ...]:
    """The table's columns: the NIC figures' only with ``--nic``."""
    return COLUMNS + bench_nic.COLUMNS if "nic" in result else COLUMNS


def cells(result: dict[str, Any], r: dict[str, Any]) -> list[str]:
    return _cells(r) + bench_nic.cells(r) if "nic" in result else _cells(r)


def markdown(result: dict[str, Any]) -> str:
    return markdown_table(columns(result), [cells(result, r) for r in result["rows"]])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="vgg", choices=models_for("classify") + models_for("lm"))
    p.add_argument("--batch-size", type=int, default=16, help="samples (sequences) per worker")
    p.add_argument("--image-size", type=int, default=32, help="image classifiers' input size")
    p.add_argument("--classes", type=int, default=10, help="image classifiers' class count")
    p.add_argument("--seq-len", type=int, default=64, help="language models' sequence length")
    p.add_argument("--vocab", type=int, default=256, help="language models' vocabulary")
    p.add_argument("--dim", type=int, help="the Transformer's width (default 128; a multiple of 4)")
    p.add_argument("--layers", type=int, help="the Transformer's block count (default 2)")
    p.add_argument("--optimizer", default="sgd", choices=INNER_OPTIMIZERS,
                   help="every contender's optimizer but the self-syncing ones (default sgd)")  # fmt: skip
    p.add_argument("--contenders", default=DEFAULT_CONTENDERS,
                   help="comma-separated: local, ddp and gradsync schemes, each with its own sync "
                        "options after '@' (hierarchical@grad_as_bucket_view=true)")  # fmt: skip
    p.add_argument("--sync-option", action="append", metavar="KEY=VALUE",
                   help="a gradsync SyncConfig option for every scheme (repeatable)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps (gradsync plans after the first)")
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    add_world_arguments(p, timeout_s=900.0)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--trace", metavar="PATH", help="a timeline of each gradsync contender's measured steps: "
                   "PATH's stem + .CONTENDER.json (Chrome trace JSON, opens in Perfetto)")  # fmt: skip
    bench_nic.add_arguments(p)


def trace_path(base: str, contender: str) -> str:
    """``trace.json`` + ``hitopk:density=0.01`` -> ``trace.hitopk-density=0.01.json``."""
    stem = base[: -len(".json")] if base.endswith(".json") else base
    return f"{stem}.{re.sub(r'[^A-Za-z0-9_.=+-]', '-', contender)}.json"


def check_sizes(args: argparse.Namespace, more: tuple[str, ...]) -> None:
    """The model's and the batch's sizes and the options ``more`` are at least 1; ``--dim`` and
    ``--layers`` size the Transformer only (``ValueError`` naming the option)."""
    sizes = ("batch_size", "image_size", "classes", "seq_len", "vocab", "dim", "layers", *more)
    for name in sizes:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    for name in ("dim", "layers"):
        if getattr(args, name, None) is not None and args.model != "transformer":
            raise ValueError(f"--{name} sizes --model transformer only, not {args.model!r}")
    if getattr(args, "dim", None) is not None and args.dim % 4:
        raise ValueError(f"--dim must be a multiple of 4 (the Transformer's heads), got {args.dim}")


def check(args: argparse.Namespace) -> None:
    """The option values, before the process group starts (``ValueError`` naming the option)."""
    check_sizes(args, ("steps", "threads"))
    if args.warmup < 1:
        raise ValueError(
            f"--warmup must be at least 1 (gradsync plans after its first step), got {args.warmup}"
        )
    if (args.nodes is None) != (args.per_node is None):
        raise ValueError("--nodes and --per-node go together")
    if args.trace is not None:
        try:
            check_trace_path(args.trace)
        except ValueError as e:
            raise ValueError(f"--trace: {e}") from e
    for c in split_spec_list(args.contenders):
        check_contender(c)
    SyncConfig.from_options(parse_sync_options(args.sync_option))
    bench_nic.check(args)


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`)."""
    owned = not dist.is_initialized()  # leave a process group the caller made alone
    result = run(args)
    if result is not None:
        from rich.console import Console
        from rich.table import Table

        where = f"{result['nodes']} x {result['per_node']} ranks, link {result['link']}"
        table = Table(title=f"training step, {result['model']}, {where}")
        for col in columns(result):
            table.add_column(col, justify="left" if col == "contender" else "right")
        for r in result["rows"]:
            table.add_row(*cells(result, r))
        (Console() if sys.stdout.isatty() else Console(width=260)).print(table)
        bench_nic.say_reason(result)
        if "best" in result:
            b = result["best"]
            share, speedup = 100 * b["exposed_over_ddp"], b["speedup_over_ddp"]
            print(
                f"best gradsync scheme {b['contender']}: exposed sync {share:.1f}% of DDP's, "
                f"step {speedup:.2f}x faster"
            )
        save_result(result, args.json, args.markdown, markdown(result))
        if args.nic_png and bench_nic.plot(result, args.nic_png):
            print(f"NIC throughput plot: {args.nic_png}")
    if owned and dist.is_initialized():
        dist.destroy_process_group()
    return 0
