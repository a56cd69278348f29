"""What each mode is known to cost in model quality: the project's own measured convergence tables.

The simulator predicts speed; whether a mode trains as well as dense synchronization is a
measurement, not a prediction. :func:`quality_of` names, for a contender, the measured runs of
the same family (``gradsync bench convergence``, files under ``docs/results/``): the language
model's perplexity gap to the dense run in the same invocation (the harder of the project's
tasks for compression; the digits classifier's accuracy moved by under 1.2 points for every
scheme, ``docs/results/bench-convergence.json``). These are small models trained for minutes on
this project's machine: they say which modes have been seen to hurt, not what a large model
will lose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradsync.sync.scheme import AUTO_CODECS, Scheme
from gradsync.whatif.modes import is_outer, is_self_syncing, outer_options, self_syncing_options
from gradsync.whatif.sharded import is_sharded, sharded_contender


@dataclass(frozen=True)
class Quality:
    """A family's measured cost: perplexity gaps (percent above the dense run, one per seed or
    setting) and where they come from. ``gaps`` empty: lossless (the ``dense`` family), not a
    training mode (``none``, ``formula``), or not measured."""

    family: str
    gaps: tuple[float, ...]
    task: str
    source: str

    @property
    def lossless(self) -> bool:
        return self.family == "dense"

    @property
    def is_mode(self) -> bool:
        """False for what is not a way to train: ``local`` (no synchronization at all) and the
        network-bottleneck paper's formula (``paper02:ratio=R``, a compression ratio without a
        codec)."""
        return self.family not in NOT_MODES

    @property
    def worst(self) -> float | None:
        """The largest measured gap (0 when lossless); None when nothing was measured."""
        if self.lossless:
            return 0.0
        return max(self.gaps) if self.gaps else None

    def within(self, budget: float) -> bool:
        """Known to cost at most ``budget`` percent: lossless, or measured within it (a mode
        nobody measured is not known to be within any budget)."""
        worst = self.worst
        return self.is_mode and worst is not None and worst <= budget

    def text(self) -> str:
        if self.lossless:
            return "none (dense, lossless)"
        if not self.is_mode:
            return self.task
        if not self.gaps:
            return f"not measured ({self.task})"
        gaps = " / ".join(f"{g:+.1f} %" for g in self.gaps)
        return f"{gaps} perplexity, {self.task} ({self.source})"


NOT_MODES = {
    "none": "no synchronization: each rank trains alone (a reference, not a training mode)",
    "formula": "a formula for any compression ratio, no codec behind it (not a training mode)",
}


SGD_LSTM = "LSTM LM, SGD, 2x2"
ADAMW_TRANSFORMER = "Transformer LM, AdamW, 2x2"
OUTER_AVERAGE = "outer_lr 1.0, outer_momentum 0 (OuterLoop's defaults 0.7 / 0.9 trained worse there)"
OUTER_M03 = "outer_lr 1.0, outer_momentum 0.3"
OUTER_H20_RUNS = "docs/results/bench-convergence-outer-h20-text-adam-seed0.json, -seed1.json, -seed2.json"

QUALITY: dict[str, Quality] = {
    q.family: q
    for q in (
        Quality("dense", (), "", ""),
        Quality("fp16", (), "half-precision rounding of the gradient", ""),
        Quality("sparse", (17.2, 14.0), f"{SGD_LSTM}, hitopk / topk at 1 %",
                "docs/results/bench-convergence-text-recipe.json"),
        Quality("powersgd", (7.7,), f"{SGD_LSTM}, powersgd:rank=4",
                "docs/results/bench-convergence-text-recipe.json"),
        Quality("onebit", (40.1,), f"{SGD_LSTM}, onebit+ef",
                "docs/results/bench-convergence-text-recipe.json"),
        Quality("dgc", (37.6,), f"{SGD_LSTM}, dgc at 1 %", "docs/results/bench-convergence-text-recipe.json"),
        Quality("terngrad", (-7.2,), f"{SGD_LSTM}, terngrad", "docs/results/bench-convergence.json"),
        Quality("onebit-adam", (13.1,), ADAMW_TRANSFORMER, "docs/results/bench-convergence-adam-family.json"),
        Quality("zeroone-adam", (2.5, 4.2), f"{ADAMW_TRANSFORMER}, 2 seeds",
                "docs/results/bench-convergence-adam-family.json, -seed1.json"),
        Quality("onebit-lamb", (24.3,), ADAMW_TRANSFORMER, "docs/results/bench-convergence-adam-family.json"),
        Quality("outer-dense", (5.0, 6.6), f"{ADAMW_TRANSFORMER}, H = 10, {OUTER_AVERAGE}, 2 seeds",
                "docs/results/bench-convergence-outer-text-adam.json, -seed1.json"),
        Quality("outer-int4", (3.5, 6.6),
                f"{ADAMW_TRANSFORMER}, H = 10, terngrad:bits=4, outer_lr 1.0, outer_momentum 0.3, 2 seeds",
                "docs/results/bench-convergence-outer-int4-text-adam.json, -seed1.json"),
        Quality("outer-dense-h20", (2.8, 5.5, 4.1), f"{ADAMW_TRANSFORMER}, H = 20, {OUTER_M03}, 3 seeds",
                f"{OUTER_H20_RUNS}"),
        Quality("outer-int4-h20", (2.6, 5.4, 3.6),
                f"{ADAMW_TRANSFORMER}, H = 20, terngrad:bits=4 (245x less traffic across nodes than DDP), "
                f"{OUTER_M03}, 3 seeds", f"{OUTER_H20_RUNS}"),
        Quality("outer-sparseloco", (4.8, 6.1, 6.5),
                f"{ADAMW_TRANSFORMER}, H = 10, sparseloco:density=0.2,bits=4+ef (120x less), {OUTER_M03}, "
                "3 seeds", f"{OUTER_H20_RUNS}"),
        Quality("outer-onebit", (10.8, 11.8),
                f"{ADAMW_TRANSFORMER}, H = 10, onebit, {OUTER_AVERAGE}, 2 seeds",
                "docs/results/bench-convergence-outer-text-adam.json, -seed1.json"),
        Quality("outer-sparse", (16.2,), f"{ADAMW_TRANSFORMER}, H = 10, chunktopk at 10 %, {OUTER_AVERAGE}",
                "docs/results/bench-convergence-outer-text-adam.json"),
        Quality("outer-streaming-onebit", (11.7,),
                f"{ADAMW_TRANSFORMER}, H = 10, 4 fragments, delay 2, onebit, {OUTER_AVERAGE}",
                "docs/results/bench-convergence-outer-text-adam.json"),
        Quality("outer-streaming-terngrad", (), "the streamed outer loop with terngrad; measured: the same "
                "codec unstreamed at 4 bits (+3.5 / +6.6 %), streaming with onebit (+11.7 % against "
                "+10.8 / +11.8 % unstreamed)", ""),
        *(Quality(name, (), text, "") for name, text in NOT_MODES.items()),
    )
}  # fmt: skip


def _codec_family(codec: str) -> str:
    name = codec.split(":")[0].split("+")[0]
    if name in ("topk", "mstopk", "chunktopk", "bsearch", "trimmed_topk", "randomk", "graddrop", "qrgc"):
        return "sparse"
    if name in ("fp16", "bf16"):
        return "fp16"
    if name in ("powersgd", "dgc", "onebit", "terngrad", "sparseloco"):
        return name
    if name == "tbq":
        return "terngrad"
    return "dense" if name == "none" else "sparse"


def _outer_family(name: str) -> str:
    options = outer_options(name)
    codec = options.get("codec")
    inner = "dense" if codec is None else _codec_family(codec)
    if options.get("fragments", 1) > 1 or options.get("delay", 0) > 0:
        return f"outer-streaming-{inner}"
    if inner == "terngrad" and codec is not None and "bits=4" in codec.replace(" ", ""):
        inner = "int4"
    # a period measured on its own (the recipes' H = 20) has its own entry; others the family's
    measured = f"outer-{inner}-h{options.get('every')}"
    return measured if measured in QUALITY else f"outer-{inner}"


def family(name: str, nodes: int | None = None) -> str:
    """The quality family of contender ``name`` (a key of :data:`QUALITY`, or a family nobody has
    measured, which :func:`quality_of` reports as such). ``nodes``: the cluster's; on one node
    FSDP2's compressed all-reduce across nodes has nothing to do (lossless)."""
    if is_outer(name):
        return _outer_family(name)
    if is_self_syncing(name):
        kind = name.split("@")[0]
        codec = self_syncing_options(name).get("codec")
        return kind if codec is None or codec.split("+")[0] == "onebit" else f"{kind} with {codec}"
    if is_sharded(name):  # FSDP2's own reductions are exact; compressed, the codec's family
        kind, compressed = sharded_contender(name)
        if compressed is None or (nodes == 1 and kind in ("hsdp", "replicate")):
            return "dense"
        return family(compressed, nodes)
    if name == "local":
        return "none"
    if name in ("ddp", "horovod"):
        return "dense"
    if name == "ddp-fp16":
        return "fp16"
    if name.startswith("ddp-powersgd"):
        return "powersgd"
    if name.startswith("paper02"):
        return "formula"
    scheme = Scheme.parse(name)
    if scheme.kind == "dense":
        return "fp16" if scheme.comm_dtype else "dense"
    if scheme.text.startswith("auto"):  # as the codec its plan compresses with (its candidates' worst)
        names = list(AUTO_CODECS) if scheme.text == "auto" else [scheme.codec or "", *scheme.candidates]
        fams = [_codec_family(Scheme.parse(c).codec or c) for c in names]
        return max(fams, key=lambda f: _risk(quality_of_family(f)))
    return _codec_family(scheme.codec or "")


def _risk(q: Quality) -> float:
    worst = q.worst
    return math.inf if worst is None else worst


def quality_of_family(fam: str) -> Quality:
    """The measured quality of family ``fam``; a family nobody has measured gets an entry that
    says so."""
    return QUALITY.get(fam) or Quality(fam, (), f"{fam}: no run of the project's convergence tables", "")


def quality_of(name: str, nodes: int | None = None) -> Quality:
    return quality_of_family(family(name, nodes))


def lossless(name: str, nodes: int | None = None) -> bool:
    """Whether ``name`` synchronizes the exact gradient every step (dense, full precision)."""
    return quality_of(name, nodes).lossless
