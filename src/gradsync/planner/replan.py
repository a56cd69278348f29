"""The engine's plans over a run: the first plan after the first (dense) step, and the rounds of
the closed loop that re-plan from what the buckets cost in the running engine
(:mod:`gradsync.planner.closed_loop` has the measurements and the refit, :mod:`gradsync.planner.decide`
the decisions).

:class:`Replanner` decides; it never touches gradients or compression state. A round that
changes the plan hands the new plan to the engine's switch (which installs it and carries what
the ended streams owed, :mod:`gradsync.sync.carry`), and logs what the switch did.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from gradsync.collectives.cost import CodecCost, CostModel, CostParams, Link
from gradsync.collectives.topology import Topology
from gradsync.planner.closed_loop import ClosedLoop, Refit, plan_seconds, refit, samples_of
from gradsync.planner.decide import (
    COMPRESS_MARGIN,
    FirstStep,
    first_plan_of,
    first_step_groups,
    launch_ready,
    make_plan,
    plan_after_first_step,
    share_plan,
    time_codecs,
)
from gradsync.planner.plan import Plan, same_plan
from gradsync.planner.trials import DUEL_BLOCKS, Duel, codec_families, trial_plans, trial_steps
from gradsync.sync.buckets import Slot
from gradsync.sync.codec_set import CodecSet, scheme_codecs
from gradsync.sync.config import SyncConfig
from gradsync.sync.scheme import Scheme
from gradsync.sync.stats import StepStats

log = logging.getLogger("gradsync")

Switch = Callable[[Plan], list[str]]
"""Installs a plan on this rank and returns the keys of the compression streams it ended."""


class Replanner:
    """The first plan and the closed loop of one engine (``slots``: its parameters)."""

    def __init__(
        self, topology: Topology, config: SyncConfig, scheme: Scheme, codecs: CodecSet, slots: Sequence[Slot]
    ) -> None:
        self.topo = topology
        self.config = config
        self.scheme = scheme
        self.codecs = codecs
        self.slots = slots
        loop_on = config.plan == "auto" and scheme.kind != "dense" and bool(codecs.codecs)
        self.families = codec_families([codec.spec() for codec in codecs.codecs], codecs.candidates)
        """Codec ids by codec, where the loop's trials have more than one to try."""
        self.loop = ClosedLoop(
            config.replan if loop_on else 0, config.replan_steps, config.replan_gain,
            revert_above=1.0 + config.replan_gain, trials=config.replan_trials if self.families else 0,
        )  # fmt: skip
        """The closed loop's state: re-plans done, settled, what each round decided."""
        self.params: CostParams | None = None  # the links as calibrated after the first step
        self.first: FirstStep | None = None  # the first step's gradient order and ready times
        self.codec_costs: dict[int, CodecCost] = {}  # rank 0: the codecs as timed for the plan
        self.last_refit: Refit | None = None
        """Rank 0: the costs the last round refitted from the running engine."""

    @property
    def _log(self) -> bool:
        return self.config.log_plan and self.topo.rank == 0

    def rejects(self, codec_id: int, members: list[int], parts: int) -> str | None:
        return self.codecs.rejects(self.slots, codec_id, members, parts)

    def _classes(self) -> list[int]:
        return [self.codecs.codec_class(s) for s in self.slots]

    # ------------------------------------------------------------------ the first plan
    def first_plan(self, first: FirstStep) -> Plan:
        """After the first step: calibrate the links, time the codecs, decide on rank 0 and give
        every rank that plan (collectives on every rank)."""
        c = self.codecs
        plan, params, costs = plan_after_first_step(
            self.topo, self.config, self.scheme, list(self.slots), c.codecs, first, self._classes(),
            self.rejects, c.schemes, c.candidates,
        )  # fmt: skip
        self.params, self.first, self.codec_costs = params, first, costs
        self.loop.restart()
        return plan

    def plan_for(self, model: CostModel) -> Plan:
        """The first plan this planner would make on the cluster ``model`` describes (its links,
        ``model.m`` nodes of ``model.n`` ranks) from this engine's first step and its codecs'
        timings: what ``plan="auto"`` picks there before its closed loop measures anything
        (``gradsync bench gpu-step`` runs it in a world of one, :attr:`SyncConfig.rehearse`).
        Rank 0, after the first plan. ``ValueError`` where that cluster would run other codecs or
        strategies than this engine has (a scheme whose local aggregation depends on the shape)."""
        if self.first is None or not self.codec_costs:
            raise ValueError("plan_for needs the first plan's measurements (rank 0, after the first step)")
        c, cfg = self.codecs, self.config
        there = Scheme.parse(cfg.scheme).resolve(model.m, model.n)
        theirs = [there.name] * c.class_count + [
            alt.name for alt, _ in scheme_codecs(cfg, there, (model.m, model.n)).candidates
        ]
        if theirs != [s.name for s in c.schemes]:
            raise ValueError(
                f"a cluster of {model.m} x {model.n} would run {', '.join(theirs)}; this engine runs "
                f"{', '.join(s.name for s in c.schemes)} ({self.topo.nodes} x {self.topo.per_node})"
            )
        groups = first_step_groups(
            list(self.slots), self.first, self._classes(), cfg.bucket_bytes, cfg.bucket_timeout_ms / 1e3
        )
        return first_plan_of(
            model, cfg, self.scheme, list(self.slots), self.first, groups, self.codec_costs, self.rejects,
            c.schemes, c.candidates,
        )  # fmt: skip

    # ------------------------------------------------------------------ the closed loop
    def due(self, stats: StepStats, valid: bool, ready_at: Sequence[float | None]) -> bool:
        """Count a step of the current plan (``ready_at``: when each gradient became ready); True
        when a round of the loop is due (the same step on every rank). Dense steps and density
        warm-up steps do not count: they cost what later steps will not."""
        return (
            self.loop.active
            and not stats.dense
            and stats.density is None
            and self.first is not None
            and self.loop.observe(stats, valid, ready_at if self.config.replan_recut else None)
        )

    def round(self, plan: Plan, buckets: int, step: int, switch: Switch) -> bool:
        """The closed loop's round: agree on the measured bucket costs, refit and re-plan on
        rank 0, and switch every rank to the new plan (through ``switch``). The guard goes back
        to the plan before the last switch when that switch measured slower. When the re-plans
        are done, the trials (:meth:`_conclude`), then settle on the plan measured fastest. True
        when the plan changed."""
        assert self.first is not None and self.params is not None
        t0 = time.perf_counter()
        cfg, loop = self.config, self.loop
        measured, span = loop.agreed(self.topo, buckets)
        record: dict[str, Any] = {"step": step, "measured_ms": span * 1e3}
        if loop.duel is not None:  # a block of a duel was measured
            return self._duel_round(plan, span, record, t0, switch, step)
        if loop.worse_than_before(span):  # the last re-plan measured slower: back, then trials
            assert loop.before is not None
            before, loop.before = loop.before, None
            record["reverted"] = True
            return self._conclude(plan, [before], record, t0, switch, step)
        if loop.replans >= loop.replan:  # the last switch measured no slower: keep it
            loop.before = None
            record["verified"] = True
            return self._conclude(plan, [(plan, span)], record, t0, switch, step)
        new = share_plan(self.topo, lambda: self._decide(plan, measured, record))
        if new is None:
            if self._log:
                log.info(
                    "gradsync closed loop at step %d: the model keeps the plan (%s; predicted %.1f -> "
                    "%.1f ms of synchronization per step, a switch needs %.0f %%)", step,
                    record.get("refit"), *record.get("predicted_ms", [0.0, 0.0]), 100 * cfg.replan_gain,
                )  # fmt: skip
            return self._conclude(plan, [(plan, span)], record, t0, switch, step)
        record["switched"] = True
        record["seconds"] = time.perf_counter() - t0
        loop.history.append(record)
        loop.replans += 1
        carried = switch(new)
        # every switch is measured once more before the loop settles: the guard compares the
        # new plan's span with this one (or, after the last allowed switch, only that)
        loop.before = (plan, span)
        if self._log:
            log.info(
                "gradsync closed loop at step %d: re-plan %d of at most %d (%s; predicted %.1f -> %.1f ms "
                "of synchronization per step; %d compression streams of changed buckets end, what they "
                "owed is carried to the next step)", step, loop.replans, loop.replan,
                record.get("refit"), *record.get("predicted_ms", [0.0, 0.0]), len(carried),
            )  # fmt: skip
        return True

    def _measured_groups(self) -> tuple[FirstStep, list[tuple[list[int], int]]]:
        """Rank 0: the gradients' ready times of the measured steps (the first step's are cold;
        those where nothing was measured yet) and the buckets cut from them; the codecs timed now
        where a run resumed from a checkpoint has no timing of them."""
        assert self.first is not None
        cfg, c = self.config, self.codecs
        ready = self.loop.ready_profile() or self.first
        groups = first_step_groups(
            list(self.slots), ready, self._classes(), cfg.bucket_bytes, cfg.bucket_timeout_ms / 1e3
        )
        if not self.codec_costs:
            self.codec_costs = time_codecs(
                self.topo, self.scheme, list(self.slots), c.codecs, groups, c.schemes, c.candidates
            )
        return ready, groups

    def _decide(
        self, old: Plan, measured: list[tuple[float, float, float] | None], record: dict[str, Any]
    ) -> Plan | None:
        """Rank 0: refit the model on the measured buckets and make a plan over the first step's
        buckets; None when it is the same plan or not predicted ``replan_gain`` faster."""
        assert self.first is not None and self.params is not None
        cfg, c, t = self.config, self.codecs, self.topo
        nbytes = [s.nbytes for s in self.slots]
        ready, groups = self._measured_groups()
        samples = samples_of(old, nbytes, measured)
        fit = refit(samples, self.scheme, self.params, t.nodes, t.per_node, self.codec_costs, c.schemes)
        self.last_refit = fit
        model = CostModel(fit.params, t.nodes, t.per_node)
        candidate = make_plan(
            groups, nbytes, self.scheme, model, fit.codecs, cfg.plan, cfg.dense_algorithm, cfg.partitions,
            fuse_bytes=cfg.bucket_bytes, kinds=[s.group for s in self.slots], rejects=self.rejects,
            margin=1.0 - cfg.replan_gain, dense_overhead=fit.dense_overhead, schemes=c.schemes,
            candidates=c.candidates, ready=launch_ready(ready),
        )  # fmt: skip
        launch = launch_ready(ready)
        before, after = (
            plan_seconds(p, nbytes, self.scheme, model, fit.codecs, fit.dense_overhead, c.schemes, launch)
            for p in (old, candidate)
        )
        record.update(refit=fit.describe(), predicted_ms=[before * 1e3, after * 1e3])
        if same_plan(candidate, old) or after > (1.0 - cfg.replan_gain) * before:
            return None
        self.first = ready  # what a later round (or a resumed run) cuts from
        return candidate

    def _duel_round(
        self, installed: Plan, span: float, record: dict[str, Any], t0: float, switch: Switch, step: int
    ) -> bool:  # fmt: skip
        """A block of the duel in progress was measured: run the next block, or, after the last,
        keep the side that measured faster and go on with the trials (:meth:`_conclude`)."""
        loop = self.loop
        duel = loop.duel
        assert duel is not None
        record["duel"] = duel.side
        if not duel.record(span):
            return self._install(duel.plan, installed, record, t0, switch, step)
        beat, trial = duel.means()
        kept = trial < beat
        loop.best = (duel.b, trial) if kept else (duel.a, beat)
        loop.duel = None
        record.update(
            trial=loop.tried[-1] if loop.tried else True, kept=kept, beat_ms=beat * 1e3, trial_ms=trial * 1e3
        )
        return self._conclude(installed, [], record, t0, switch, step)

    def _conclude(
        self, installed: Plan, measured: list[tuple[Plan, float]], record: dict[str, Any], t0: float,
        switch: Switch, step: int,
    ) -> bool:  # fmt: skip
        """The re-plans are done, or a duel ended: fold ``measured`` (plans with their measured
        spans) into the fastest so far; then start the next trial's duel against the fastest
        (:class:`Duel`), or settle on the fastest and switch to it. True when the plan changed."""
        loop = self.loop
        for plan, span in measured:
            if span > 0 and (loop.best is None or span < loop.best[1]):
                loop.best = (plan, span)
                record["best"] = True
        if loop.trials_done < loop.trials and loop.best is not None:
            if not loop.measure_steps:  # the trials' length, from the spread of the steps so far
                loop.measure_steps = trial_steps(loop.spread, self.config.replan_gain, loop.steps)
                record["trial_steps"] = loop.measure_steps
            best = loop.best[0]
            trial = share_plan(self.topo, lambda: self._next_trial(installed, record))
            if trial is not None:
                loop.trials_done += 1
                loop.duel = Duel(best, trial)
                return self._install(best, installed, record, t0, switch, step)
        loop.settled = True
        best = loop.best[0] if loop.best is not None else installed
        return self._install(best, installed, record, t0, switch, step)

    def _install(
        self, plan: Plan, installed: Plan, record: dict[str, Any], t0: float, switch: Switch, step: int
    ) -> bool:  # fmt: skip
        """Log the round, then run ``plan`` from the next step: switch every rank to it, or
        measure the plan in place afresh. True when the plan changed."""
        loop = self.loop
        changed = not same_plan(plan, installed)
        record.update(switched=changed, seconds=time.perf_counter() - t0)
        loop.history.append(record)
        if self._log:
            self._log_conclusion(record, step)
        if changed:
            switch(plan)
        else:
            loop.restart()
        return changed

    def _log_conclusion(self, record: dict[str, Any], step: int) -> None:
        loop, duel = self.loop, self.loop.duel
        ms = record["measured_ms"]
        if record.get("reverted"):
            what = f"the last re-plan measured {ms:.1f} ms per step, slower than the plan before it"
        elif "trial" in record:
            what = (
                f"the duel of {record['trial']} alone ended at {record['trial_ms']:.1f} against "
                f"{record['beat_ms']:.1f} ms per step for the plan to beat"
            )
        elif "duel" in record:
            what = f"a block of the duel measured {ms:.1f} ms per step"
        else:
            what = f"the plan measured {ms:.1f} ms per step"
        if duel is not None and duel.block == 0:
            nxt = (
                f"now measuring a plan of {record.get('next_trial', 'one codec')} alone in turns with "
                f"the fastest so far, {loop.measure_steps} or more steps each (the steps' spans "
                f"spread {100 * loop.spread:.0f} %)"
            )
        elif duel is not None:
            nxt = f"block {duel.block + 1} of {len(DUEL_BLOCKS)} next"
        elif record["switched"]:
            nxt = "settling on the fastest plan measured"
        else:
            nxt = "the plan stays"
        log.info("gradsync closed loop at step %d: %s; %s", step, what, nxt)

    def describe(self, plan: Plan) -> str:
        """A plan in one line: each compressed bucket's size, scheme and parts, in order."""
        out = []
        for b in plan.buckets:
            if b.compress:
                mib = sum(self.slots[i].nbytes for i in b.slots) / 2**20
                parts = f" x{b.partitions}" if b.partitions > 1 else ""
                spec, strategy, local = self.codecs.schemes[b.codec_id].route()
                route = f"{strategy or 'rounds'}{'+local' if local else ''}/{spec}"
                out.append(f"{mib:.2f} MiB {route}{parts}")
        return "; ".join(out) or "dense"

    def _next_trial(self, installed: Plan, record: dict[str, Any]) -> Plan | None:
        """Rank 0: the next trial's plan, or None when none is left. The trials are chosen when
        first asked for (:meth:`_trial_queue`); one whose plan was measured since is passed over."""
        loop, best = self.loop, self.loop.best
        assert best is not None
        if loop.queue is None:
            loop.queue = self._trial_queue([installed, best[0]], loop.trials - loop.trials_done)
        while loop.queue:
            family, plan = loop.queue.pop(0)
            if not same_plan(plan, installed) and not same_plan(plan, best[0]):
                loop.tried.append(family)
                record.update(next_trial=family, next_trial_plan=self.describe(plan))
                return plan
        return None

    def _trial_queue(self, measured: list[Plan], count: int) -> list[tuple[str, Plan]]:
        """Rank 0: the codec families' plans to try (:func:`trial_plans`), fastest predicted
        first, by the refitted model where a round refitted one (else the first plan's)."""
        assert self.params is not None
        cfg, c, t = self.config, self.codecs, self.topo
        nbytes = [s.nbytes for s in self.slots]
        ready, groups = self._measured_groups()
        fit = self.last_refit
        params, codecs = (fit.params, fit.codecs) if fit is not None else (self.params, self.codec_costs)
        overhead = fit.dense_overhead if fit is not None else None
        model = CostModel(params, t.nodes, t.per_node)
        launch = launch_ready(ready)

        def make(ids: tuple[int, ...]) -> Plan:
            return make_plan(
                groups, nbytes, self.scheme, model, codecs, cfg.plan, cfg.dense_algorithm, cfg.partitions,
                fuse_bytes=cfg.bucket_bytes, kinds=[s.group for s in self.slots], rejects=self.rejects,
                margin=1.0 - cfg.replan_gain if fit is not None else COMPRESS_MARGIN,
                dense_overhead=overhead, schemes=c.schemes, candidates=c.candidates, ready=launch,
                allowed=ids,
            )  # fmt: skip

        def price(plan: Plan) -> float:
            return plan_seconds(plan, nbytes, self.scheme, model, codecs, overhead, c.schemes, launch)

        found = trial_plans(self.families, make, price, measured, self.loop.tried, count)
        return [(family, plan) for family, plan, _ in found]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The closed loop's progress and what a resumed run needs to go on re-planning: the
        calibrated links and the first step's order and ready times (plain values)."""
        state = self.loop.state_dict()
        if self.params is not None and self.first is not None:
            p = self.params
            state["links"] = [p.intra.alpha, p.intra.beta, p.inter.alpha, p.inter.beta, p.gamma, p.call]
            state["first_order"] = list(self.first.order)
            state["first_ready"] = [-1.0 if t is None else float(t) for t in self.first.ready_at]
        return state

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.loop.load_state_dict(state)
        state = state or {}
        links, order, ready = state.get("links"), state.get("first_order"), state.get("first_ready")
        if links is None or order is None or ready is None or len(ready) != len(self.slots):
            self.loop.settled = True  # saved before the closed loop existed: keep the plan as it is
            return
        ai, bi, ao, bo, g, *rest = (float(v) for v in links)  # saved before the call cost: 5 values
        self.params = CostParams(Link(ai, bi), Link(ao, bo), g, call=rest[0] if rest else 0.0)
        self.first = FirstStep([int(i) for i in order], [None if t < 0 else float(t) for t in ready])
