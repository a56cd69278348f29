"""The simulated cluster's links: given by rate and latency, or read from a calibration file.

Rates and latencies are written as :mod:`gradsync.units` reads them (``25gbit``, ``12GB/s``;
``20us``, ``1.5ms``). A rate becomes the link's time per byte beta = 1 / (bytes per second), a
latency its start-up time alpha.

``gradsync calibrate`` measures alpha and beta of both levels on a running (or emulated) cluster
with :func:`gradsync.collectives.cost.calibrate` and writes them in the ``gradsync.links/1`` JSON
format that :func:`load_links` reads::

    {"format": "gradsync.links/1", "nodes": 2, "per_node": 2,
     "intra": {"alpha_s": 1.2e-4, "beta_s_per_byte": 3.1e-10},
     "inter": {"alpha_s": 9.8e-4, "beta_s_per_byte": 8.1e-8},
     "gamma_s_per_byte": 2.5e-10, "call_s": 0.0, "efficiency": {"tree/large": 0.85},
     "created": "...", "command": "..."}

``efficiency``: measured over modelled time by kind and size class
(:attr:`gradsync.collectives.cost.CostParams.efficiency`); calibrate measures the node-internal
reduce and broadcast (``tree``). Files without it read as none.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, replace
from typing import Any

from gradsync.collectives.cost import CostParams, Link, parse_efficiency
from gradsync.units import parse_duration, parse_rate

LINKS_FORMAT = "gradsync.links/1"

DEFAULT_INTRA = "800gbit"
"""Inside a node when ``--intra`` is not given: 100 GB/s, an NVLink-class GPU server."""
DEFAULT_INTRA_LATENCY = "5us"
DEFAULT_INTER_LATENCY = "20us"
"""A kernel-TCP start-up per message on a data-centre Ethernet."""
DEFAULT_GAMMA = 1.0 / 400e9
"""Seconds per byte of an element-wise add (about 400 GB/s, an HBM GPU) unless calibrated."""


@dataclass(frozen=True)
class Network:
    """Both link levels of the simulated cluster, and where they came from."""

    params: CostParams
    source: str  # "rates" or the calibration file's path

    @property
    def inter_bytes_per_s(self) -> float:
        return 1.0 / self.params.inter.beta if self.params.inter.beta > 0 else math.inf

    def with_inter(self, bytes_per_s: float | None = None, latency_s: float | None = None) -> Network:
        """The same network with another inter-node rate or latency (a sweep point)."""
        o = self.params.inter
        inter = Link(
            o.alpha if latency_s is None else latency_s, o.beta if bytes_per_s is None else 1 / bytes_per_s
        )
        return Network(replace(self.params, inter=inter), self.source)

    def to_dict(self) -> dict[str, Any]:
        p = self.params
        return {
            "source": self.source,
            "intra": {"alpha_s": p.intra.alpha, "beta_s_per_byte": p.intra.beta},
            "inter": {"alpha_s": p.inter.alpha, "beta_s_per_byte": p.inter.beta},
            "gamma_s_per_byte": p.gamma,
            "call_s": p.call,
        }


def from_rates(
    inter: str,
    intra: str = DEFAULT_INTRA,
    inter_latency: str = DEFAULT_INTER_LATENCY,
    intra_latency: str = DEFAULT_INTRA_LATENCY,
    gamma: float = DEFAULT_GAMMA,
) -> Network:
    """Links from rates and latencies (the options' texts, checked and named in errors)."""
    o = Link(parse_duration(inter_latency, "--inter-latency"), 1 / parse_rate(inter, "--inter"))
    i = Link(parse_duration(intra_latency, "--intra-latency"), 1 / parse_rate(intra, "--intra"))
    if not (math.isfinite(gamma) and gamma >= 0):
        raise ValueError(f"--add-rate must be a positive rate, got gamma {gamma!r}")
    return Network(CostParams(i, o, gamma), "rates")


def links_document(params: CostParams, nodes: int, per_node: int, command: str = "") -> dict[str, Any]:
    """The ``gradsync.links/1`` document of calibrated ``params``."""
    return {
        "format": LINKS_FORMAT,
        "nodes": nodes,
        "per_node": per_node,
        "intra": {"alpha_s": params.intra.alpha, "beta_s_per_byte": params.intra.beta},
        "inter": {"alpha_s": params.inter.alpha, "beta_s_per_byte": params.inter.beta},
        "gamma_s_per_byte": params.gamma,
        "call_s": params.call,
        "efficiency": dict(params.efficiency),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
    }


def _number(d: dict[str, Any], key: str, where: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where}: {key} must be a non-negative number, got {v!r}")
    return float(v)


def parse_links(doc: Any, where: str) -> Network:
    """A ``gradsync.links/1`` document as a :class:`Network` (``ValueError`` naming the field)."""
    if not isinstance(doc, dict) or doc.get("format") != LINKS_FORMAT:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise ValueError(f"{where}: not a {LINKS_FORMAT} calibration file (format {got!r})")
    links = []
    for level in ("intra", "inter"):
        d = doc.get(level)
        if not isinstance(d, dict):
            raise ValueError(f"{where}: {level} must be an object with alpha_s and beta_s_per_byte")
        links.append(
            Link(
                _number(d, "alpha_s", f"{where}: {level}"), _number(d, "beta_s_per_byte", f"{where}: {level}")
            )
        )
    call = _number(doc, "call_s", where) if "call_s" in doc else 0.0  # files before the call cost have none
    efficiency = parse_efficiency(doc.get("efficiency", {}), f"{where}: efficiency")  # nor before this
    gamma = _number(doc, "gamma_s_per_byte", where)
    return Network(CostParams(links[0], links[1], gamma, call=call, efficiency=efficiency), where)


def load_links(path: str) -> Network:
    """Read a calibration file written by ``gradsync calibrate``."""
    try:
        with open(path) as fh:
            doc = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--links {path!r}: cannot read it: {e}") from None
    return parse_links(doc, f"--links {path}")
