"""Contenders' own work beyond the profiled step, measured in a process of its own (``bench whatif``).

- A self-syncing optimizer (1-bit Adam, 0/1 Adam, 1-bit LAMB) does much more in its ``step()``
  than SGD: its moments, and copies of the gradients and parameters into and out of flat
  buffers, besides the momentum exchange. Measured: the optimizer's step on a world of one rank
  (where it exchanges nothing), minus the step of the benchmark's own optimizer (the one the
  profile timed).
- FSDP2 (``fsdp``, ``hsdp``, ``replicate``, each optionally ``/SCHEME``) runs hooks around every
  unit's forward and backward and copies parameters and gradients into and out of its flat
  buffers. Measured: the whole step of the model sharded on a world of one rank (its collectives
  have no peer), minus the plain model's step. A compressed contender is measured with the
  scheme ``none``: gradsync's FSDP2 plumbing with PyTorch's collectives, without the codec,
  whose work the simulator prices from the codec's own timing.
- The outer loop (``outer@...``) makes, for each fragment it exchanges, the pseudo-gradient
  (the anchor minus the parameters, into one flat float32 buffer) and, when the exchange lands,
  the outer optimizer's step on the anchor and the parameters. Measured: the loop's ``step()``
  timed by itself after every inner step over whole periods, on a world of one rank (where
  nothing crosses: the codec and the exchange are the simulator's to price); the median period,
  per float32 byte of a fragment, as the simulator charges it at each meeting. (The difference
  of whole periods with and without the loop, measured until issue 44's twelfth session, hid
  about 40 ms of work in about 2 s of inner steps: it read 9-37 ms per period on VGG where the
  loop's step alone takes 44-50 ms.)

The simulator prices the communication with the cost model and charges this work on the
training thread, per gradient byte.

A launched world cannot make a one-rank topology, so ``bench whatif`` runs this module in a
fresh Python process on its rank 0::

    python -m gradsync.apps.commands.bench.support.own_work '{"options": {...}, "contenders": [...]}'

and reads the JSON it prints: contender name -> seconds per gradient byte.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from typing import Any

from gradsync.whatif.modes import is_outer
from gradsync.whatif.sharded import is_sharded, sharded_contender

STEPS = 5


def _step_seconds(opt: Any, model: Any, x: Any, y: Any, warmup: int = 2, whole: bool = False) -> float:
    """Median seconds of ``opt.step()`` alone, or with ``whole`` of the whole training step."""
    from gradsync.observe.profiler import default_loss

    times = []
    for i in range(warmup + STEPS):
        t0 = time.perf_counter()
        default_loss(model(x), y).backward()
        if not whole:
            t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def outer_work_periods(
    name: str, base: Any, x: Any, y: Any, args: argparse.Namespace, topo: Any
) -> list[float]:
    """Seconds the outer loop ``name``'s ``step()`` takes by itself in each period of inner steps
    (``every`` of them; the first holds the delay too): at least two whole periods after the first,
    which makes and first touches the loop's buffers at its first meetings."""
    from gradsync.apps.commands.bench import step as bench_step
    from gradsync.observe.profiler import default_loss
    from gradsync.outer import OuterLoop
    from gradsync.whatif.modes import outer_options

    o = outer_options(name)
    every, delay = o["every"], o.get("delay", 0)
    periods = max(2, -(-2 * STEPS // every))  # whole periods, at least 2 x STEPS steps
    model = copy.deepcopy(base)
    opt = bench_step.inner_optimizer(model, args)
    loop = OuterLoop(model, topology=topo, **o)
    spent = []
    for _ in range(every + delay + periods * every):
        default_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loop.step()
        spent.append(time.perf_counter() - t0)
    loop.close()
    first = every + delay
    return [sum(spent[:first])] + [sum(spent[i : i + every]) for i in range(first, len(spent), every)]


def _outer_seconds_per_byte(
    name: str, base: Any, x: Any, y: Any, args: argparse.Namespace, topo: Any
) -> float:
    """The outer loop's own work per float32 byte of a fragment at each of its meetings: the median
    period after the first of :func:`outer_work_periods` (see the module)."""
    per_period = statistics.median(outer_work_periods(name, base, x, y, args, topo)[1:])
    numel = sum(p.numel() for p in base.parameters() if p.requires_grad)
    return per_period / max(4 * numel, 1)  # each byte meets once per period


def plumbing(name: str) -> str:
    """The sharded contender measured for ``name``'s own work: itself when dense, else its kind with
    the scheme ``none`` (gradsync's FSDP2 plumbing without a codec)."""
    kind, scheme = sharded_contender(name)
    return kind if scheme is None else f"{kind}/none"


def measure(options: dict[str, Any], contenders: list[str]) -> dict[str, float]:
    """Seconds per gradient byte each contender's step takes beyond the profiled step's
    (``options``: the benchmark's model and batch options), in this process alone: the
    self-syncing optimizers' step, the sharded contenders' whole step; for the outer loop, per
    float32 byte of a fragment at each meeting."""
    import torch

    from gradsync.apps.commands.bench import step as bench_step
    from gradsync.apps.commands.bench.support.sharding import shard_model
    from gradsync.collectives import Topology
    from gradsync.observe.hook_costs import one_rank_world
    from gradsync.whatif.modes import SELF_SYNCING, self_syncing_options

    args = argparse.Namespace(**options)
    torch.set_num_threads(getattr(args, "threads", 1))
    torch.manual_seed(0)
    base = bench_step.bench_model(args)
    nbytes = sum(p.numel() * p.element_size() for p in base.parameters() if p.requires_grad)
    x, y = bench_step.bench_batch(args, torch.Generator().manual_seed(0))
    out: dict[str, float] = {}
    with one_rank_world():
        topo = Topology()
        fresh = copy.deepcopy(base)  # every measurement starts from the untrained model
        reference = _step_seconds(bench_step.inner_optimizer(fresh, args), fresh, x, y, 2)
        fresh = copy.deepcopy(base)
        plain = _step_seconds(bench_step.inner_optimizer(fresh, args), fresh, x, y, whole=True)
        measured: dict[str, float] = {}
        for name in contenders:
            if is_outer(name):
                out[name] = _outer_seconds_per_byte(name, base, x, y, args, topo)
                continue
            if is_sharded(name):
                how = plumbing(name)
                if how not in measured:
                    model, _ = shard_model(copy.deepcopy(base), how, topo)
                    measured[how] = _step_seconds(
                        bench_step.inner_optimizer(model, args), model, x, y, whole=True
                    )
                out[name] = max(measured[how] - plain, 0.0) / max(nbytes, 1)
                continue
            options_ = self_syncing_options(name)
            fresh = copy.deepcopy(base)
            opt = SELF_SYNCING[name.split("@")[0]](fresh.parameters(), topology=topo, **options_)
            warmup = int(options_.get("var_freeze_step", options_.get("freeze_step", 1))) + 2
            mine = _step_seconds(opt, fresh, x, y, warmup)
            out[name] = max(mine - reference, 0.0) / max(nbytes, 1)
    return out


def measure_in_subprocess(
    options: dict[str, Any], contenders: list[str], timeout_s: float = 600.0
) -> dict[str, float]:
    """:func:`measure` in a fresh Python process (no process group of the caller's there)."""
    payload = json.dumps({"options": options, "contenders": contenders})
    command = [sys.executable, "-m", __name__, payload]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        why = done.stderr.strip()[-2000:]
        raise RuntimeError(f"measuring the contenders' own work in a one-rank world failed: {why}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return {str(k): float(v) for k, v in json.loads(lines[-1]).items()}


def main() -> int:
    doc = json.loads(sys.argv[1])
    print(json.dumps(measure(doc["options"], doc["contenders"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
