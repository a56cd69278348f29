"""The schemes gradsync's FSDP2 compression takes (:mod:`gradsync.integrate.fsdp`), checked where
the front, the benchmarks and the simulator all read them."""

from __future__ import annotations

from gradsync.sync.momentum import sync_momentum
from gradsync.sync.scheme import Scheme


def parse_fsdp_scheme(scheme: str) -> Scheme:
    """``scheme`` as FSDP2's compression runs it (plain ``fp16``/``bf16`` as codecs), or
    ``ValueError`` naming what FSDP cannot take: dense algorithms, ``auto``, hierarchical schemes,
    low-rank codecs, momentum correction."""
    parsed = Scheme.parse(scheme)
    if parsed.kind == "dense" and parsed.comm_dtype is not None and "/" not in parsed.text:
        # plain fp16 / bf16: under FSDP, the codec (16-bit payloads in the reduce-scatter and
        # the replicate all-reduce); FSDP has no dense algorithms of its own to pick from
        parsed = Scheme(parsed.text, "compressed", codec=parsed.text)
    if parsed.kind == "dense":
        if parsed.algorithm != "flat":
            raise ValueError(
                f"compress_fsdp: scheme {scheme!r}: the dense schemes FSDP takes are 'none' (PyTorch's own "
                "collectives); 16-bit communication is spelled 'fp16' or 'bf16' (or "
                "'allgather/fp16', 'ring/bf16', 'ps/fp16'), not a dense algorithm such as hybrid/fp16"
            )
        return parsed
    if parsed.candidates or parsed.text.strip().startswith("auto"):
        raise ValueError(
            f"compress_fsdp: scheme {scheme!r}: 'auto' plans DDP buckets; give one compressed scheme"
        )
    if parsed.local:
        raise ValueError(
            f"compress_fsdp: scheme {scheme!r}: hierarchical schemes (hitopk, STRATEGY+local) are not for "
            "FSDP, whose hierarchy is the mesh; use a codec such as topk:density=0.01 or onebit"
        )
    codec = parsed.build()
    assert codec is not None
    if codec.per_tensor:
        raise ValueError(
            f"compress_fsdp: scheme {scheme!r}: low-rank codecs (powersgd) need whole matrices; FSDP "
            "reduces flat shards of several parameters. Use a sparsifying or quantizing codec"
        )
    if sync_momentum([codec]) is not None:
        raise ValueError(
            f"compress_fsdp: scheme {scheme!r}: ef momentum (momentum correction) is not supported "
            "under FSDP: it moves the optimizer's momentum into the synchronization, and FSDP's "
            "hooks cannot give it to the reductions that go dense; use ef without momentum (e.g. "
            "topk:density=0.01+ef) and the optimizer's momentum, or gradsync.wrap"
        )
    return parsed.resolve(1, 1)
