"""``gradsync whatif``: predicted step time, exposed synchronization and scaling factor of each
contender for a profiled model on any cluster and network (docs/whatif.md).

    gradsync whatif --profile docs/results/profile-resnet50-cpu.json --step-time 90ms \\
        --cluster 8x8 --inter 25gbit --scheme horovod,ddp,hierarchical,hitopk:density=0.01 \\
        --sweep inter=1,10,25,100gbit --png scaling.png --json scaling.json

``gradsync calibrate`` (:mod:`gradsync.apps.commands.calibrate`) writes the ``--links`` file.

References:

- network-bottleneck paper: Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
"""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING, Any

from gradsync.apps.command_line import command_line
from gradsync.codecs.config import split_spec_list
from gradsync.units import parse_duration, parse_rate
from gradsync.whatif.network import DEFAULT_INTER_LATENCY, DEFAULT_INTRA, DEFAULT_INTRA_LATENCY

if TYPE_CHECKING:
    from gradsync.observe.profile_format import Profile
    from gradsync.whatif.workload import Workload

DEFAULT_SCHEMES = (
    "horovod,ddp,ddp-fp16,ddp-powersgd:rank=4,hierarchical,hitopk:density=0.01,powersgd:rank=4,auto"
)
_CLUSTER = re.compile(r"^\s*(\d+)\s*x\s*(\d+)\s*$")


CLUSTER_FORMAT = "gradsync.cluster/1"
CLUSTER_LINK_KEYS = ("inter", "inter_latency", "intra", "intra_latency", "add_rate")


def read_cluster(text: str) -> tuple[int, int, dict[str, str]]:
    """``--cluster``: ``NODESxGPUS``, or a cluster file (JSON, format ``gradsync.cluster/1``)::

        {"format": "gradsync.cluster/1", "nodes": 16, "gpus_per_node": 8,
         "inter": "25gbit", "inter_latency": "5us", "intra": "800gbit", "intra_latency": "5us",
         "add_rate": "400GB/s"}

    whose link entries are optional and stand for the options of the same names. Returns the
    nodes, the GPUs per node and the file's link entries (``ValueError`` naming ``--cluster``)."""
    import json
    import os

    m = _CLUSTER.match((text or "").strip().lower())
    if m:
        if int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise ValueError(f"--cluster takes NODESxGPUS with both at least 1, e.g. 8x8, got {text!r}")
        return int(m.group(1)), int(m.group(2)), {}
    if not (text or "").endswith(".json") and not os.path.isfile(text or ""):
        raise ValueError(
            f"--cluster takes NODESxGPUS with both at least 1, e.g. 8x8, or a cluster file "
            f"(PATH.json, format {CLUSTER_FORMAT}), got {text!r}"
        )
    try:
        with open(text) as fh:
            doc = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--cluster {text}: cannot read it: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != CLUSTER_FORMAT:
        raise ValueError(f'--cluster {text}: not a {CLUSTER_FORMAT} file (its "format" must say so)')
    allowed = ("format", "nodes", "gpus_per_node", *CLUSTER_LINK_KEYS)
    unknown = sorted(set(doc) - set(allowed))
    if unknown:
        raise ValueError(
            f"--cluster {text}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )
    shape = [doc.get("nodes"), doc.get("gpus_per_node")]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in shape):
        raise ValueError(f"--cluster {text}: nodes and gpus_per_node must be integers >= 1, got {shape}")
    links = {k: str(doc[k]) for k in CLUSTER_LINK_KEYS if k in doc}
    for key, value in links.items():
        if key in ("inter", "intra", "add_rate"):
            parse_rate(value, f"--cluster {text}: {key}")
        else:
            parse_duration(value, f"--cluster {text}: {key}")
    return int(doc["nodes"]), int(doc["gpus_per_node"]), links


def parse_cluster(text: str) -> tuple[int, int]:
    """The nodes and GPUs per node of ``--cluster`` (see :func:`read_cluster`)."""
    nodes, per_node, _ = read_cluster(text)
    return nodes, per_node


def add_arguments(p: argparse.ArgumentParser, pictures: bool = True) -> None:
    """whatif's options; ``pictures``: also ``--png`` and ``--trace`` (``advise`` has neither)."""
    p.add_argument(
        "--profile", required=True, metavar="PATH.json", help="a gradsync profile (gradsync profile --out)"
    )
    p.add_argument(
        "--cluster",
        default="2x8",
        metavar="NODESxGPUS|PATH.json",
        help=f"nodes x workers per node (default 2x8), or a cluster file ({CLUSTER_FORMAT}: nodes, "
        "gpus_per_node and optionally the link options inter, inter_latency, intra, intra_latency, add_rate)",
    )
    p.add_argument("--inter", help=f"the node cable's rate (default {LINK_DEFAULTS['inter']})")
    p.add_argument("--inter-latency", help=f"its start-up time (default {LINK_DEFAULTS['inter_latency']})")
    p.add_argument("--intra", help=f"the links inside a node (default {LINK_DEFAULTS['intra']})")
    p.add_argument("--intra-latency", help=f"(default {LINK_DEFAULTS['intra_latency']})")
    p.add_argument(
        "--add-rate",
        help="element-wise add (and copy) throughput, the network-bottleneck paper's AddEst "
        f"(default {LINK_DEFAULTS['add_rate']})",
    )
    p.add_argument(
        "--links", metavar="PATH.json", help="calibrated links (gradsync calibrate) instead of the rates"
    )
    p.add_argument(
        "--scheme",
        default=DEFAULT_SCHEMES,
        help="comma-separated contenders: local, ddp and its hooks (ddp-fp16, ddp-powersgd:rank=N), "
        "dense algorithms (hierarchical, hierarchical/fp16, ...), gradsync's schemes and auto, the "
        "Adam-family optimizers (onebit-adam, zeroone-adam, onebit-lamb), outer@every=H@..., "
        "fsdp/hsdp/replicate[/SCHEME] (docs/whatif.md)",
    )
    p.add_argument(
        "--sync-option",
        action="append",
        metavar="KEY=VALUE",
        help="a SyncConfig option for every gradsync scheme",
    )
    p.add_argument(
        "--sweep",
        action="append",
        metavar="KEY=V1,V2",
        help="inter, inter_latency, nodes, per_node or ratio (repeatable: crossed)",
    )
    scale = p.add_mutually_exclusive_group()
    scale.add_argument(
        "--compute-scale", type=float, help="target device time / profiled device time (default 1)"
    )
    scale.add_argument(
        "--step-time", help="one worker's step alone on the target device, e.g. 90ms: sets the scale"
    )
    p.add_argument(
        "--costs",
        metavar="PATH.json",
        help="what synchronization cost in a running engine, as its closed loop refitted it "
        "(gradsync train --save-costs): its links (instead of --links or the rates; --sweep inter=... "
        "changes them), its cost per collective call and its codecs' encode and decode as they ran",
    )
    p.add_argument("--codec-costs", metavar="PATH.json", help="codec costs measured on the target device")
    p.add_argument(
        "--codec-scale", type=float, help="codec time ratio target/this machine (default: the compute scale)"
    )
    p.add_argument("--save-codec-costs", metavar="PATH.json", help="write the codec costs used")
    p.add_argument(
        "--codec-device",
        default="cpu",
        help="where codecs missing from --codec-costs are timed: cpu (scaled by --codec-scale) or cuda "
        "(resident, as the engine runs them on a GPU; not scaled unless --codec-scale is given)",
    )
    p.add_argument(
        "--host-cores",
        type=float,
        help="effective cores a host's workers share (CPU training; default: unbounded)",
    )
    p.add_argument("--ranks-per-host", type=int, help="workers sharing those cores (default: GPUs per node)")
    p.add_argument("--ddp-bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb (default 25)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")
    if pictures:
        p.add_argument("--png", metavar="PATH", help="scaling factor against the first --sweep")
        p.add_argument(
            "--trace",
            metavar="PATH.json",
            help="a Chrome trace of each contender's simulated step (first point)",
        )


LINK_DEFAULTS = {
    "inter": "25gbit", "inter_latency": DEFAULT_INTER_LATENCY, "intra": DEFAULT_INTRA,
    "intra_latency": DEFAULT_INTRA_LATENCY, "add_rate": "400GB/s",
}  # fmt: skip
"""The rates and start-up times of the links when neither ``--links`` nor ``--costs`` gives them."""


def link_options(args: argparse.Namespace) -> dict[str, str]:
    """``--inter`` and its kin (the keys of :data:`LINK_DEFAULTS`) as given, else as the cluster
    file gives them, else their defaults."""
    from_file = read_cluster(args.cluster)[2]
    return {
        name: str(getattr(args, name)) if getattr(args, name) is not None else from_file.get(name, default)
        for name, default in LINK_DEFAULTS.items()
    }


def _check_outputs(args: argparse.Namespace) -> None:
    """Every output file's folder exists: found out before the simulation runs, not after."""
    import os

    for name in ("json", "markdown", "png", "trace", "save_codec_costs"):
        path = getattr(args, name, None)
        folder = os.path.dirname(os.path.abspath(path)) if path else ""
        if path and not os.path.isdir(folder):
            raise ValueError(f"--{name.replace('_', '-')} {path}: the folder {folder} does not exist")


def _schemes(args: argparse.Namespace) -> list[str]:
    return split_spec_list(args.scheme)


def check_codec_device(device: str) -> None:
    """``--codec-device``: ``cpu``, or ``cuda``/``cuda:N`` on a machine with that GPU."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--codec-device must be cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda" and (
        not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()
    ):
        raise ValueError(
            f"--codec-device {device}: this machine has no such CUDA device (time the codecs on cpu)"
        )


def check(args: argparse.Namespace) -> None:
    from gradsync.observe.profile_format import Profile
    from gradsync.sync.config import SyncConfig, parse_options
    from gradsync.whatif.predict import check_contenders, parse_sweep

    try:
        Profile.load(args.profile)
    except OSError as e:
        raise ValueError(f"--profile {args.profile}: cannot read it: {e.strerror or e}") from None
    from_file = read_cluster(args.cluster)[2]
    if args.costs and args.links:
        raise ValueError("--costs holds the engine's links: give --costs or --links, not both")
    twice = [k for k in from_file if getattr(args, k) is not None]
    if twice:
        named = ", ".join(f"--{k.replace('_', '-')}" for k in twice)
        raise ValueError(
            f"--cluster {args.cluster} gives {', '.join(twice)} already: give it there or {named}"
        )
    given = [f"--{k.replace('_', '-')}" for k in LINK_DEFAULTS if getattr(args, k) is not None]
    given += [f"{k} in --cluster {args.cluster}" for k in from_file]
    if (args.costs or args.links) and given:
        source = "--costs" if args.costs else "--links"
        raise ValueError(
            f"{source} already holds the links' rates and start-up times: give {', '.join(given)} or "
            f"{source}, not both (--sweep inter=... changes the links of either)"
        )
    if args.costs:
        from gradsync.planner.engine_costs import EngineCosts

        EngineCosts.load(args.costs)
    links = link_options(args)
    for name in ("inter", "intra", "add_rate"):
        parse_rate(links[name], f"--{name.replace('_', '-')}")
    for name in ("inter_latency", "intra_latency"):
        parse_duration(links[name], f"--{name.replace('_', '-')}")
    if args.step_time is not None and not parse_duration(args.step_time, "--step-time") > 0:
        raise ValueError(f"--step-time must be a positive duration such as 90ms, got {args.step_time!r}")
    _check_outputs(args)
    check_codec_device(args.codec_device)
    for name in ("compute_scale", "codec_scale", "host_cores", "ddp_bucket_mb"):
        v = getattr(args, name)
        if v is not None and not (v > 0 and v != float("inf")):
            raise ValueError(f"--{name.replace('_', '-')} must be a positive number, got {v!r}")
    if args.ranks_per_host is not None and args.ranks_per_host < 1:
        raise ValueError(f"--ranks-per-host must be at least 1, got {args.ranks_per_host}")
    sweeps = [parse_sweep(s) for s in args.sweep or []]
    keys = [k for k, _ in sweeps]
    for k in keys:
        if keys.count(k) > 1:
            raise ValueError(f"--sweep {k} is given twice")
    schemes = _schemes(args)
    if not schemes:
        raise ValueError(f"--scheme must name at least one contender, got {args.scheme!r}")
    for s in schemes:
        if schemes.count(s) > 1:
            raise ValueError(f"--scheme names {s!r} twice")
    check_contenders(schemes, "ratio" in keys)
    if "ratio" in keys and not any("{" in s for s in schemes):
        raise ValueError(
            "--sweep ratio=... sets the compression ratio of --scheme's {density} or {ratio} placeholders "
            "(e.g. hitopk:density={density}, paper02:ratio={ratio}), and no scheme has one"
        )
    options = parse_options(args.sync_option)
    SyncConfig.from_options({"scheme": "auto", **options})


def run(args: argparse.Namespace) -> dict[str, Any]:
    from gradsync.observe.profile_format import Profile
    from gradsync.planner.engine_costs import EngineCosts
    from gradsync.sync.config import parse_options
    from gradsync.units import rate_text
    from gradsync.whatif.codec_costs import CodecTable
    from gradsync.whatif.network import Network, from_rates, load_links
    from gradsync.whatif.predict import Point, parse_sweep, points, predict_point, simulate_contender
    from gradsync.whatif.report import slower_on_faster_links
    from gradsync.whatif.simulate import Cpu
    from gradsync.whatif.workload import Workload

    profile = Profile.load(args.profile)
    workload = Workload.from_profile(profile)
    if args.step_time is not None:
        workload = workload.scaled_to_step(parse_duration(args.step_time, "--step-time"))
    elif args.compute_scale is not None:
        workload = workload.scaled(args.compute_scale)
    nodes, per_node = parse_cluster(args.cluster)
    engine = EngineCosts.load(args.costs) if args.costs else None
    if engine is not None:
        network = Network(engine.params, f"engine costs {args.costs}")
    elif args.links:
        network = load_links(args.links)
    else:
        links = link_options(args)
        network = from_rates(links["inter"], links["intra"], links["inter_latency"], links["intra_latency"],
                             1.0 / parse_rate(links["add_rate"], "--add-rate"))  # fmt: skip
    on_gpu = args.codec_device != "cpu"
    codec_scale = (
        args.codec_scale if args.codec_scale is not None else 1.0 if on_gpu else workload.compute_scale
    )
    if args.codec_costs:
        costs = CodecTable.load(args.codec_costs, codec_scale)
        costs.device = args.codec_device
    else:
        costs = CodecTable(codec_scale, device=args.codec_device)
    if engine is not None:  # the engine's own codec costs come first
        costs.entries.update(engine.codecs)
    cpu = Cpu(args.ranks_per_host or per_node, args.host_cores) if args.host_cores else Cpu()
    sweeps = [parse_sweep(s) for s in args.sweep or []]
    schemes = _schemes(args)
    options = parse_options(args.sync_option)
    ddp_buckets = {s: int(args.ddp_bucket_mb * 2**20) for s in schemes if s.startswith("ddp")}
    hook_rates, hook_work = powersgd_hook_rates(profile, schemes, codec_scale)
    rows: list[dict[str, Any]] = []
    for pt in points(Point(nodes, per_node, network), sweeps):
        rows += predict_point(workload, pt, schemes, costs, cpu, options, ddp_buckets, hook_rates)
    swept = {k for k, _ in sweeps}
    title = (
        f"{workload.model}, {args.cluster if not swept & {'nodes', 'per_node'} else 'cluster swept'}, "
        + (
            f"links {args.links or args.costs}"
            if args.links or args.costs
            else "inter swept"
            if "inter" in swept
            else f"inter {rate_text(network.inter_bytes_per_s)}"
        )
        + f", one worker's step {workload.step * 1e3:.1f} ms"
    )
    result: dict[str, Any] = {
        "command": command_line(args),
        "title": title,
        "profile": args.profile,
        "model": workload.model,
        "batch_size": workload.batch_size,
        "profiled_on": workload.device,
        "compute_scale": workload.compute_scale,
        "codec_scale": codec_scale,
        "single_worker_step_ms": workload.step * 1e3,
        "network": network.to_dict(),
        "cpu": {
            "ranks_per_host": cpu.ranks_per_host,
            "cores": None if cpu.cores == float("inf") else cpu.cores,
        },
        "sweeps": [[k, v] for k, v in sweeps],
        "codecs_measured_here": list(costs.measured),
        "powersgd_hook_work": hook_work,
        "rows": rows,
        "notes": unscaled_compute(args, workload)
        + codecs_timed_here(costs.measured)
        + slower_on_faster_links(rows),
    }
    if args.save_codec_costs:
        costs.save(args.save_codec_costs)
    if getattr(args, "trace", None):
        from gradsync.whatif.report import trace_document, write_trace

        first = points(Point(nodes, per_node, network), sweeps)[0]
        steps = []
        for s in schemes:
            from gradsync.whatif.predict import contender_name

            name = contender_name(s, first.ratio)
            res, _, _ = simulate_contender(
                name, workload, first, costs, cpu, options, True, ddp_buckets.get(s), hook_rates.get(s)
            )
            steps.append((name, res.spans, res.step_s))
        write_trace(args.trace, trace_document(steps, first.nodes, first.per_node))
    return result


def codecs_timed_here(specs: list[str]) -> list[str]:
    """A note naming the codecs timed on this machine (no table gave them): their times, and so
    the predictions that use them, move a little from run to run."""
    if not specs:
        return []
    listed = ", ".join(specs)
    return [f"timed on this machine (no --codec-costs entry), so a little different in each run: {listed}"]


def unscaled_compute(args: argparse.Namespace, workload: Workload) -> list[str]:
    """A note when the compute is the profile's own, unscaled, from a CPU: almost never the target's."""
    if args.step_time is not None or args.compute_scale is not None or not workload.device.startswith("cpu"):
        return []
    return [
        f"the compute is the profile's, measured on {workload.device} ({workload.step * 1e3:.1f} ms per "
        "step): give --step-time (one worker's step on the target device) or --compute-scale"
    ]


def powersgd_hook_rates(
    profile: Profile, schemes: list[str], scale: float
) -> tuple[dict[str, float], dict[str, str]]:
    """For each ``ddp-powersgd`` contender, the hook's own work per gradient byte from the
    profile (``gradsync profile --powersgd-hook-ranks``), times ``scale`` (the codecs' scale: the
    hook's work is compute on the profiled device); and, per contender, what its compute is
    charged: ``"profiled"`` or ``"codec"`` (gradsync's PowerSGD codec's timing, said on stderr:
    on VGG that misses 8-10x of the hook's work, docs/whatif.md)."""
    from gradsync.whatif.contenders import powersgd_rank

    rates: dict[str, float] = {}
    work: dict[str, str] = {}
    for s in schemes:
        if not s.startswith("ddp-powersgd"):
            continue
        rank = powersgd_rank(s)
        if rank in profile.powersgd_hook:
            rates[s] = profile.powersgd_hook[rank] * scale
            work[s] = "profiled"
        else:
            work[s] = "codec"
            print(
                f"gradsync whatif: {s}: the profile has no timing of PyTorch's PowerSGD hook at rank "
                f"{rank} (gradsync profile --powersgd-hook-ranks {rank}); its compute is charged "
                "gradsync's PowerSGD codec's timing, which leaves out the hook's error feedback and copies",
                file=sys.stderr,
            )
    return rates, work


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from gradsync.apps.commands.bench.support.output import save_result
    from gradsync.whatif.report import COLUMNS, cells, markdown, plot, point_key

    result = run(args)
    console = Console() if sys.stdout.isatty() else Console(width=200)
    rows = result["rows"]
    for key in dict.fromkeys(point_key(r) for r in rows):
        table = Table(title=f"predicted: {result['model']}, {key}")
        for col in COLUMNS:
            table.add_column(col, justify="left" if col in ("contender", "notes") else "right")
        for r in rows:
            if point_key(r) == key:
                table.add_row(*cells(r))
        console.print(table)
    print(f"one worker alone: {result['single_worker_step_ms']:.1f} ms per step (T_1)")
    for note in result["notes"]:
        print(f"note: {note}")
    save_result(result, args.json, args.markdown, markdown(result))
    if args.png:
        plot(result, args.png)
        print(f"plot: {args.png}")
    if args.trace:
        print(f"simulated timeline: {args.trace}")
    return 0
