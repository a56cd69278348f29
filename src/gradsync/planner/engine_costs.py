"""What synchronization costs inside the running engine, as the closed loop refitted it: one
document that ``gradsync whatif --costs`` reads, so the simulator predicts with the costs the
engine measured on a real step instead of those of the links and codecs measured alone.

The document (``gradsync.engine-costs/1``, JSON) holds the refitted links (alpha and beta of
both levels, the add rate and the cost of one collective call), the measured efficiency per kind
of collective and size class (``allgather/small``: measured over modelled communication), each
codec's encode and decode as they ran next to the backward pass (by codec spec), and the dense
buckets' packing and unpacking. The per-call cost and the codecs' costs belong to the host and
the engine, not to the network, so they carry over to another cluster shape or rate (``whatif
--inter``, ``--sweep``); the links' alpha and beta, and the efficiencies, are those of the
cluster the engine ran on.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradsync.collectives.cost import CodecCost, CostParams, Linear, Link, parse_efficiency
from gradsync.planner.closed_loop import Refit

ENGINE_COSTS_FORMAT = "gradsync.engine-costs/1"


@dataclass(frozen=True)
class EngineCosts:
    """The refitted costs, with the codecs by spec (see the module)."""

    params: CostParams
    codecs: dict[str, CodecCost]
    pack: Linear | None  # a dense bucket's packing + unpacking, seconds against bytes
    nodes: int
    per_node: int
    source: str = ""

    @classmethod
    def from_refit(
        cls, refit: Refit, specs: Sequence[str], nodes: int, per_node: int, source: str = ""
    ) -> EngineCosts:
        """``refit``'s costs; ``specs[codec_id]`` names each codec."""
        codecs = {specs[cid]: c for cid, c in refit.codecs.items() if 0 <= cid < len(specs)}
        return cls(refit.params, codecs, refit.pack, nodes, per_node, source)

    def to_dict(self) -> dict[str, Any]:
        p = self.params
        return {
            "format": ENGINE_COSTS_FORMAT,
            "nodes": self.nodes,
            "per_node": self.per_node,
            "source": self.source,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "links": {
                "intra": [p.intra.alpha, p.intra.beta],
                "inter": [p.inter.alpha, p.inter.beta],
                "gamma": p.gamma,
                "call": p.call,
            },
            "efficiency": dict(p.efficiency),
            "codecs": {spec: c.to_dict() for spec, c in sorted(self.codecs.items())},
            "pack": None if self.pack is None else [self.pack.a, self.pack.b],
        }

    def save(self, path: str) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=1)

    @classmethod
    def load(cls, path: str, where: str = "--costs") -> EngineCosts:
        try:
            with open(path) as fh:
                doc = json.load(fh)
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{where} {path}: cannot read it: {e}") from None
        return cls.from_dict(doc, f"{where} {path}")

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> EngineCosts:
        """A ``gradsync.engine-costs/1`` document (``ValueError`` naming ``where`` and the field)."""
        if not isinstance(doc, dict) or doc.get("format") != ENGINE_COSTS_FORMAT:
            raise ValueError(f"{where}: not a {ENGINE_COSTS_FORMAT} document")
        links = doc.get("links")
        if not isinstance(links, dict):
            raise ValueError(f"{where}: links must be an object with intra, inter, gamma and call")
        intra, inter = (Link(*_pair(links.get(k), f"{where}: links.{k}")) for k in ("intra", "inter"))
        params = CostParams(
            intra, inter, _number(links.get("gamma"), f"{where}: links.gamma"),
            call=_number(links.get("call"), f"{where}: links.call"),
            efficiency=parse_efficiency(doc.get("efficiency", {}), f"{where}: efficiency"),
        )  # fmt: skip
        codecs = {}
        table = doc.get("codecs")
        if not isinstance(table, dict):
            raise ValueError(f"{where}: codecs must be an object of codec spec -> costs")
        for spec, d in table.items():
            codecs[str(spec)] = CodecCost.from_dict(d, f"{where}: codecs[{spec!r}]")
        pack = doc.get("pack")
        nodes, per_node = doc.get("nodes"), doc.get("per_node")
        if not (_positive_int(nodes) and _positive_int(per_node)):
            raise ValueError(f"{where}: nodes and per_node must be positive integers")
        assert isinstance(nodes, int) and isinstance(per_node, int)
        return cls(
            params, codecs, None if pack is None else Linear(*_pair(pack, f"{where}: pack")), nodes, per_node,
            str(doc.get("source", "")),
        )  # fmt: skip


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _number(v: Any, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{where} must be a non-negative number, got {v!r}")
    return float(v)


def _pair(v: Any, where: str) -> tuple[float, float]:
    if not isinstance(v, list) or len(v) != 2:
        raise ValueError(f"{where} must be a pair [a, b] of non-negative numbers, got {v!r}")
    return _number(v[0], where), _number(v[1], where)
