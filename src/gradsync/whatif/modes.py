"""Training modes that do not synchronize a gradient every step, as the simulator predicts them.

Two kinds of contender share their names with ``bench train --contenders``:

- the **outer loop** (``outer@every=H@codec=SPEC@fragments=F@delay=D``, :class:`gradsync.OuterLoop`):
  each node trains alone, its ranks kept in sync by DDP over the node (a ring all-reduce on the
  node's own links, simulated as DDP on a one-node cluster); every H steps the nodes average their
  pseudo-gradients, F fragments of the model each every H / F steps (F = 1: the whole model at
  once), cut by whole tensors as the loop cuts them (one huge tensor makes one huge fragment).
  A fragment's exchange is the same formula as a per-step scheme's (the planner's
  :func:`~gradsync.planner.decide.predict`): the dense hierarchical all-reduce, or the codec on
  the all-gather strategy with local aggregation (one copy per node crosses). A timeline of the
  loop's schedule (:func:`outer_period`) places them: blocking (D = 0) the step that starts one
  waits for all of it; delayed by D steps it runs on gradsync's task threads while the next D
  inner steps compute, one exchange at a time on the link, and only what those steps do not
  cover is exposed. The mean step is the inner step plus the exposed waits and the outer
  optimizer's work spread over the period.
- the **self-syncing optimizers** (``onebit-adam``, ``zeroone-adam``, ``onebit-lamb``, with their
  constructor options after ``@``): the model is not wrapped; after the backward pass the
  optimizer exchanges its momentum, compressed (``codec``, error feedback included) over its
  ``strategy`` (CaSync-PS by default), with a small agreement before it. Nothing overlaps the
  backward pass. The prediction is the compressed phase (the dense warm-up is a DDP step). 0/1
  Adam's steps between its exchanges are local: its own optimizer work and nothing else; its
  mean step weighs the exchange step and the local step by its schedule (:func:`exchange_share`),
  over the steps ``bench train`` measured where it measured them, else in the steady state (an
  exchange every ``max_sync_interval`` steps).

References:

- DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
  arXiv:2311.08105; Streaming DiLoCo: Douillard et al., arXiv:2501.18512.
- 1-bit Adam: Tang et al., arXiv:2102.02888; 0/1 Adam: Lu et al., arXiv:2202.06009.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from gradsync.collectives.cost import CodecCost, CostModel
from gradsync.optim import OneBitAdam, OneBitLamb, ZeroOneAdam
from gradsync.optim.compressed_momentum import build_exchange_codec
from gradsync.optim.zeroone_adam import exchange_steps
from gradsync.outer.schedule import check_outer_options, fragment_offset, split_fragments
from gradsync.planner.decide import no_compute, predict
from gradsync.sync.scheme import Scheme

OUTER_KEYS: dict[str, type] = {
    "every": int, "codec": str, "fragments": int, "delay": int, "mix": float, "outer_lr": float,
    "outer_momentum": float,
}  # fmt: skip
"""An outer contender's options: :class:`gradsync.OuterLoop`'s keywords."""

SELF_SYNCING: dict[str, Any] = {
    "onebit-adam": OneBitAdam,
    "zeroone-adam": ZeroOneAdam,
    "onebit-lamb": OneBitLamb,
}
"""Contenders that are optimizers synchronizing the model themselves (gradsync.optim)."""

SELF_SYNCING_LR = 1e-3

OUTER_STEP_PASSES = 5
"""Passes over a fragment's bytes of the outer step: the pseudo-gradient (anchor - params), the
outer optimizer's update (momentum and anchor), the parameters set from the anchor."""


def split_name(name: str) -> tuple[str, dict[str, str]]:
    """``kind@key=value@...`` -> the kind and its options (``ValueError`` naming the contender)."""
    kind, *items = name.split("@")
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"contender {name!r}: options after '@' take KEY=VALUE")
        out[key.strip()] = value.strip()
    return kind, out


def is_outer(name: str) -> bool:
    """``outer@every=H@codec=SPEC@...``: the DiLoCo-family outer loop, DDP inside each node."""
    return name == "outer" or name.startswith("outer@")


def outer_options(name: str) -> dict[str, Any]:
    """An outer contender's :class:`gradsync.OuterLoop` keywords (``every`` defaults to 10),
    checked: ``ValueError`` naming the contender and the allowed keys."""
    _, items = split_name(name)
    unknown = sorted(set(items) - set(OUTER_KEYS))
    if unknown:
        raise ValueError(
            f"contender {name!r}: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(OUTER_KEYS)}"
        )
    out: dict[str, Any] = {"every": 10}
    for key, text in items.items():
        try:
            out[key] = OUTER_KEYS[key](text)
        except ValueError:
            raise ValueError(
                f"contender {name!r}: {key} takes a {OUTER_KEYS[key].__name__}, got {text!r}"
            ) from None
    if out["every"] < 1 or out.get("fragments", 1) < 1 or not 0 <= out.get("delay", 0) < out["every"]:
        raise ValueError(f"contender {name!r}: needs every >= 1, fragments >= 1 and 0 <= delay < every")
    try:  # the loop's own checks of its outer optimizer (mix, outer_lr, outer_momentum)
        check_outer_options(**{k: v for k, v in out.items() if k != "codec"})
    except ValueError as e:
        raise ValueError(f"contender {name!r}: {e}") from None
    if "codec" in out:
        outer_scheme(out["codec"], 2, 2)  # ValueError naming the codecs
    return out


def is_self_syncing(name: str) -> bool:
    """``onebit-adam``, ``zeroone-adam``, ``onebit-lamb``, each optionally with constructor options
    after ``@`` (``zeroone-adam@sync_growth=1``)."""
    return name.split("@")[0] in SELF_SYNCING


def self_syncing_options(name: str) -> dict[str, Any]:
    """The constructor keywords of a self-syncing contender, checked (``ValueError`` naming the
    contender and the allowed keys). The dense warm-up lasts one step (``freeze_step=1``, and
    ``var_freeze_step=1`` for 0/1 Adam) unless given: the measured steps are the compressed ones."""
    kind, items = split_name(name)
    params = inspect.signature(SELF_SYNCING[kind].__init__).parameters
    kinds = {
        k: type(p.default)
        for k, p in params.items()
        if k not in ("self", "params", "topology") and isinstance(p.default, (bool, int, float, str))
    }
    unknown = sorted(set(items) - set(kinds))
    if unknown:
        raise ValueError(
            f"contender {name!r}: unknown option(s) {', '.join(unknown)}; allowed: {', '.join(kinds)}"
        )
    out: dict[str, Any] = {"lr": SELF_SYNCING_LR, "freeze_step": 1}
    if "var_freeze_step" in kinds:
        out["var_freeze_step"] = 1
    for key, text in items.items():
        want = kinds[key]
        try:
            out[key] = {"true": True, "false": False}[text.lower()] if want is bool else want(text)
        except (KeyError, ValueError):
            raise ValueError(f"contender {name!r}: {key} takes a {want.__name__}, got {text!r}") from None
    if "var_freeze_step" in out and out["var_freeze_step"] < out["freeze_step"]:
        out["var_freeze_step"] = out["freeze_step"]
    build_exchange_codec(out.get("codec", params["codec"].default))  # ValueError naming the codec
    try:  # the optimizer's own checks (step counts, rates, betas...), on a stand-in parameter
        SELF_SYNCING[kind]([torch.nn.Parameter(torch.zeros(1))], **out)
    except ValueError as e:
        raise ValueError(f"contender {name!r}: {e}") from None
    return out


def exchange_share(name: str, window: tuple[int, int] | None = None) -> float:
    """The share of a self-syncing contender's steps that exchange the momentum: 1 for 1-bit
    Adam and 1-bit LAMB (every step). 0/1 Adam steps alone between exchanges on its schedule
    (:func:`gradsync.optim.zeroone_adam.sync_interval`): over the optimizer's steps ``window``
    (first, last; what ``bench train`` measured), or with None in its steady state, once every
    ``max_sync_interval`` steps (what a long run spends nearly all its steps in)."""
    kind = name.split("@")[0]
    if SELF_SYNCING[kind] is not ZeroOneAdam:
        return 1.0
    options = self_syncing_options(name)
    params = inspect.signature(ZeroOneAdam.__init__).parameters
    schedule = [
        int(options.get(key, params[key].default))
        for key in ("var_freeze_step", "sync_growth", "max_sync_interval")
    ]
    if window is None:
        return 1.0 / schedule[2]
    first, last = window
    if not 1 <= first <= last:
        raise ValueError(f"window must be optimizer steps 1 <= first <= last, got {window}")
    return exchange_steps(first, last, *schedule) / (last - first + 1)


def outer_scheme(codec: str | None, nodes: int, per_node: int) -> Scheme:
    """The scheme an outer loop's exchange runs as: the dense hierarchical all-reduce (flat on
    one rank per node), or ``codec`` on the all-gather strategy with local aggregation where
    nodes have several ranks; error feedback added to biased codecs as the outer loop adds it."""
    if codec is None:
        return Scheme.parse("hierarchical" if per_node > 1 else "flat")
    local = "+local" if nodes > 1 and per_node > 1 else ""
    return Scheme.parse(f"allgather{local}/{codec}").resolve(nodes, per_node)


def outer_codec_spec(codec: str | None) -> str | None:
    """The codec spec as the outer loop runs it (``+ef`` on biased codecs), None when dense."""
    if codec is None:
        return None
    built = Scheme.parse(f"allgather/{codec}").build()
    assert built is not None  # a compressed scheme has a codec
    return built.spec()


def self_syncing_exchange(name: str) -> tuple[Scheme, str]:
    """The scheme of a self-syncing contender's momentum exchange and its codec spec (error
    feedback included, as the optimizer runs it)."""
    kind = name.split("@")[0]
    options = self_syncing_options(name)
    params = inspect.signature(SELF_SYNCING[kind].__init__).parameters
    codec = build_exchange_codec(options.get("codec", params["codec"].default))
    strategy = options.get("strategy", params["strategy"].default)
    return Scheme.parse(f"{strategy}/{codec.plain.spec()}"), codec.spec()


@dataclass(frozen=True)
class OuterCost:
    """What the outer loop adds to its inner steps."""

    exchange_s: float  # the largest fragment's exchange
    exposed_s: float  # per period, the waits for exchanges the inner steps did not cover
    step_work_s: float  # per period, the outer steps on the training thread
    per_step_s: float  # (exposed + outer steps) / every
    cable_bytes_per_step: float


PERIODS = 4
"""Periods of the outer schedule the timeline of :func:`outer_period` runs; the last one is the
steady state (a backlog on the link settles within a few)."""


def outer_period(
    exchanges: Sequence[float], works: Sequence[float], every: int, delay: int, inner_s: float
) -> float:
    """The time the outer loop adds to one period of ``every`` inner steps of ``inner_s`` each,
    as :meth:`gradsync.OuterLoop.step` schedules it: fragment ``f`` starts its exchange (of
    ``exchanges[f]`` seconds) after inner step ``(f + 1) * every // F`` and every ``every`` steps
    after; the link carries one exchange at a time (a later one waits for it); blocking
    (``delay`` 0) the training thread waits for it at once, else ``delay`` inner steps later; then
    it runs the fragment's outer step (``works[f]``)."""
    n = len(exchanges)
    offsets = [fragment_offset(f, every, n) for f in range(n)]
    clock = link = 0.0
    landing: dict[int, list[int]] = {}
    finish = [0.0] * n
    begin = 0.0
    for t in range(1, PERIODS * every + 1):
        if t == (PERIODS - 1) * every + 1:
            begin = clock
        clock += inner_s
        for f in landing.pop(t, []):
            clock = max(clock, finish[f]) + works[f]
        for f, offset in enumerate(offsets):
            if t >= offset and (t - offset) % every == 0:
                finish[f] = link = max(clock, link) + exchanges[f]
                if delay == 0:
                    clock = finish[f] + works[f]
                else:
                    landing.setdefault(t + delay, []).append(f)
    return clock - begin - every * inner_s


def outer_fragment_bytes(numels: Sequence[int], fragments: int) -> list[float]:
    """The bytes of each fragment's pseudo-gradient (float32, whatever the parameters' dtype), cut
    by whole tensors as :class:`gradsync.OuterLoop` cuts them
    (:func:`gradsync.outer.schedule.split_fragments`: a model with one huge tensor has one huge
    fragment)."""
    return [4.0 * sum(numels[i] for i in group) for group in split_fragments(numels, fragments)]


def outer_cost(
    name: str, numels: Sequence[int], model: CostModel, bytes_model: CostModel, gamma: float,
    inner_step_s: float, costs: Callable[[str, list[float]], CodecCost], work_rate: float | None = None,
) -> OuterCost:  # fmt: skip
    """The outer loop ``name``'s cost over its inner steps of ``inner_step_s`` (see the module);
    ``numels``: the trained parameters' sizes in model order. ``work_rate``: the loop's own work
    on the training thread per float32 byte of a fragment at each meeting, measured
    (``bench whatif``: the pseudo-gradient's making and the outer step); without it
    :data:`OUTER_STEP_PASSES` passes at the add rate ``gamma``."""
    o = outer_options(name)
    every, delay = o["every"], o.get("delay", 0)
    parts = outer_fragment_bytes(numels, o.get("fragments", 1))
    scheme = outer_scheme(o.get("codec"), model.m, model.n)
    spec = outer_codec_spec(o.get("codec"))
    exchanges, cable = [], 0.0
    for part in parts:
        codec = costs(spec, [part]) if spec is not None else None
        if model.m <= 1:
            exchanges.append(0.0)
            continue
        exchanges.append(predict(scheme, model, part, codec))
        cable += predict(scheme, bytes_model, part, None if codec is None else no_compute(codec))
    per_byte = work_rate if work_rate is not None else OUTER_STEP_PASSES * gamma
    works = [per_byte * part for part in parts]
    added = outer_period(exchanges, works, every, delay, inner_step_s)
    work = sum(works)
    return OuterCost(max(exchanges), max(added - work, 0.0), work, added / every, cable / every)
