"""``gradsync train``'s entry: check every option, then either run as a worker (inside torchrun,
where ``RANK`` is set) or start the workers with torchrun's own launcher
(``torch.distributed.run``, standalone rendezvous on a free port), which runs this same command
in each of them. On a real cluster run it under torchrun directly::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m gradsync train --scheme hitopk:density=0.01 ...
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Any

from gradsync.apps.train import arguments
from gradsync.apps.train.options import batch_plan, cache_config, validate
from gradsync.apps.train.resize import check_model_takes, parse_resize_schedule

__all__ = ["add_arguments", "check", "main"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of ``gradsync train`` (:mod:`gradsync.apps.train.arguments`)."""
    arguments.add_arguments(p)


def _workers(args: argparse.Namespace) -> int:
    return args.nproc or (args.nodes * args.per_node if args.nodes else 2)


def _check_data_and_model(args: argparse.Namespace) -> None:
    """Data spec, model name and batch size, checked before any process starts."""
    from gradsync.apps.data import build_data
    from gradsync.apps.models import build_model_for
    from gradsync.apps.train.trainer import default_model

    cache = cache_config(args, 0)
    if cache is not None:  # the launcher only lists and checks: no memory store of its own
        cache = replace(cache, memory=False)
    data = build_data(args.data, seq_len=args.seq_len, seed=args.seed, cache=cache)
    model = build_model_for(
        args.model or default_model(data.task), data.task, data.input_shape, data.num_classes
    )
    if args.resize_schedule is not None:
        if data.task != "classify":
            raise ValueError(f"--resize-schedule is for image data; --data {args.data} is a language model")
        stages = parse_resize_schedule(args.resize_schedule, native=data.input_shape[-1])
        check_model_takes(model, data.input_shape, stages)
    share = -(-len(data.train) // _workers(args))
    per_worker, _ = batch_plan(args, _workers(args))
    if per_worker > share:
        what = f"--batch-size {args.batch_size}" if args.global_batch is None else (
            f"--global-batch {args.global_batch} ({per_worker} per worker)"
        )  # fmt: skip
        raise ValueError(
            f"{what} is larger than a worker's share of the training data "
            f"({share} samples on each of {_workers(args)} workers)"
        )
    if args.label_smoothing and data.task != "classify":
        raise ValueError(f"--label-smoothing is for classifiers; --data {args.data} is a language model")


def _launch(args: argparse.Namespace) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    nproc = _workers(args)
    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    torchrun = get_args_parser().parse_args(
        [
            "--standalone",
            "--nnodes=1",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={args.max_restarts}",
            "--monitor-interval=0.5",
            "-m",
            "gradsync",
        ]
    )
    # set after parsing: argparse would try to match our own options against torchrun's
    torchrun.training_script_args = argv
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    try:
        run(torchrun)
    except ChildFailedError as e:
        print(f"gradsync train: a worker failed: {e}", file=sys.stderr)
        return 1
    return 0


def _launch_fault_tolerant(args: argparse.Namespace) -> int:
    """``--fault-tolerant``: a lighthouse in this process, and every node a torchrun of its own
    (a world of ``--per-node`` workers whose agent restarts them up to ``--max-restarts``
    times), so that a node that dies is recovered while the others train on."""
    import subprocess

    from gradsync.apps.train.options import FT_NODE_ENV, LIGHTHOUSE_ENV
    from gradsync.outer.ft import start_lighthouse

    argv = list(getattr(args, "argv", None) or sys.argv[1:])
    lighthouse = start_lighthouse(min_nodes=args.min_nodes or 1)
    print(
        f"gradsync train: lighthouse at {lighthouse.address}, {args.nodes} nodes", file=sys.stderr, flush=True
    )
    nodes: list[subprocess.Popen[bytes]] = []
    try:
        for node in range(args.nodes):
            env = {
                **os.environ,
                LIGHTHOUSE_ENV: lighthouse.address,
                FT_NODE_ENV: str(node),
                "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(args.threads)),
            }
            command = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
                f"--nproc-per-node={args.per_node}", f"--max-restarts={args.max_restarts}",
                "--monitor-interval=0.5", "-m", "gradsync", *argv,
            ]  # fmt: skip
            nodes.append(subprocess.Popen(command, env=env))
        codes = _wait_nodes(nodes, grace_s=max(60.0, args.timeout))
    finally:
        for p in nodes:
            if p.poll() is None:
                p.kill()
                p.wait()
        lighthouse.close()
    failed = [i for i, code in enumerate(codes) if code != 0]
    if failed:
        print(
            f"gradsync train: nodes {failed} failed (exit codes {[codes[i] for i in failed]})",
            file=sys.stderr,
        )
        return 1
    return 0


def _wait_nodes(nodes: list[Any], grace_s: float) -> list[int]:
    """Every node's exit code. Once node 0 has finished the run, a node still running gets
    ``grace_s`` seconds to finish too: one that came back after the others were done would
    otherwise wait for a meeting no one else will hold. It is stopped and counted as failed."""
    import time

    deadline = None
    while any(p.poll() is None for p in nodes):
        if deadline is None and nodes[0].poll() == 0:
            deadline = time.monotonic() + grace_s
        if deadline is not None and time.monotonic() > deadline:
            for i, p in enumerate(nodes):
                if p.poll() is None:
                    print(
                        f"gradsync train: node {i} was still running {grace_s:g} s after node 0 finished "
                        "the run (it came back too late to rejoin): stopped",
                        file=sys.stderr,
                        flush=True,
                    )
                    p.terminate()
            break
        time.sleep(0.2)
    return [p.wait() for p in nodes]


def _is_worker() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def check(args: argparse.Namespace) -> None:
    """Every check before anything runs (``ValueError`` naming the option): the options and, in
    the launcher, the data spec, the model and the batch size. ``main`` expects it done."""
    validate(args)
    if not _is_worker():
        _check_data_and_model(args)


def main(args: argparse.Namespace) -> int:
    """Run checked options (see :func:`check`): as a worker inside torchrun, else as the launcher."""
    if _is_worker():
        from gradsync.apps.train.trainer import run_worker

        return run_worker(args)
    if args.fault_tolerant:
        return _launch_fault_tolerant(args)
    return _launch(args)
