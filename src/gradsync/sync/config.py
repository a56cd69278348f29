"""The sync engine's configuration: a typed dataclass that rejects unknown keys and bad values.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
- HiPress paper: Wu et al., "A Generic, High-Performance, Compression-Aware Framework for Data
  Parallel DNN Training", IEEE TPDS (HiPress, CaSync, CompLL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from gradsync.codecs.config import OptionsConfig, check_choice, check_range
from gradsync.collectives.dense import dense_algorithm_names
from gradsync.sync.clipping import CLIP_MODES
from gradsync.sync.density_schedule import DensitySchedule
from gradsync.sync.scheme import Scheme

PLAN_MODES = ("auto", "compress", "dense")


def parse_options(items: list[str] | None, what: str = "--sync-option") -> dict[str, str]:
    """``KEY=VALUE`` items (``--sync-option`` on every command line) as a dict; ``ValueError``
    naming ``what`` for a malformed one. The values are checked by :meth:`SyncConfig.from_options`."""
    out: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{what} takes KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


@dataclass(frozen=True)
class SyncConfig(OptionsConfig):
    """How :func:`gradsync.wrap` and :func:`gradsync.ddp_comm_hook` synchronize gradients.

    Every field can be given as a keyword to ``wrap`` or as ``key=value`` on the command line.
    """

    codec: ClassVar[str] = "sync"

    scheme: str = "auto"
    """The aggregation (see :mod:`gradsync.sync.scheme`): ``none``, ``torus2d``,
    ``hitopk:density=0.01``, ``ps+local/onebit``, ``powersgd:rank=4``, ``auto``..."""
    plan: str = "auto"
    """``auto``: compress a bucket only where the cost model says it pays (the HiPress paper's
    selective compression); ``compress``: every bucket that may be compressed is; ``dense``:
    none is."""
    partitions: int = 0
    """Split a compressed bucket into this many parts that pipeline (0: the planner picks 1, 2 or 4)."""
    replan: int = 2
    """The closed loop (:mod:`gradsync.planner.closed_loop`, ``plan="auto"`` only): how many times
    the plan may be remade from what its buckets cost in the running engine; 0 keeps the first
    plan."""
    replan_steps: int = 3
    """Steps measured before each re-plan (after one unmeasured step with the new plan)."""
    replan_gain: float = 0.05
    """A re-plan replaces the plan only when the refitted model predicts it at least this
    fraction faster (hysteresis), and compresses a bucket for a predicted win of this much."""
    replan_recut: bool = True
    """A re-plan also cuts the buckets anew, from when the gradients became ready in the measured
    steps (the first plan cuts them from the first step, a single cold measurement); False keeps
    the first step's cuts."""
    replan_trials: int = 2
    """After its re-plans, the closed loop measures up to this many plans that run one of the
    candidate codecs alone (``auto`` with candidates, :mod:`gradsync.planner.trials`) and keeps
    the plan that measured fastest; 0 keeps the re-plans' outcome."""
    clip_local: float | None = None
    """Local gradient clipping (:mod:`gradsync.sync.clipping`, RedSync paper): clip each rank's own
    gradient to ``clip_local / sqrt(world)`` before it is added to the error-feedback residual
    and synchronized. Use it instead of clipping the synchronized gradient, which rescales the
    residual updates error feedback releases."""
    clip_local_mode: str = "global"
    """``global``: one norm over all of a rank's gradients, taken when the backward pass ended
    (no bucket starts during the backward pass); ``bucket``: each bucket clipped alone, to its
    share of the bound, as soon as it is ready (keeps the overlap)."""
    dense_algorithm: str = "auto"
    """For dense buckets: ``auto`` (cheapest by the cost model) or flat, hierarchical, torus2d, hybrid."""
    error_feedback: bool | None = None
    """None: add error feedback to codecs with a biased error; True: always; False: never."""
    bucket_bytes: int = 64 << 20
    """Fusion threshold theta: a bucket closes when it reaches this many bytes (Horovod's 64 MiB)."""
    bucket_timeout_ms: float = 5.0
    """A bucket also closes when the gradients it would wait for become ready more than this
    long after its first one (Horovod's 5 ms cycle, applied to the ready times measured in the
    first step). Buckets the plan leaves dense are fused again by size alone, as DDP does."""
    min_compress_bytes: int = 64 << 10
    """Tensors smaller than this are never compressed (biases, norms: RedSync paper)."""
    large_codec: str | None = None
    """Optional codec for tensors of at least ``large_bytes`` (the RedSync paper picks its selection
    method by layer size, e.g. ``bsearch:density=0.01`` for the large ones)."""
    large_bytes: int = 4 << 20
    dense_warmup_steps: int = 1
    """Steps synchronized densely before compression starts (at least 1: the first step measures
    the gradient-ready order and times the plan is made from)."""
    density_schedule: str | None = None
    """Sparsity warm-up (:mod:`gradsync.sync.density_schedule`, RedSync paper): ``exp@STEPS`` sends
    25 %, 6.25 %, 1.5625 %, ... of each tensor, one stage per STEPS synchronized steps, down to
    each sparsifier's own density; ``D1,D2,...@STEPS`` gives the stages."""
    dense_from_step: int | None = None
    """Switch to dense synchronization from this step on (the MSTopK paper's sparse-then-dense
    recipe)."""
    overlap: bool = True
    """Start a bucket's synchronization during the backward pass as soon as it is ready."""
    finish_in_backward: bool = True
    """Wait for the synchronization at the end of ``backward()`` (DDP's behaviour). False: the
    gradients are final only after ``finish_sync()`` (or the wrapped optimizer's ``step()``)."""
    grad_as_bucket_view: bool = False
    """Zero-copy buckets (DDP's ``gradient_as_bucket_view``): each parameter's ``.grad`` is a view
    into its bucket's flat buffer, so the backward pass accumulates straight into the buffer and
    the synchronized values land in ``.grad`` where they are; the copies into and out of the
    buckets disappear. Every training forward pass points the gradients at the buffers again
    (after ``zero_grad(set_to_none=True)``, or after a re-plan rebuilt the buckets: a gradient
    that is not a view is copied in once). Do not keep references to ``.grad`` across steps."""
    find_unused_parameters: bool = False
    """Detect parameters no rank used in a step (one small extra all-reduce) and leave their
    gradient as None. Without it a parameter unused on some rank counts as a zero gradient there;
    the ranks still agree on the used parameters at the first step and, once some rank had a
    parameter without a gradient, at every later step (see :mod:`gradsync.integrate.engine`)."""
    check_overflow: bool | None = None
    """All-reduce an inf/NaN flag every step so that every rank's GradScaler skips together, and
    roll back error-feedback residuals on such steps. None: on when a GradScaler is attached."""
    resident: bool | None = None
    """Resident mode for the codecs (:meth:`gradsync.codecs.Compressor.set_resident`): payloads
    of a size fixed in advance, statistics and flags left on the device, so that nothing waits
    for the host per bucket and communication overlaps the backward pass on a GPU. None: on
    where the gradients live on a GPU; True also on the CPU (for tests and audits)."""
    rehearse: bool = False
    """Run the synchronization path in a world of one rank, for measuring what it costs
    (``gradsync bench gpu-step``). A world of one normally synchronizes nothing: the engine
    leaves the gradients as they are and runs no codec. With ``rehearse`` it packs every bucket,
    encodes it, "gathers" the payload from its one rank (every collective over one rank is the
    identity: nothing is copied to stand in for a network), decodes it and writes it back, with
    error feedback: the programs a multi-rank world runs, not a copy of them. The result is the
    lossy codec applied to the gradient: ``decode(encode(g))`` (with error feedback, of ``g``
    plus what it owes; under ``ring`` and ``ps``, whose owners encode the sum again, twice), so
    training changes as compression changes it. Work that grows with the ranks (decoding p
    payloads, merging) is done for one. The plan is a world of one's (its links cost nothing),
    so ``plan="auto"`` compresses nothing: use ``plan="compress"``, or install a plan made for
    another cluster (:meth:`gradsync.integrate.engine.SyncEngine.use_plan`). No effect with
    more than one rank; ``wrap`` only (the DDP hook refuses it)."""
    check_steps: bool = True
    """Start every synchronized step with one tiny all-reduce that checks that every rank is at
    the same step and ran as many forward passes (a rank that skipped a backward pass would
    otherwise average its gradients with another step's, silently); runs during the backward
    pass. Off only for programs that legitimately run different numbers of training-mode forward
    passes on different ranks."""
    calibrate: bool = True
    """Measure alpha/beta of each link level after the first step (else assume
    :data:`gradsync.planner.decide.DEFAULT_PARAMS`: 10 GB/s inside a node, 10 Gbit/s across)."""
    timeout_s: float = 300.0
    """How long ``finish_sync`` waits for the synchronization tasks before raising."""
    log_plan: bool = True
    broadcast_parameters: bool = True
    """Copy rank 0's parameters and buffers to every rank at wrap time (as DDP does)."""
    broadcast_buffers: bool = True
    """Keep the module's buffers (BatchNorm running statistics) rank 0's, as DDP's
    ``broadcast_buffers`` does: DDP broadcasts them before each forward pass, gradsync after each
    synchronized step, in the step's order of collectives (the same values at the next forward
    pass; under ``Join`` the highest rank still training is the source). False: every rank keeps
    its own buffers, and they are not copied at wrap time either (as with DDP). ``wrap`` only:
    with the DDP comm hook DDP's own setting applies."""

    def validate(self) -> None:
        Scheme.parse(self.scheme)
        check_choice(self.codec, "plan", self.plan, PLAN_MODES)
        check_choice(self.codec, "dense_algorithm", self.dense_algorithm, ("auto", *dense_algorithm_names()))
        check_choice(self.codec, "clip_local_mode", self.clip_local_mode, CLIP_MODES)
        if self.clip_local is not None and not (math.isfinite(self.clip_local) and self.clip_local > 0):
            raise ValueError(f"sync: clip_local must be a positive number or None, got {self.clip_local!r}")
        check_range(self.codec, "partitions", self.partitions, 0, 64)
        check_range(self.codec, "replan", self.replan, 0, 20)
        check_range(self.codec, "replan_steps", self.replan_steps, 1, 1000)
        check_range(self.codec, "replan_gain", self.replan_gain, 0.0, 0.9)
        check_range(self.codec, "replan_trials", self.replan_trials, 0, 20)
        check_range(self.codec, "bucket_bytes", self.bucket_bytes, 1)
        check_range(self.codec, "bucket_timeout_ms", self.bucket_timeout_ms, 0.0)
        check_range(self.codec, "min_compress_bytes", self.min_compress_bytes, 0)
        check_range(self.codec, "large_bytes", self.large_bytes, 1)
        check_range(self.codec, "dense_warmup_steps", self.dense_warmup_steps, 1)
        if self.density_schedule is not None:
            DensitySchedule.parse(self.density_schedule)
        if self.dense_from_step is not None:
            check_range(self.codec, "dense_from_step", self.dense_from_step, 0)
        check_range(self.codec, "timeout_s", self.timeout_s, 0.0, lo_open=True)
        if not isinstance(self.rehearse, bool):
            raise ValueError(f"sync: rehearse must be True or False, got {self.rehearse!r}")
        if self.large_codec is not None:
            Scheme.parse(f"allgather/{self.large_codec}")  # a valid codec spec
