"""``gradsync train``'s options as argparse defines them: groups, defaults and help, and the values
each option allows. :mod:`gradsync.apps.train.options` checks them (before any process starts) and turns
them into the run's configurations.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
"""

from __future__ import annotations

import argparse

from gradsync.apps.models import models_for
from gradsync.apps.train.optim import optimizer_names

DEFAULT_MAX_SYNC_INTERVAL = 2
"""zeroone-adam's longest run of local steps (docs/benchmarks.md, the Adam family)."""
DEFAULT_SCHEME = "hitopk:density=0.01"
SCHEDULES = ("cosine", "step", "constant", "poly")
LR_SCALING = ("none", "linear", "sqrt")
RESIZE_BATCH = ("constant", "memory")
PTO = ("off", "on", "auto")
CLIP_WHERE = ("auto", "sync", "local", "bucket")
PLANS = ("auto", "compress", "dense")
CACHE_SHUFFLE = ("partition", "global")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("what to train")
    g.add_argument(
        "--data",
        default="digits",
        help="digits | text | synthetic-images[:n=..] | synthetic-text[:n=..] | "
        "imagefolder:PATH | tokens:PATH (default: digits)",
    )
    g.add_argument(
        "--model",
        default=None,
        help=f"{', '.join(models_for('classify'))} (images); {', '.join(models_for('lm'))} (text); "
        "default: vgg-small for images, lstm for text",
    )
    g.add_argument("--seq-len", type=int, default=64, help="tokens per sample for text data")
    g.add_argument(
        "--cache",
        default=None,
        metavar="DIR",
        help="read imagefolder/tokens data through the data cache: files fetched once per node into "
        "DIR ({node} in DIR becomes the node index), decoded samples kept in a shared memory store "
        "per node, and each node reading only its part of the data (see --cache-shuffle)",
    )
    g.add_argument(
        "--cache-memory",
        default="auto",
        metavar="SIZE",
        help="the memory store's limit per node: a size such as 512m or 4g, 'auto' (no limit beyond "
        "the node's part of the data) or 'off' (default: auto)",
    )
    g.add_argument(
        "--cache-disk",
        default="none",
        metavar="SIZE",
        help="the disk tier's limit (least recently used files are evicted): a size or 'none' (default)",
    )
    g.add_argument(
        "--cache-shuffle",
        default="partition",
        help="partition: each rank keeps a fixed part of the data, reshuffled every epoch, so a node "
        "caches only its part (default with --cache); global: every epoch reshuffles the whole data "
        "set over all ranks (each node may then cache all of it)",
    )
    g.add_argument("--epochs", type=int, default=12)
    g.add_argument("--batch-size", type=int, default=32, help="samples per worker per step")
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("optimization")
    g.add_argument("--optimizer", default="sgd", help=f"one of {', '.join(optimizer_names())}")
    g.add_argument(
        "--lr",
        type=float,
        default=None,
        help="peak learning rate (default: 0.1 sgd, 0.002 adamw, onebit-adam and zeroone-adam, "
        "2.0 lars, 0.005 lamb and onebit-lamb)",
    )
    g.add_argument("--momentum", type=float, default=0.9, help="sgd and lars momentum")
    g.add_argument("--nesterov", action="store_true", help="sgd or lars with Nesterov momentum")
    g.add_argument(
        "--trust-coefficient",
        type=float,
        default=None,
        help="lars and lamb: the trust ratio's coefficient (default: 0.001 lars, 1.0 lamb)",
    )
    g.add_argument(
        "--pto",
        nargs="?",
        const="on",
        default="off",
        metavar="on|off|auto",
        help="lars and lamb: each rank computes the trust ratios of its share of the layers, "
        "then one all-gather (the MSTopK paper's parallel tensor operator); the result is the same. "
        "auto: measure both before training and let the cost model choose (--pto alone: on)",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=5e-4,
        help="decoupled for adamw; never applied to biases and norm weights",
    )
    g.add_argument(
        "--freeze-step",
        type=int,
        default=None,
        help="onebit-adam, zeroone-adam, onebit-lamb: dense warm-up steps (all-reduced gradients) "
        "before the variance freezes and the momentum is exchanged compressed "
        "(default: 3 %% of the run's steps, 2 %% for zeroone-adam, at least 1)",
    )
    g.add_argument(
        "--var-freeze-step",
        type=int,
        default=None,
        help="zeroone-adam: the last step at which the variance is refreshed (at intervals 1, 2, 4, "
        "... after --freeze-step); local steps follow (default: 60 %% of the run's steps)",
    )
    g.add_argument(
        "--sync-growth",
        type=int,
        default=None,
        help="zeroone-adam: the interval between exchanges doubles every this many steps after "
        "--var-freeze-step (default: 6.5 %% of the run's steps)",
    )
    g.add_argument(
        "--max-sync-interval",
        type=int,
        default=DEFAULT_MAX_SYNC_INTERVAL,
        help="zeroone-adam: the longest run of local steps between two exchanges "
        f"(default {DEFAULT_MAX_SYNC_INTERVAL})",
    )
    g.add_argument(
        "--momentum-codec",
        default="onebit",
        help="onebit-adam, zeroone-adam, onebit-lamb: the codec of the momentum exchange (error "
        "feedback is always on; default onebit)",
    )
    g.add_argument("--warmup-epochs", type=float, default=1.0, help="linear learning-rate warm-up")
    g.add_argument(
        "--schedule",
        default="cosine",
        help=f"one of {', '.join(SCHEDULES)} (after warm-up; poly: (1 - progress)^--poly-power, MLPerf's)",
    )
    g.add_argument("--poly-power", type=float, default=2.0, help="the power of --schedule poly")
    g.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="samples per optimizer step over all workers: each worker takes GLOBAL/workers, in "
        "micro-batches of --batch-size (gradient accumulation); default --batch-size x workers",
    )
    g.add_argument(
        "--lr-scaling",
        default="none",
        help="none | linear | sqrt: scale --lr by (global batch / --reference-batch) or its square root",
    )
    g.add_argument("--reference-batch", type=int, default=256, help="the batch --lr is given for")
    g.add_argument(
        "--resize-schedule",
        default=None,
        metavar="EPOCH:SIZE,...",
        help="images: progressive resizing, the input resolution from each epoch on (e.g. "
        "0:16,4:24,8:32); the model must take any size (resnet)",
    )
    g.add_argument(
        "--resize-batch",
        default="constant",
        help="constant | memory: under --resize-schedule, keep the batch, or keep a micro-batch's "
        "memory (--batch-size holds at the largest size, smaller sizes take (largest/size)^2 times "
        "as many samples; with --lr-scaling the learning rate follows each stage's batch)",
    )
    g.add_argument(
        "--label-smoothing", type=float, default=0.0, help="classifiers: cross-entropy label smoothing"
    )
    g.add_argument(
        "--clip-grad", type=float, default=None, help="clip the gradient's norm to this (see --clip-mode)"
    )
    g.add_argument(
        "--clip-mode",
        default="auto",
        choices=CLIP_WHERE,
        help="where --clip-grad clips: sync (the synchronized gradient), local (each rank's own "
        "gradient to CLIP/sqrt(N) once the backward pass ended, before error feedback, as in the "
        "RedSync paper), bucket (local, bucket by bucket, keeping the overlap); auto: local when "
        "the scheme uses error feedback, else sync",
    )
    g.add_argument(
        "--amp",
        action="store_true",
        help="mixed precision: bf16 autocast on CPU, fp16 autocast + GradScaler on GPU",
    )

    g = p.add_argument_group("synchronization")
    g.add_argument(
        "--scheme",
        default=DEFAULT_SCHEME,
        help="a gradsync scheme: none, hierarchical, torus2d/fp16, hitopk:density=0.01, "
        "topk:density=0.01, dgc:density=0.01, powersgd:rank=4, ps/onebit, auto, ...",
    )
    g.add_argument(
        "--plan",
        default="compress",
        help="compress: compress every tensor the scheme may compress; auto: only where the "
        "measured cost model says it pays; dense: none",
    )
    g.add_argument(
        "--dense-warmup",
        type=float,
        default=0.0,
        metavar="EPOCHS",
        help="synchronize densely for the first EPOCHS epochs (at least the first step is)",
    )
    g.add_argument(
        "--density-schedule",
        default=None,
        metavar="STAGES@EPOCHS",
        help="sparsity warm-up (RedSync paper): exp@EPOCHS sends 25%%, 6.25%%, 1.5625%%, ... of each "
        "tensor, EPOCHS epochs per stage, down to the sparsifier's own density; or D1,D2,...@EPOCHS "
        "(e.g. 25%%,6.25%%@0.5)",
    )
    g.add_argument(
        "--switch-to-dense-at",
        type=float,
        default=None,
        metavar="EPOCH",
        help="switch from compressed to dense synchronization at this epoch (MSTopK paper)",
    )
    g.add_argument(
        "--sync-option",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="any further gradsync SyncConfig option (repeatable)",
    )

    g = p.add_argument_group("outer loop (DiLoCo family; docs/outer-loop.md)")
    g.add_argument(
        "--outer",
        type=int,
        default=None,
        metavar="H",
        help="train each node on its own for H inner steps (its ranks synchronized densely every step) "
        "and average the nodes' pseudo-gradients every H steps with an outer Nesterov SGD",
    )
    g.add_argument(
        "--outer-codec",
        default=None,
        metavar="SPEC",
        help="compress the pseudo-gradients with this codec (error feedback added to biased ones), e.g. "
        "chunktopk:density=0.02, onebit, bf16, powersgd:rank=4 (default: dense float32)",
    )
    g.add_argument(
        "--outer-lr",
        type=float,
        default=None,
        help="the outer SGD's learning rate (default by H: 1.0 below 100 inner steps, measured best at "
        "H = 10; DiLoCo's 0.7 from 100 on; docs/outer-loop.md)",
    )
    g.add_argument(
        "--outer-momentum",
        type=float,
        default=None,
        help="the outer SGD's Nesterov momentum (default by H: 0.3 below 100 inner steps, DiLoCo's 0.9 "
        "from 100 on)",
    )
    g.add_argument(
        "--fragments",
        type=int,
        default=1,
        help="streaming: split the parameters into this many fragments that meet on a staggered schedule",
    )
    g.add_argument(
        "--outer-delay",
        type=int,
        default=0,
        metavar="STEPS",
        help="streaming: exchange in the background and apply STEPS inner steps later (below H)",
    )
    g.add_argument(
        "--outer-mix",
        type=float,
        default=None,
        help="weight of the local fragment when a delayed exchange lands (default 0.5 with a delay)",
    )

    g.add_argument(
        "--fault-tolerant",
        action="store_true",
        help="live recovery through torchft (pip install 'gradsync[ft]'): each node is a replica group of "
        "its own; a node that dies is dropped from the next meeting and the others train on, and when it "
        "comes back (--max-restarts) it heals from a live peer. Started by this command, a lighthouse "
        "runs here and every node under a torchrun of its own",
    )
    g.add_argument(
        "--lighthouse",
        default=None,
        metavar="ADDR",
        help="with --fault-tolerant under your own torchrun per node: the lighthouse's address "
        "(http://HOST:PORT; default: $TORCHFT_LIGHTHOUSE)",
    )
    g.add_argument(
        "--node-index",
        type=int,
        default=None,
        metavar="N",
        help="with --fault-tolerant under your own torchrun per node: this node's index, 0 .. --nodes - 1 "
        "(its name and its shard of the data)",
    )
    g.add_argument(
        "--min-nodes",
        type=int,
        default=None,
        help="with --fault-tolerant: a meeting with fewer live nodes is not applied (default 1)",
    )

    g = p.add_argument_group("processes")
    g.add_argument(
        "--nproc",
        type=int,
        default=None,
        help="worker processes on this machine (default: nodes x per-node, else 2)",
    )
    g.add_argument("--nodes", type=int, default=None, help="emulate this many nodes (with --per-node)")
    g.add_argument("--per-node", type=int, default=None, help="ranks per emulated node")
    g.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    g.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart the workers this often after a failure (they resume from the last checkpoint)",
    )
    g.add_argument("--timeout", type=float, default=300.0, help="process-group timeout in seconds")

    g = p.add_argument_group("output")
    g.add_argument("--checkpoint-dir", default=None, help="save a checkpoint at every epoch's end here")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="STEPS",
        help="also save every STEPS optimizer steps (default: only at epoch ends)",
    )
    g.add_argument("--keep-checkpoints", type=int, default=2, help="how many checkpoints to keep")
    g.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in --checkpoint-dir"
    )
    g.add_argument("--json", default=None, metavar="PATH", help="write the run's summary as JSON")
    g.add_argument(
        "--save-costs",
        default=None,
        metavar="PATH",
        help="write what synchronization cost in the engine, as the closed loop's last round refitted it "
        "(gradsync.engine-costs/1, for gradsync whatif --costs); needs --plan auto and a compressed scheme",
    )
    g.add_argument("--quiet", action="store_true", help="no progress bar")
    g.add_argument(
        "--trace",
        default=None,
        metavar="PATH",
        help="write a timeline of the synchronization (Chrome trace JSON, opens in Perfetto); "
        "rank R also writes PATH's stem + .rankR.json",
    )
    g.add_argument(
        "--trace-steps",
        default="0:50",
        metavar="N|START:STOP",
        help="the synchronized steps --trace records: the first N, or START <= step < STOP (default 0:50)",
    )
    g.add_argument(
        "--log-every",
        type=int,
        default=None,
        metavar="K",
        help="rank 0 logs the step's telemetry every K steps (bytes per level, compression, encode/decode, "
        "exposed time, residual norm, slowest rank's lag); --json keeps these records",
    )
    # testing aid: the last rank kills itself (SIGKILL) at this global step on the first attempt,
    # to show that torchrun's restart resumes from the last checkpoint
    g.add_argument("--crash-at-step", type=int, default=None, help=argparse.SUPPRESS)
