"""Reusable scratch buffers.

Allocating a fresh buffer of tens of MiB per call on the CPU costs more than the kernels that
use it (the allocator maps new pages and every first touch faults), so codecs keep their scratch
space in a :class:`Workspace` and reuse it across calls. A workspace belongs to one codec object
and is not shared between threads; nothing taken from it may escape a call.
"""

from __future__ import annotations

import torch


class Workspace:
    """Named scratch buffers that grow geometrically and are handed out as views."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def get(
        self, name: str, numel: int, dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """A 1-D view of at least ``numel`` elements; contents are undefined."""
        device = torch.device(device)
        key = (name, dtype, device)
        buf = self._buffers.get(key)
        if buf is None or buf.numel() < numel:
            size = max(numel, int(buf.numel() * 1.5) if buf is not None else 0, 16)
            buf = torch.empty(size, dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:numel]
