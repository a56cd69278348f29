"""Scheme spec strings: which aggregation to run, in one string for Python, the CLI and the simulator.

Grammar (every part is case-sensitive and whitespace around it is ignored)::

    DENSE[/fp16|/bf16]          flat | hierarchical | torus2d | hybrid, optionally 16-bit on the wire
    none                        the same as flat: plain dense all-reduce, DDP's behaviour
    STRATEGY[+local]/CODEC      allgather | ring | ps, with or without local aggregation; any codec
    hitopk/CODEC                allgather+local with a sparsifying codec (the MSTopK paper's HiTopKComm)
    hitopk[:OPTIONS]            hitopk/mstopk[:OPTIONS], e.g. hitopk:density=0.01
    CODEC                       a codec alone; the strategy follows from the codec and topology
    auto                        hitopk/mstopk:density=0.01 on several nodes of several ranks,
                                allgather/mstopk:density=0.01 otherwise; the planner may also
                                pick, per bucket, powersgd:rank=4 (AUTO_CODECS) on any strategy
    auto:candidates=A,B,...     the planner picks, per bucket, among the compressed schemes A, B, ...
                                and dense (A is the scheme's own; each candidate is any compressed
                                scheme above, e.g. auto:candidates=hitopk:density=0.01,powersgd:rank=1;
                                ``|`` separates candidates too, as in comma-separated lists of schemes
                                such as ``bench train --contenders``)

For a codec alone (``topk:density=0.01``, ``powersgd:rank=4``, ``onebit``): sparsifiers use
``allgather`` (``+local``, i.e. hitopk, when there are several nodes of several ranks);
quantizers use ``ps`` (CaSync-PS, ``+local`` likewise); PowerSGD runs its two factor rounds (with
local aggregation likewise); plain ``fp16`` / ``bf16`` become ``hybrid/fp16`` / ``hybrid/bf16``.
:meth:`Scheme.resolve` fills these in for a topology.

References:

- MSTopK paper: Shi et al., "Towards Scalable Distributed Training of Deep Learning on Public Cloud
  Clusters", MLSys 2021, arXiv:2010.10458.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gradsync.codecs import Compressor, ErrorFeedback, build_codec
from gradsync.codecs.config import split_spec, split_spec_list
from gradsync.collectives.dense import dense_algorithm_names
from gradsync.collectives.strategies import compressed_strategy_names

DEFAULT_CODEC = "mstopk:density=0.01"
AUTO_CODECS = (DEFAULT_CODEC, "powersgd:rank=4")
"""The codecs plain ``auto`` weighs per bucket (with dense): the default sparsifier and PowerSGD at
rank 4. Both have measured quality costs (``whatif/quality.py``: PowerSGD at rank 4 lost less than
top-k at 1 % on the project's language model), so adding the low-rank codec does not add a worse
one; which one a bucket runs is the cost model's call. ``auto:candidates=...`` replaces the list."""


@dataclass(frozen=True)
class Scheme:
    """A parsed scheme. ``codec`` is None for dense schemes; ``strategy`` None until resolved."""

    text: str
    kind: str  # "dense" or "compressed"
    algorithm: str = "flat"  # dense algorithm (dense schemes)
    comm_dtype: str | None = None
    strategy: str | None = None  # allgather, ring, ps (compressed schemes)
    local: bool | None = None
    codec: str | None = None
    candidates: tuple[str, ...] = ()
    """More compressed schemes the planner may pick per bucket (``auto:candidates=...``), as
    spec strings; the scheme's own fields are those of the first candidate."""

    @classmethod
    def parse(cls, text: str) -> Scheme:
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"scheme must be a non-empty string like 'hitopk:density=0.01', got {text!r}")
        text = text.strip()
        head, slash, tail = text.partition("/")
        head = head.strip()
        tail = tail.strip()
        if head.startswith("auto:"):
            return cls._with_candidates(text)
        if head == "auto" and not slash:
            return cls(text, "compressed", codec=DEFAULT_CODEC)
        if head in ("none", *dense_algorithm_names()):
            if tail not in ("", "fp16", "bf16") or (head == "none" and tail):
                raise ValueError(
                    f"scheme {text!r}: a dense algorithm takes /fp16 or /bf16 (none takes nothing), "
                    f"got /{tail}"
                )
            return cls(text, "dense", "flat" if head == "none" else head, comm_dtype=tail or None)
        if slash:
            strategy, plus, local = head.partition("+")
            strategy = strategy.strip()
            if strategy not in (*compressed_strategy_names(), "hitopk") or (
                plus and local.strip() != "local"
            ):
                raise ValueError(
                    f"scheme {text!r}: expected STRATEGY[+local]/CODEC with STRATEGY one of "
                    f"{', '.join((*compressed_strategy_names(), 'hitopk'))}, or a dense algorithm "
                    f"({', '.join(('none', *dense_algorithm_names()))})"
                )
            if not tail:
                raise ValueError(f"scheme {text!r}: a compressed scheme needs /CODEC, e.g. {head}/topk")
            codec = build_codec(tail)  # validates the codec spec
            if strategy == "hitopk":
                if not codec.sparse:
                    raise ValueError(
                        f"scheme {text!r}: hitopk needs a sparsifying codec (topk, mstopk, dgc, ...), "
                        f"got {codec.name!r}"
                    )
                return cls(text, "compressed", strategy="allgather", local=True, codec=tail)
            return cls(text, "compressed", strategy=strategy, local=bool(plus), codec=tail)
        name = split_spec(text)[0][0]
        if name == "hitopk":
            options = text.partition(":")[2]
            codec_text = "mstopk" + (":" + options if options else "")
            build_codec(codec_text)
            return cls(text, "compressed", strategy="allgather", local=True, codec=codec_text)
        codec = build_codec(text)  # raises with the list of codecs for an unknown name
        if codec.name == "none" and "+" not in text and ":" not in text:
            return cls(text, "dense", "flat")
        if text in ("fp16", "bf16"):
            return cls(text, "dense", "hybrid", comm_dtype=text)
        return cls(text, "compressed", codec=text)

    @classmethod
    def _with_candidates(cls, text: str) -> Scheme:
        key, _, value = text.partition(":")[2].partition("=")
        specs = split_candidates(value) if key.strip() == "candidates" else []
        if not specs:
            raise ValueError(
                f"scheme {text!r}: expected auto:candidates=A,B,... with compressed schemes, e.g. "
                "auto:candidates=hitopk:density=0.01,powersgd:rank=1"
            )
        parsed = []
        for spec in specs:
            one = cls.parse(spec)
            if one.kind == "dense" or one.candidates:
                raise ValueError(
                    f"scheme {text!r}: candidate {spec!r} is not a compressed scheme; candidates are "
                    "compressed schemes such as hitopk:density=0.01, powersgd:rank=1, ps+local/onebit "
                    "(dense synchronization is always a candidate)"
                )
            parsed.append(one)
        names = [p.text for p in parsed]
        if len(set(names)) < len(names):
            raise ValueError(f"scheme {text!r}: a candidate is listed twice")
        return replace(parsed[0], text=text, candidates=tuple(names[1:]))

    def alternatives(self, nodes: int, per_node: int) -> list[Scheme]:
        """The other candidates, resolved for the topology: those of ``auto:candidates=...`` (plain
        ``auto``: the other :data:`AUTO_CODECS`), and for an ``auto`` scheme every other strategy
        the cost model prices for each candidate's codec (:meth:`strategy_variants`: the same
        codec, so the same information dropped; the planner picks per bucket by predicted time)."""
        explicit = [Scheme.parse(c).resolve(nodes, per_node) for c in self.candidates]
        if not self.text.strip().startswith("auto"):
            return explicit
        if self.text.strip() == "auto":  # plain auto: its other default codecs
            explicit = [Scheme.parse(c).resolve(nodes, per_node) for c in AUTO_CODECS if c != self.codec]
        own = self.resolve(nodes, per_node)
        seen = {own.route(), *(e.route() for e in explicit)}
        out = list(explicit)
        for base in (own, *explicit):
            for variant in base.strategy_variants(nodes, per_node):
                if variant.route() not in seen:
                    seen.add(variant.route())
                    out.append(variant)
        return out

    def route(self) -> tuple[str, str, bool]:
        """What a compressed scheme runs: its codec, its strategy (none for a low-rank codec, whose
        rounds are the same under any) and its local aggregation."""
        spec = self.codec or DEFAULT_CODEC
        strategy = "" if build_codec(spec).per_tensor else (self.strategy or "")
        return spec, strategy, bool(self.local)

    def strategy_variants(self, nodes: int, per_node: int) -> list[Scheme]:
        """This scheme's codec on every compressed strategy (all-gather, ring, PS), with and
        without local aggregation where nodes have several ranks; a low-rank codec's rounds only
        with and without local aggregation (its strategy does not change them)."""
        if self.kind == "dense":
            return []
        spec = self.codec or DEFAULT_CODEC
        codec = build_codec(spec)
        strategies = ("allgather",) if codec.per_tensor else compressed_strategy_names()
        locals_ = (False, True) if nodes > 1 and per_node > 1 else (False,)
        return [
            Scheme(
                f"{s}{'+local' if local else ''}/{spec}", "compressed", strategy=s, local=local, codec=spec
            )
            for s in strategies
            for local in locals_
        ]

    def resolve(self, nodes: int, per_node: int) -> Scheme:
        """Fill in the strategy and local aggregation that a shortcut leaves open."""
        if self.kind == "dense" or (self.strategy is not None and self.local is not None):
            return self
        hierarchy = nodes > 1 and per_node > 1
        codec = build_codec(self.codec or DEFAULT_CODEC)
        strategy = "allgather" if codec.sparse or codec.per_tensor else "ps"
        return replace(
            self, strategy=self.strategy or strategy, local=hierarchy if self.local is None else self.local
        )

    @property
    def name(self) -> str:
        """A canonical name: ``torus2d/fp16``, ``allgather+local/mstopk:density=0.01``."""
        if self.kind == "dense":
            return self.algorithm + (f"/{self.comm_dtype}" if self.comm_dtype else "")
        if not self.candidates:
            return self.own_name
        return f"auto:candidates={'|'.join((self.own_name, *self.candidates))}"

    @property
    def own_name(self) -> str:
        """The canonical name without the other candidates: ``allgather+local/mstopk:density=0.01``."""
        if self.kind == "dense":
            return self.algorithm + (f"/{self.comm_dtype}" if self.comm_dtype else "")
        return f"{self.strategy or '?'}{'+local' if self.local else ''}/{self.codec}"

    def build(self, error_feedback: bool | None = None, *, resident: bool = False) -> Compressor | None:
        """The codec of a compressed scheme (None for dense ones).

        ``error_feedback``: None adds ``+ef`` to codecs whose compression is biased (it is what
        makes top-k, onebit or PowerSGD converge like dense training) unless the spec already has
        it; True requires it (adds it); False never adds it. ``resident``: the codec's resident
        mode, chosen here once (:meth:`~gradsync.codecs.Compressor.set_resident`).
        """
        if self.kind == "dense":
            return None
        codec = build_codec(self.codec or DEFAULT_CODEC, resident=resident)
        if codec.error_feedback or error_feedback is False:
            return codec
        if error_feedback is None and not codec.biased:
            return codec
        if codec.lossless:
            raise ValueError(f"error_feedback=True makes no sense with the lossless codec {codec.name!r}")
        return ErrorFeedback(codec.plain)

    def build_set(
        self,
        error_feedback: bool | None = None,
        *,
        large_codec: str | None = None,
        shape: tuple[int, int] | None = None,
        resident: bool = False,
    ) -> SchemeCodecs:
        """Every codec this scheme runs, built once (each as :meth:`build` builds it): its own
        codec and, with ``large_codec``, the one for large tensors (sent by all-gather); with the
        topology's ``shape`` (nodes, ranks per node), the other candidates of
        ``auto:candidates=...`` resolved for it, each with the scheme it runs under. None of
        them for a dense scheme."""
        own = self.build(error_feedback, resident=resident)
        classes: list[Compressor] = []
        if own is not None:
            classes.append(own)
            if large_codec is not None:
                large = Scheme.parse(f"allgather/{large_codec}").build(error_feedback, resident=resident)
                assert large is not None  # a compressed scheme always has a codec
                classes.append(large)
        candidates = []
        for alt in self.alternatives(*shape) if shape is not None else []:
            codec = alt.build(error_feedback, resident=resident)
            assert codec is not None  # a candidate is a compressed scheme
            candidates.append((alt, codec))
        return SchemeCodecs(classes, candidates)


@dataclass
class SchemeCodecs:
    """The codecs of one scheme (:meth:`Scheme.build_set`)."""

    classes: list[Compressor]
    """By the size class of the tensors they take: the scheme's own, then the large tensors'."""
    candidates: list[tuple[Scheme, Compressor]]
    """The other candidates of ``auto:candidates=...``, each with the scheme it runs under."""

    @property
    def all(self) -> list[Compressor]:
        return [*self.classes, *(c for _, c in self.candidates)]


def split_candidates(value: str) -> list[str]:
    """``topk:density=0.01,compile=false,powersgd:rank=1`` -> the two candidate specs: ``|``
    always separates candidates; a comma piece of the form ``key=value`` with a plain option name
    continues the candidate before it (a codec's own options), any other piece starts the next."""
    return [spec for chunk in value.split("|") for spec in split_spec_list(chunk)]
