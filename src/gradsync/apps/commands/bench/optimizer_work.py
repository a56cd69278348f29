"""The self-syncing optimizers' own step work, measured in a process of its own (``bench whatif``).

A self-syncing optimizer (1-bit Adam, 0/1 Adam, 1-bit LAMB) does much more in its ``step()``
than SGD: its moments, and copies of the gradients and parameters into and out of flat buffers,
besides the momentum exchange. The simulator prices the exchange with the cost model; this
measures the rest: the optimizer's step on a world of one rank (where it exchanges nothing),
minus the step of the benchmark's own optimizer (the one the profile timed), per gradient byte.

A launched world cannot make a one-rank topology for the optimizer, so ``bench whatif`` runs
this module in a fresh Python process on its rank 0::

    python -m gradsync.apps.commands.bench.optimizer_work '{"options": {...}, "contenders": [...]}'

and reads the JSON it prints: contender name -> seconds per gradient byte.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

STEPS = 5


def _step_seconds(opt: Any, model: Any, x: Any, y: Any, warmup: int) -> float:
    from gradsync.observe.profiler import default_loss

    times = []
    for i in range(warmup + STEPS):
        default_loss(model(x), y).backward()
        t0 = time.perf_counter()
        opt.step()
        dt = time.perf_counter() - t0
        opt.zero_grad(set_to_none=True)
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def measure(options: dict[str, Any], contenders: list[str]) -> dict[str, float]:
    """Seconds per gradient byte each self-syncing contender's step takes beyond the benchmark's
    optimizer's (``options``: the benchmark's model and batch options), in this process alone."""
    import torch

    from gradsync.apps.commands.bench import step as bench_step
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
        reference = _step_seconds(bench_step.inner_optimizer(base, args), base, x, y, 2)
        for name in contenders:
            options_ = self_syncing_options(name)
            opt = SELF_SYNCING[name.split("@")[0]](base.parameters(), topology=topo, **options_)
            warmup = int(options_.get("var_freeze_step", options_.get("freeze_step", 1))) + 2
            mine = _step_seconds(opt, base, x, y, warmup)
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
        raise RuntimeError(f"measuring the self-syncing optimizers' step failed: {why}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return {str(k): float(v) for k, v in json.loads(lines[-1]).items()}


def main() -> int:
    doc = json.loads(sys.argv[1])
    print(json.dumps(measure(doc["options"], doc["contenders"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
