"""``gradsync bench datacache``: training on an image folder that sits on central storage behind
a slow link, with and without the data cache (MSTopK paper, §4.1).

The benchmark writes an image folder of JPEG files (the synthetic class patterns, upscaled, as a
camera's photos are larger than the network's input), brings up the emulated cluster with one
more namespace for the storage, starts an HTTP file server there (the standard library's
threading server) behind its own shaped cable, and trains the same model on the cluster with
``--data imagefolder:http://...``:

- ``uncached``: every epoch fetches and decodes every image (the global shuffle);
- ``cached``: ``--cache``, partitioned: each node fetches its part once, keeps the files on disk
  and the decoded samples in its shared memory store;
- ``cached-global``: ``--cache --cache-shuffle global``: cached, but every epoch reshuffles all
  of the data over all ranks (the accuracy reference for the partitioned order).

Every contender starts cold (empty disk tier, no memory store). Per epoch the table gives the data
wait per step and its share of the step, decode time per step, files and bytes fetched from
central storage (counted by the trainers and, separately, by the server), the share of samples
each tier served, samples/s and validation accuracy. Contenders run one after the other, in a
different order each round.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gradsync.apps.command_line import command_line
from gradsync.apps.commands.bench.support.output import markdown_table, pick_names, save_result

CONTENDERS: dict[str, list[str]] = {
    "uncached": [],
    "cached": ["--cache", "{cache}"],
    "cached-global": ["--cache", "{cache}", "--cache-shuffle", "global"],
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--contenders", default=",".join(CONTENDERS), help=f"from {', '.join(CONTENDERS)}")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--per-node", type=int, default=2)
    p.add_argument("--link", default="1gbit", help="the nodes' cables (gradient traffic)")
    p.add_argument("--storage-link", default="20mbit", help="the storage's cable (all nodes share it)")
    p.add_argument("--images", type=int, default=4096, help="images in the folder")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--noise", type=float, default=3.0, help="the images' noise (harder to classify)")
    p.add_argument("--stored-size", type=int, default=128, help="the JPEG files' width and height")
    p.add_argument("--size", type=int, default=32, help="the size the model sees (decode + resize)")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--model", default="vgg-small")
    p.add_argument(
        "--rounds", type=int, default=1, help="each contender once per round; round r trains with --seed r"
    )
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per training run")
    p.add_argument("--train-option", action="append", default=[], metavar="OPTION")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--markdown", metavar="PATH")


def check(args: argparse.Namespace) -> None:
    pick_names(args.contenders, CONTENDERS, "--contenders")
    for name in (
        "nodes",
        "per_node",
        "images",
        "classes",
        "stored_size",
        "size",
        "epochs",
        "batch_size",
        "rounds",
    ):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.epochs < 2:
        raise ValueError("--epochs must be at least 2 (the cache pays from the second epoch)")
    from gradsync.units import parse_rate

    parse_rate(args.link, "--link", tc_units=True)
    parse_rate(args.storage_link, "--storage-link", tc_units=True)


def write_image_folder(root: Path, n: int, classes: int, stored: int, noise: float, seed: int = 0) -> int:
    """``n`` JPEG files ``root/<class>/<i>.jpg`` of ``stored x stored`` pixels; returns their bytes."""
    import numpy as np
    import torch
    from PIL import Image

    from gradsync.apps.data.synthetic import synthetic_images_bundle

    bundle = synthetic_images_bundle(n=n, size=32, channels=3, classes=classes, seed=seed, noise=noise)
    total = 0
    for split in (bundle.train, bundle.val):
        for i in range(len(split)):
            x, y = split[i]
            px = (x.permute(1, 2, 0) * 40 + 128).clamp(0, 255).to(torch.uint8).numpy()
            img = Image.fromarray(np.ascontiguousarray(px)).resize(
                (stored, stored), Image.Resampling.BILINEAR
            )
            folder = root / f"class{int(y):03d}"
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{total:06d}-{i:06d}.jpg"
            img.save(path, quality=90)
            total += 1
    return sum(p.stat().st_size for p in root.rglob("*.jpg"))


def _argv(args: argparse.Namespace, contender: str, url: str, cache: str, out: str, seed: int) -> list[str]:
    options = [o.format(cache=cache) for o in CONTENDERS[contender]]
    return [
        "train", "--data", f"imagefolder:{url}/imgs,size={args.size}", "--model", args.model,
        "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--scheme", "none",
        "--nodes", str(args.nodes), "--per-node", str(args.per_node), "--seed", str(seed), "--quiet",
        "--json", out,
        *options, *args.train_option,
    ]  # fmt: skip


def _epoch_rows(contender: str, summary: dict[str, Any], served: int) -> list[dict[str, Any]]:
    rows = []
    for h in summary["history"]:
        steps = max(h["steps"], 1)
        ranks = summary.get("world", 1)
        rows.append(
            {
                "contender": contender,
                "epoch": h["epoch"],
                "data_wait_ms": h["data_wait_ms"],
                "step_ms": h["step_ms"],
                "data_wait_share": h["data_wait_share"],
                "decode_ms": 1e3 * h.get("decode_s", 0.0) / ranks / steps,
                "central_files": h.get("central_files"),
                "central_bytes": h.get("central_bytes"),
                "memory_hit": h.get("cache_memory_hit"),
                "disk_hit": h.get("cache_disk_hit"),
                "samples_per_s": h["samples_per_s"],
                "epoch_s": h["epoch_s"],
                "val_accuracy": h["val_accuracy"],
            }
        )
    rows[-1]["server_bytes_run"] = served
    return rows


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    from gradsync.apps.cluster import netns
    from gradsync.apps.cluster.launch import launch
    from gradsync.apps.cluster.storage import storage_server

    ok, why = netns.check()
    if not ok:
        print(f"gradsync bench datacache: cannot emulate a cluster here: {why}", file=sys.stderr)
        return None
    contenders = pick_names(args.contenders, CONTENDERS, "--contenders")
    work = Path(tempfile.mkdtemp(prefix="gradsync-datacache-"))
    rows: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    imgs = work / "store" / "imgs"
    try:
        folder_bytes = write_image_folder(imgs, args.images, args.classes, args.stored_size, args.noise)
        print(
            f"gradsync bench datacache: {args.images} JPEG files of {args.stored_size}x{args.stored_size}, "
            f"{folder_bytes / 1e6:.1f} MB, behind a {args.storage_link} link",
            file=sys.stderr,
            flush=True,
        )
        netns.up(args.nodes, args.link, storage_rate=args.storage_link)
        try:
            with storage_server(
                work / "store", namespace=netns.STORAGE, host=netns.STORAGE_ADDRESS
            ) as server:
                for r in range(args.rounds):
                    order = contenders[r % len(contenders) :] + contenders[: r % len(contenders)]
                    for contender in order:
                        cache = work / "cache"
                        shutil.rmtree(cache, ignore_errors=True)
                        out = str(work / f"{contender}-{r}.json")
                        argv = _argv(args, contender, server.url, str(cache / "node{node}"), out, r)
                        print(f"gradsync bench datacache: {contender}: gradsync {' '.join(argv)}",
                              file=sys.stderr, flush=True)  # fmt: skip
                        served0 = server.served_bytes()
                        t0 = time.perf_counter()
                        code = launch(args.per_node, argv, args.timeout, port=29500 + r)
                        wall = time.perf_counter() - t0
                        if code != 0:
                            raise RuntimeError(f"the {contender} run failed (exit {code})")
                        served = server.served_bytes() - served0
                        with open(out) as fh:
                            summary = json.load(fh)
                        summary.setdefault("world", args.nodes * args.per_node)
                        rows += [dict(row, round=r) for row in _epoch_rows(contender, summary, served)]
                        runs.append({"contender": contender, "round": r, "wall_s": wall,
                                     "server_bytes": served, "argv": argv})  # fmt: skip
        finally:
            netns.down()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "command": command_line(args),
        "folder_bytes": folder_bytes,
        "rows": rows,
        "runs": runs,
        "summary": summarize(rows, runs),
    }


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _spread(values: list[float]) -> list[float]:
    return [min(values), max(values)] if values else []


def summarize(rows: list[dict[str, Any]], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, from epoch 2 on (means over rounds, with the rounds' range): data
    wait per step and its share of the step, the wait against uncached, the speed-up in
    samples/s and in the whole run's wall time, central bytes after epoch 1, final accuracy."""
    out: dict[str, Any] = {}
    last_epoch = max(x["epoch"] for x in rows)
    for c in sorted({r["contender"] for r in rows}):
        later = [r for r in rows if r["contender"] == c and r["epoch"] >= 2]
        final = [r["val_accuracy"] for r in rows if r["contender"] == c and r["epoch"] == last_epoch]
        walls = [x["wall_s"] for x in runs if x["contender"] == c]
        out[c] = {
            "wait_ms_later": _mean([r["data_wait_ms"] for r in later]),
            "wait_share_later": _mean([r["data_wait_share"] for r in later]),
            "wait_share_later_range": _spread([r["data_wait_share"] for r in later]),
            "samples_per_s_later": _mean([r["samples_per_s"] for r in later]),
            "central_bytes_later": sum(r["central_bytes"] or 0 for r in later),
            "wall_s": _mean(walls),
            "wall_s_range": _spread(walls),
            "final_accuracy": _mean(final),
            "final_accuracy_range": _spread(final),
        }
    if "uncached" in out and "cached" in out:
        u, k = out["uncached"], out["cached"]
        out["wait_reduction"] = u["wait_ms_later"] / k["wait_ms_later"] if k["wait_ms_later"] > 0 else None
        out["speedup_later"] = k["samples_per_s_later"] / u["samples_per_s_later"]
        out["speedup_wall"] = u["wall_s"] / k["wall_s"]
        out["accuracy_gap_pp"] = 100 * (k["final_accuracy"] - u["final_accuracy"])
    if "cached-global" in out and "cached" in out:
        gap = out["cached"]["final_accuracy"] - out["cached-global"]["final_accuracy"]
        out["partition_vs_global_pp"] = 100 * gap
    return out


def markdown(result: dict[str, Any]) -> str:
    cols = ["contender", "round", "epoch", "data wait ms/step", "wait share", "decode ms/step",
            "central files", "central MB", "memory hit", "disk hit", "samples/s", "val acc %"]  # fmt: skip

    def pct(v: float | None) -> str:
        return "" if v is None else f"{100 * v:.0f}%"

    table = [
        [r["contender"], str(r["round"]), str(r["epoch"]), f"{r['data_wait_ms']:.1f}",
         pct(r["data_wait_share"]), f"{r['decode_ms']:.1f}",
         "" if r["central_files"] is None else f"{r['central_files']:.0f}",
         "" if r["central_bytes"] is None else f"{r['central_bytes'] / 1e6:.2f}",
         pct(r["memory_hit"]), pct(r["disk_hit"]), f"{r['samples_per_s']:.0f}",
         f"{100 * r['val_accuracy']:.2f}"]
        for r in result["rows"]
    ]  # fmt: skip
    text = markdown_table(cols, table)
    runs = markdown_table(
        ["contender", "round", "wall s", "bytes the server sent (MB)"],
        [[x["contender"], str(x["round"]), f"{x['wall_s']:.1f}", f"{x['server_bytes'] / 1e6:.2f}"]
         for x in result["runs"]],
    )  # fmt: skip
    return text + "\n" + runs + "\n```\n" + json.dumps(result["summary"], indent=1) + "\n```\n"


def main(args: argparse.Namespace) -> int:
    result = run(args)
    if result is None:
        return 2
    text = markdown(result)
    print(text)
    save_result(result, args.json, args.markdown, text)
    return 0
