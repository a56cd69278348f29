"""Sparsity warm-up (RedSync paper, appendix C; DGC): a sparsifier's density starts high and falls.

Early in training the gradients change fast and error feedback's residuals go stale quickly, so
sending 1 % or 0.1 % of them from the first step costs accuracy. A density schedule sends more
at first and lowers the density in stages, each ``STEPS`` synchronized steps long, down to the
codec's own density::

    exp@STEPS                 the RedSync paper's stages: 25 %, then a quarter of the previous one
                              (6.25 %, 1.5625 %, 0.390625 %, ...) while above the codec's density
    D1,D2,...@STEPS           the given densities (numbers in (0, 1] or percentages: 25%,6.25%)

A stage whose density is at or below a codec's own is skipped for that codec, so the density
never falls below what the codec was configured with and never rises again. Stage ``i`` covers
the synchronized steps ``[i * STEPS, (i + 1) * STEPS)``, counted from the first step (the dense
warm-up steps, which send everything, count too). The stage follows from the step count alone,
which every rank agrees on and checkpoints hold, so every rank uses the same density and a
resumed run goes on in the stage it stopped in. Only sparsifiers configured by a density follow
a schedule (``k=`` or a threshold fixes the count); other codecs (PowerSGD, onebit) ignore it.

References:

- RedSync paper: Fang et al., "RedSync: Reducing Synchronization Traffic for Distributed Deep
  Learning", arXiv:1808.04357.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from gradsync.codecs import Compressor

EXP_START = 0.25
EXP_FACTOR = 4.0
FORMS = "'exp@STEPS' or 'D1,D2,...@STEPS' (densities in (0, 1] or percentages, e.g. '25%,6.25%,1.5625%@100')"


def check_stages(text: str, option: str) -> None:
    """Check the part of a schedule before ``@`` (``ValueError`` naming ``option``)."""
    stages = text.partition("@")[0]
    try:
        DensitySchedule.parse(f"{stages}@1")
    except ValueError as e:
        why = str(e).partition("density_schedule ")[2].partition(";")[0]
        raise ValueError(
            f"{option} {why}: give exp or falling densities in (0, 1] (e.g. 25%,6.25%), got {text!r}"
        ) from None


@dataclass(frozen=True)
class DensitySchedule:
    """A parsed ``density_schedule``: the stage densities (None: the ``exp`` form) and the steps
    per stage."""

    text: str
    densities: tuple[float, ...] | None
    stage_steps: int

    @classmethod
    def parse(cls, text: str) -> DensitySchedule:
        """Parse ``exp@STEPS`` or ``D1,D2,...@STEPS`` (``ValueError`` naming the option and the forms)."""

        def bad(why: str) -> ValueError:
            return ValueError(f"sync: density_schedule {why}; write {FORMS}, got {text!r}")

        if not isinstance(text, str):
            raise bad("must be a string")
        stages, at, length = text.strip().partition("@")
        if not at:
            raise bad("needs '@STEPS', the steps each stage lasts")
        try:
            steps = int(length.strip())
        except ValueError:
            raise bad("needs a whole number of steps after '@'") from None
        if steps < 1:
            raise bad("needs at least 1 step per stage")
        if stages.strip().lower() == "exp":
            return cls(text.strip(), None, steps)
        densities = []
        for item in stages.split(","):
            item = item.strip()
            try:
                d = float(item[:-1]) / 100 if item.endswith("%") else float(item)
            except ValueError:
                raise bad(f"has {item!r}, not a density") from None
            if not (0.0 < d <= 1.0) or math.isnan(d):
                raise bad(f"has density {item!r} outside (0, 1]")
            densities.append(d)
        if any(b >= a for a, b in itertools.pairwise(densities)):
            raise bad("must list falling densities")
        return cls(text.strip(), tuple(densities), steps)

    def stages_for(self, density: float) -> tuple[float, ...]:
        """The densities a codec configured with ``density`` runs at before its own."""
        if self.densities is not None:
            return tuple(d for d in self.densities if d > density)
        out, d = [], EXP_START
        while d > density:
            out.append(d)
            d /= EXP_FACTOR
        return tuple(out)

    def density_at(self, step: int, density: float) -> float | None:
        """The density for synchronized step ``step`` of a codec configured with ``density``;
        None once the schedule is over for it (the codec's own density)."""
        stages = self.stages_for(density)
        stage = step // self.stage_steps
        return stages[stage] if stage < len(stages) else None

    def end_step(self, densities: list[float]) -> int:
        """The first step at which every codec with one of ``densities`` runs at its own."""
        return max((len(self.stages_for(d)) for d in densities), default=0) * self.stage_steps


def schedule_for(text: str | None, codecs: list[Compressor], scheme: str) -> DensitySchedule | None:
    """``density_schedule`` for a scheme with ``codecs``; ``ValueError`` when none can follow it."""
    if text is None:
        return None
    if not any(c.plain.schedulable for c in codecs):
        have = ", ".join(c.spec() for c in codecs) or "none (a dense scheme)"
        raise ValueError(
            f"sync: density_schedule={text!r} needs a sparsifier configured by a density (topk, "
            f"mstopk, dgc, ... with density=D); the scheme {scheme!r} has codecs: {have}"
        )
    return DensitySchedule.parse(text)


def apply_schedule(schedule: DensitySchedule | None, codecs: list[Compressor], step: int) -> float | None:
    """Set every schedulable codec's density for synchronized step ``step`` (None: its own);
    return the largest scheduled density, None when every codec runs at its own."""
    used = []
    for codec in codecs:
        plain = codec.plain
        if not plain.schedulable:
            continue
        own = plain.config.density  # type: ignore[attr-defined]
        plain.scheduled_density = None if schedule is None else schedule.density_at(step, own)
        if plain.scheduled_density is not None:
            used.append(plain.scheduled_density)
    return max(used, default=None)
