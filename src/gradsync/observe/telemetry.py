"""Per-step telemetry: what one synchronized step sent, saved and cost, as plain numbers.

The engine measures every step anyway (:class:`~gradsync.sync.StepStats`, per bucket
:class:`~gradsync.sync.stats.BucketStats`): reading them costs nothing, and the slowest
rank's lag travels in the step check's all-reduce, which runs anyway. One figure costs a pass
over memory and is taken only when asked: the error-feedback residual's norm
(:meth:`~gradsync.integrate.engine.SyncEngine.residual_norm`, between steps).

Field meanings (times in milliseconds, sizes in bytes, per rank):

- ``raw_bytes``: gradient bytes synchronized; ``wire_bytes``: bytes this rank sent, per level
  and ``total``; ``reduction``: a dense ring all-reduce's bytes, 2 (p - 1) / p x ``raw_bytes``,
  over ``total`` (1 for dense synchronization, the compression's saving above 1);
- ``encode_ms`` (packing, encoding, merging on the compute thread), ``decode_ms`` (decoding,
  unpacking), ``comm_ms`` (inside collectives): busy times, mostly hidden behind the backward
  pass; ``exposed_ms``: what synchronization added to the step after the backward pass;
- ``lag_ms``: the previous step's lag of the slowest rank behind the fastest;
- ``residual_norm``: L2 norm of the error-feedback residuals (the gradient still owed);
- ``buckets``: the same per bucket, with its ``ratio`` (gradient bytes over bytes sent).
"""

from __future__ import annotations

from typing import Any

from gradsync.sync.stats import StepStats

LEVELS = ("intra", "inter", "world")


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1e3, 3)


def step_record(
    stats: StepStats, *, residual_norm: float | None = None, buckets: bool = True
) -> dict[str, Any]:
    """One step's telemetry as a JSON-ready dict (see the module docstring for the fields)."""
    wire = {lvl: int(stats.sent_bytes.get(lvl, 0)) for lvl in LEVELS}
    wire["total"] = stats.wire_bytes
    rec: dict[str, Any] = {
        "step": stats.step,
        "dense": stats.dense,
        "compressed_buckets": stats.compressed_buckets,
        "buckets_total": stats.buckets,
        "raw_bytes": stats.raw_bytes,
        "wire_bytes": wire,
        "reduction": None if stats.reduction is None else round(stats.reduction, 3),
        "encode_ms": _ms(stats.compute_s),
        "decode_ms": _ms(stats.decode_s),
        "comm_ms": _ms(stats.comm_s),
        "backward_ms": _ms(stats.backward_s),
        "exposed_ms": _ms(stats.exposed_s),
        "overlapped_ms": _ms(stats.overlapped_s),
        "lag_ms": _ms(stats.lag_s),
        "residual_norm": residual_norm,
        "overflow": stats.overflow,
    }
    if buckets:
        rec["buckets"] = [
            {
                "index": b.index,
                "key": b.key,
                "compressed": b.compressed,
                "raw_bytes": b.raw_bytes,
                "wire_bytes": b.wire_bytes,
                "ratio": None if b.ratio is None else round(b.ratio, 3),
                "encode_ms": _ms(b.compute_s),
                "decode_ms": _ms(b.decode_s),
                "comm_ms": _ms(b.comm_s),
            }
            for b in stats.bucket_stats
        ]
    return rec


def format_line(rec: dict[str, Any]) -> str:
    """One log line for a :func:`step_record`."""
    w = rec["wire_bytes"]
    sent = " ".join(f"{lvl} {w[lvl] / 1e6:.3f}" for lvl in LEVELS if w.get(lvl))
    parts = [
        f"step {rec['step']}",
        f"{rec['compressed_buckets']}/{rec['buckets_total']} buckets compressed",
        f"sent MB {sent or '0'}",
    ]
    if rec["reduction"] is not None:
        parts.append(f"{rec['reduction']:.1f}x fewer bytes than dense")
    parts.append(
        f"encode {rec['encode_ms']:.1f} ms, decode {rec['decode_ms']:.1f} ms, comm {rec['comm_ms']:.1f} ms"
    )
    parts.append(f"exposed {rec['exposed_ms']:.1f} ms")
    if rec["lag_ms"] is not None:
        parts.append(f"lag {rec['lag_ms']:.1f} ms")
    if rec["residual_norm"] is not None:
        parts.append(f"residual {rec['residual_norm']:.4g}")
    return ", ".join(parts)
