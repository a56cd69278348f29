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

from dataclasses import dataclass

from gradsync.sync.scheme import AUTO_CODECS, Scheme
from gradsync.whatif.modes import is_outer, is_self_syncing, outer_options
from gradsync.whatif.sharded import is_sharded, sharded_contender


@dataclass(frozen=True)
class Quality:
    """A family's measured cost: perplexity gaps (percent above the dense run, one per seed or
    setting) and where they come from. ``gaps`` empty: lossless (nothing to measure)."""

    family: str
    gaps: tuple[float, ...]
    task: str
    source: str

    @property
    def worst(self) -> float:
        return max(self.gaps) if self.gaps else 0.0

    def text(self) -> str:
        if self.family == "dense":
            return "none (dense, lossless)"
        if not self.gaps:
            return f"not measured ({self.task})"
        gaps = " / ".join(f"{g:+.1f} %" for g in self.gaps)
        return f"{gaps} perplexity, {self.task} ({self.source})"


SGD_LSTM = "LSTM LM, SGD, 2x2"
ADAMW_TRANSFORMER = "Transformer LM, AdamW, 2x2"

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
        Quality("outer-dense", (5.0, 6.6), f"{ADAMW_TRANSFORMER}, H = 10, 2 seeds",
                "docs/results/bench-convergence-outer-text-adam.json, -seed1.json"),
        Quality("outer-int4", (3.5, 6.6), f"{ADAMW_TRANSFORMER}, H = 10, terngrad:bits=4, 2 seeds",
                "docs/results/bench-convergence-outer-int4-text-adam.json, -seed1.json"),
        Quality("outer-onebit", (10.8, 11.8), f"{ADAMW_TRANSFORMER}, H = 10, 2 seeds",
                "docs/results/bench-convergence-outer-text-adam.json, -seed1.json"),
        Quality("outer-sparse", (16.2,), f"{ADAMW_TRANSFORMER}, H = 10, chunktopk at 10 %",
                "docs/results/bench-convergence-outer-text-adam.json"),
    )
}  # fmt: skip


def _codec_family(codec: str) -> str:
    name = codec.split(":")[0].split("+")[0]
    if name in ("topk", "mstopk", "chunktopk", "bsearch", "trimmed_topk", "randomk", "graddrop", "qrgc"):
        return "sparse"
    if name in ("fp16", "bf16"):
        return "fp16"
    if name in ("powersgd", "dgc", "onebit", "terngrad"):
        return name
    if name == "tbq":
        return "terngrad"
    return "dense" if name == "none" else "sparse"


def family(name: str) -> str:
    """The quality family of contender ``name`` (a key of :data:`QUALITY`)."""
    if is_outer(name):
        codec = outer_options(name).get("codec")
        if codec is None:
            return "outer-dense"
        inner = _codec_family(codec)
        if (inner == "terngrad" and "bits=4" in codec) or inner == "fp16":
            return "outer-int4"
        return "outer-onebit" if inner in ("onebit", "terngrad") else "outer-sparse"
    if is_self_syncing(name):
        return name.split("@")[0]
    if is_sharded(name):  # FSDP2's own reductions are exact; compressed, the codec's family
        compressed = sharded_contender(name)[1]
        return "dense" if compressed is None else family(compressed)
    if name in ("local", "ddp", "horovod"):
        return "dense"
    if name == "ddp-fp16":
        return "fp16"
    if name.startswith("ddp-powersgd"):
        return "powersgd"
    if name.startswith("paper02"):
        return "dense"
    scheme = Scheme.parse(name)
    if scheme.kind == "dense":
        return "fp16" if scheme.comm_dtype else "dense"
    if scheme.text.startswith("auto"):  # as the codec its plan compresses with (its candidates' worst)
        names = list(AUTO_CODECS) if scheme.text == "auto" else [scheme.codec or "", *scheme.candidates]
        fams = [_codec_family(Scheme.parse(c).codec or c) for c in names]
        return max(fams, key=lambda f: QUALITY[f].worst)
    return _codec_family(scheme.codec or "")


def quality_of(name: str) -> Quality:
    return QUALITY[family(name)]


def lossless(name: str) -> bool:
    """Whether ``name`` synchronizes the exact gradient every step (dense, full precision)."""
    return family(name) == "dense"
