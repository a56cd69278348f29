"""What ``gradsync train`` reports per epoch, accumulated per step on every rank and combined
over the ranks once per epoch (one small all-reduce, never one per step)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync.sync import StepStats

LEVELS = ("intra", "inter", "world")


@dataclass
class EpochMeter:
    """Per-rank sums over one epoch's optimizer steps (saved in mid-epoch checkpoints)."""

    steps: int = 0
    samples: int = 0
    loss_sum: float = 0.0
    step_s: float = 0.0
    exposed_s: float = 0.0
    compressed_steps: int = 0
    skipped_steps: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    comm_s: float = 0.0
    lag_max_s: float = 0.0
    wait_s: float = 0.0  # waiting for the next batch (input not ready)
    sent: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LEVELS, 0.0))

    def add(self, loss: float, samples: int, step_s: float, stats: StepStats | None) -> None:
        self.steps += 1
        self.samples += samples
        self.loss_sum += loss
        self.step_s += step_s
        if stats is not None:
            self.exposed_s += stats.exposed_s
            self.compressed_steps += int(stats.compressed_buckets > 0)
            self.skipped_steps += int(stats.overflow)
            self.encode_s += stats.compute_s
            self.decode_s += stats.decode_s
            self.comm_s += stats.comm_s
            self.lag_max_s = max(self.lag_max_s, stats.lag_s or 0.0)
            for level, n in stats.sent_bytes.items():
                self.sent[level] = self.sent.get(level, 0.0) + n

    def add_sent(self, sent: dict[str, int], compressed: bool = False) -> None:
        """Bytes sent outside the engine (an optimizer that synchronizes the model itself)."""
        self.compressed_steps += int(compressed)
        for level, n in sent.items():
            self.sent[level] = self.sent.get(level, 0.0) + n

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> EpochMeter:
        return cls(**state)


def epoch_record(
    meter: EpochMeter, wall_s: float, grad_bytes: int, world: int, device: torch.device
) -> dict[str, float]:
    """Combine every rank's meter: means over ranks (per worker) and the global throughput.

    ``compression_ratio`` is what a flat ring all-reduce of the float32 gradients would send per
    worker per step, 2 (p - 1) / p x gradient bytes, over what gradsync sent per worker per step
    on all levels (1.0 for plain dense synchronization, above 1 when compression pays).
    ``exposed_ms``, ``encode_ms``, ``decode_ms``, ``comm_ms``: per step, mean over steps and ranks;
    ``lag_max_ms``: the largest lag of the slowest rank behind the fastest seen in the epoch."""
    sent = [meter.sent.get(k, 0.0) for k in LEVELS]
    vec = torch.tensor(
        [
            meter.loss_sum / max(meter.steps, 1),
            meter.samples,
            meter.step_s,
            meter.exposed_s,
            *sent,
            meter.encode_s,
            meter.decode_s,
            meter.comm_s,
            meter.wait_s,
        ],
        dtype=torch.float64,
        device=device,
    )
    wall = torch.tensor([wall_s, meter.lag_max_s], dtype=torch.float64, device=device)
    if world > 1:
        dist.all_reduce(vec)
        dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    v = (vec / world).tolist()
    steps = max(meter.steps, 1)
    per_step = {k: v[4 + i] / steps for i, k in enumerate(LEVELS)}
    total = sum(per_step.values())
    dense_ref = 2 * (world - 1) / world * grad_bytes
    return {
        "train_loss": v[0],
        "samples_per_s": v[1] * world / float(wall[0]) if wall[0] > 0 else 0.0,
        "step_ms": v[2] / steps * 1e3,
        "exposed_sync_share": v[3] / v[2] if v[2] > 0 else 0.0,
        "bytes_per_step_intra": per_step["intra"],
        "bytes_per_step_inter": per_step["inter"],
        "bytes_per_step_world": per_step["world"],
        "compression_ratio": dense_ref / total if total > 0 else (1.0 if world == 1 else 0.0),
        "compressed_steps": meter.compressed_steps,
        "skipped_steps": meter.skipped_steps,
        "steps": meter.steps,
        "epoch_s": float(wall[0]),
        "exposed_ms": v[3] / steps * 1e3,
        "encode_ms": v[7] / steps * 1e3,
        "decode_ms": v[8] / steps * 1e3,
        "comm_ms": v[9] / steps * 1e3,
        "lag_max_ms": float(wall[1]) * 1e3,
        "data_wait_ms": v[10] / steps * 1e3,
        "data_wait_share": v[10] / (v[10] + v[2]) if v[10] + v[2] > 0 else 0.0,
    }


def cache_figures(sums: dict[str, float], steps: int) -> dict[str, float]:
    """One epoch's data-cache figures from its counters summed over ranks (see
    :meth:`gradsync.apps.data.cache.tiers.SampleTiers.counters`): the share of samples served by each
    tier, files and bytes fetched from central storage, decode time per step (per rank)."""
    asked = sums["memory_hits"] + sums["disk_hits"] + sums["central_files"]
    share = (lambda n: n / asked) if asked > 0 else (lambda n: 0.0)
    return {
        "cache_memory_hit": share(sums["memory_hits"]),
        "cache_disk_hit": share(sums["disk_hits"]),
        "cache_central_share": share(sums["central_files"]),
        "central_files": sums["central_files"],
        "central_bytes": sums["central_bytes"],
        "decoded": sums["decoded"],
        "decode_s": sums["decode_s"],
        "fetch_s": sums["fetch_s"],
    }
