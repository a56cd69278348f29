"""The codecs one engine runs, built once from its configuration: the scheme's codec, the codec
for large tensors, the candidates of ``auto:candidates=...``, the density schedule over them, and
which of them may take which tensor.

A codec is known by its id, an index into :attr:`CodecSet.codecs`: the plan names codecs by id
(``BucketPlan.codec_id``), and ids are the same on every rank because every rank builds the set
from the same (agreed) configuration. The first :attr:`CodecSet.class_count` ids are the codec
classes a tensor belongs to by its size (:func:`~gradsync.sync.buckets.codec_class_for`); the
candidates follow.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from gradsync.codecs import Compressor
from gradsync.collectives.compressed import codec_refusal
from gradsync.collectives.topology import Topology
from gradsync.sync.buckets import Slot, codec_class_for
from gradsync.sync.config import SyncConfig
from gradsync.sync.density_schedule import apply_schedule, schedule_for
from gradsync.sync.scheme import Scheme, SchemeCodecs

log = logging.getLogger("gradsync")


def scheme_codecs(
    config: SyncConfig, scheme: Scheme, shape: tuple[int, int] | None = None, resident: bool = False
) -> SchemeCodecs:
    """The codecs an engine with ``config`` runs ``scheme`` with (:meth:`Scheme.build_set`: error
    feedback as the config says, its codec for large tensors; with the topology's ``shape``, the
    candidates resolved for it)."""
    return scheme.build_set(
        config.error_feedback, large_codec=config.large_codec, shape=shape, resident=resident
    )


def resident_on(choice: bool | None, device: torch.device) -> bool:
    """Whether codecs run resident: ``choice``, or (None) whether ``device`` is not the CPU."""
    return choice if choice is not None else torch.device(device).type != "cpu"


class CodecSet:
    """The codecs of one front, by id, each with the scheme it runs under: ``wrap``'s engine's
    (with a topology: the candidates of ``auto:candidates=...`` resolved for it), the DDP hook's
    (before it knows its process group: no candidates, which the hook refuses).

    Resident mode (:attr:`SyncConfig.resident`) is chosen once for all of them: at build where the
    topology says the device, else by :meth:`choose_resident` when the front learns it."""

    def __init__(self, config: SyncConfig, scheme: Scheme, topology: Topology | None = None) -> None:
        self.config = config
        self.scheme = scheme
        self.topo = topology
        self.resident: bool | None = (
            resident_on(config.resident, topology.comm_device) if topology is not None else None
        )
        """Whether the codecs run resident (None: not chosen yet)."""
        shape = (topology.nodes, topology.per_node) if topology is not None else None
        built = scheme_codecs(config, scheme, shape, bool(self.resident))
        self.codecs: list[Compressor] = built.all
        self.class_count = len(built.classes)
        """The codecs a tensor belongs to by its size (the candidates are not among them)."""
        self.schemes: list[Scheme] = [scheme] * self.class_count + [alt for alt, _ in built.candidates]
        """The scheme each codec runs under (by id): the scheme's own, then the candidates'."""
        self.candidates = list(range(self.class_count, len(self.codecs)))
        self.density_schedule = schedule_for(config.density_schedule, self.codecs, config.scheme)
        self.density: float | None = None
        """What the last step ran at under the schedule (the largest density; None when every
        sparsifier ran at its own)."""

    def choose_resident(self, device: torch.device) -> bool:
        """Resident mode for every codec, as the config says (None: where ``device`` is a GPU),
        when the set was built without knowing its device; returns the choice. Once chosen it
        stays: a later call with another answer is refused."""
        on = resident_on(self.config.resident, device)
        if self.resident is not None and on != self.resident:
            raise RuntimeError(
                f"gradsync: the codecs were set up {'resident' if self.resident else 'on the host'}"
                f" and now run on {device}: resident mode is chosen once; build the front again"
            )
        if self.resident is None:
            for codec in self.codecs:
                codec.set_resident(on)
            self.resident = on
        return on

    def __len__(self) -> int:
        return len(self.codecs)

    @property
    def per_tensor(self) -> set[int]:
        """The ids of the codecs that need whole tensors (their streams are per tensor)."""
        return {cid for cid, c in enumerate(self.codecs) if c.per_tensor}

    def codec_class(self, slot: Slot) -> int:
        """-1: never compressed; 0: the scheme's codec; 1: the codec for large tensors."""
        cfg = self.config
        return codec_class_for(
            slot.nbytes, slot.param.is_floating_point(), self.class_count, cfg.min_compress_bytes,
            cfg.large_bytes,
        )  # fmt: skip

    # ------------------------------------------------------------------ what a codec can take
    def _bound(self) -> Topology:
        assert self.topo is not None, "the codecs' limits depend on the topology: make the set with one"
        return self.topo

    def refusal(self, codec_id: int, numel: int, itemsize: int) -> str | None:
        """Why codec ``codec_id`` cannot compress ``numel`` elements in one encode call of its
        scheme (None when it can)."""
        s, t = self.schemes[codec_id], self._bound()
        return codec_refusal(
            self.codecs[codec_id], numel, s.strategy or "allgather", bool(s.local), t.nodes, t.per_node,
            itemsize, self.config.rehearse,
        )  # fmt: skip

    def rejects(self, slots: Sequence[Slot], codec_id: int, members: list[int], parts: int) -> str | None:
        """Why codec ``codec_id`` cannot compress a bucket of ``members`` (slot indices) in
        ``parts`` parts (None when it can): the element counts its encode calls would see."""
        numel = sum(slots[i].numel for i in members)
        itemsize = slots[members[0]].param.element_size()
        for part in range(parts):
            why = self.refusal(codec_id, numel * (part + 1) // parts - numel * part // parts, itemsize)
            if why is not None:
                return why
        return None

    def check_fit(self, slots: Sequence[Slot]) -> None:
        """Refuse, before anything communicates, a codec that could not compress even the
        largest bucket this model can form (e.g. ``topk:k=100000`` on tensors that hold fewer
        elements); smaller buckets it cannot take are left dense by the plan, which says so."""
        for cid in range(len(self.codecs)):
            kinds: dict[tuple[torch.dtype, torch.device], list[Slot]] = {}
            for s in slots:
                c = self.codec_class(s)
                if c == cid or (c >= 0 and cid in self.candidates):
                    kinds.setdefault(s.group, []).append(s)
            for members in kinds.values():
                itemsize = members[0].param.element_size()
                total = sum(s.numel for s in members)
                # a bucket closes once it holds bucket_bytes, so none exceeds this
                cap = (self.config.bucket_bytes - 1) // itemsize + max(s.numel for s in members)
                largest = min(total, cap)
                why = self.refusal(cid, largest, itemsize)
                if why is not None:
                    t = self._bound()
                    raise ValueError(
                        f"{why}: the largest bucket of this model's compressible {members[0].param.dtype} "
                        f"tensors ({len(members)} tensors, {largest} elements) is too small for it under "
                        f"{self.schemes[cid].name} on {t.nodes} x {t.per_node}; use a density instead of k"
                    )

    # ------------------------------------------------------------------ the density schedule
    def set_density(self, step: int, log_changes: bool) -> None:
        """Set each sparsifier's density for ``step`` from the schedule (kept in
        :attr:`density`); logged when it changes."""
        schedule = self.density_schedule
        if schedule is None:
            return
        density = apply_schedule(schedule, self.codecs, step)
        if density != self.density and log_changes:
            if density is None:
                log.info(
                    "gradsync: step %d: density schedule %s over; every sparsifier at its own density",
                    step, schedule.text,
                )  # fmt: skip
            else:
                stage = step // schedule.stage_steps + 1
                log.info(
                    "gradsync: step %d: density schedule %s, stage %d: sparsifiers send %.4g %% of "
                    "each tensor (until step %d)", step, schedule.text, stage, 100 * density,
                    stage * schedule.stage_steps,
                )  # fmt: skip
        self.density = density

    def own_density(self, step: int) -> None:
        """Back to the codecs' own densities (what the planner and its timings assume)."""
        apply_schedule(None, self.codecs, step)
