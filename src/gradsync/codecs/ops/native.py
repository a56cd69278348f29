"""Access to the fused CPU kernels in ``gradsync._native``.

The kernels are an accelerator for the common operators, never a requirement: every operator
has a torch implementation that is the definition (and the path on GPUs, under torch.compile,
for dtypes other than float32, and where the extension is not built). :func:`usable` decides per
call, following the backend chosen with :func:`gradsync.codecs.ops.backend`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from gradsync.codecs.ops.backend import mode as backend_mode

__all__ = ["AVAILABLE", "MAX_NUMEL", "Kernels", "enabled", "ext", "ptr", "usable"]


class Kernels(Protocol):
    """What :func:`ext` returns: the functions of ``gradsync._native``.

    ``gradsync/_native.pyi`` documents them; a type checker verifies that the module declared
    there matches this protocol (at the assignment of ``_ext`` below), so the two cannot drift.
    """

    SUPPORTED: int

    def stats(self, x: int, n: int, /) -> tuple[float, float, int, float]: ...
    def absmax(self, x: int, n: int, /) -> tuple[float, int]: ...
    def scan_select(
        self, x: int, n: int, t: float, mode: int, want_sum: bool, idx: int, val: int, cap: int, /
    ) -> tuple[int, float, float, int]: ...
    def sum_scan_select(
        self,
        x: int,
        y: int,
        n: int,
        out: int,
        out_nbytes: int,
        t: float,
        mode: int,
        want_sum: bool,
        idx: int,
        val: int,
        cap: int,
        /,
    ) -> tuple[int, float, float, int]: ...
    def count_ge(self, x: int, n: int, thresholds: Sequence[float], mode: int, /) -> list[int]: ...
    def kth_largest(
        self, v: int, n: int, k: int, mode: int, scratch: int, scratch_nbytes: int, /
    ) -> float: ...
    def keep_top(self, idx: int, val: int, n: int, k: int, kth: float, mode: int, /) -> int: ...
    def sign_pack(self, x: int, n: int, bits: int, bits_nbytes: int, /) -> tuple[float, int, float, int]: ...
    def ternary_pack(self, x: int, n: int, tau: float, out: int, out_nbytes: int, /) -> tuple[int, int]: ...
    def stoch_pack(
        self,
        x: int,
        n: int,
        mult: float,
        levels: int,
        bits: int,
        k1: int,
        k2: int,
        out: int,
        out_nbytes: int,
        /,
    ) -> None: ...
    def lut_unpack(
        self,
        codes: int,
        codes_nbytes: int,
        n: int,
        bits: int,
        lut: Sequence[float],
        out: int,
        out_nbytes: int,
        accumulate: bool,
        /,
    ) -> None: ...
    def to_half(
        self, x: int, n: int, scale: float, out: int, out_nbytes: int, bf16: bool, /
    ) -> tuple[float, int, int]: ...
    def from_half(
        self, h: int, n: int, scale: float, out: int, out_nbytes: int, bf16: bool, accumulate: bool, /
    ) -> None: ...
    def sparse_add(self, out: int, n: int, idx: int, val: int, m: int, alpha: float, /) -> int: ...
    def sparse_to_dense(self, out: int, n: int, idx: int, val: int, m: int, /) -> int: ...
    def copy_check(self, x: int, n: int, out: int, out_nbytes: int, /) -> bool: ...
    def range_positions(
        self, keys: int, n: int, lo: float, hi: float, pos: int, pos_nbytes: int, /
    ) -> int: ...
    def random_subset(
        self, n: int, k: int, seed: int, idx: int, idx_nbytes: int, bitmap: int, bitmap_nbytes: int, /
    ) -> None: ...
    def gather(self, x: int, n: int, idx: int, m: int, val: int, val_nbytes: int, /) -> None: ...


_ext: Kernels | None
try:  # the extension is optional (see setup.py)
    import gradsync._native as _native  # the extension module itself, not the package's facade

    _ext = _native
    AVAILABLE = bool(_native.SUPPORTED)
except ImportError:  # pragma: no cover - depends on the build
    _ext = None
    AVAILABLE = False

# Largest element count the kernels take (their indices are int32).
MAX_NUMEL = 2**31 - 1


def enabled() -> bool:
    """True when native kernels may run at all in the current context."""
    return AVAILABLE and backend_mode() == "native" and not torch.compiler.is_compiling()


def usable(*tensors: torch.Tensor) -> bool:
    """True when the native kernels may run on these tensors in the current context."""
    if not enabled():
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
            return False
        if t.numel() > MAX_NUMEL:
            return False
    return True


def ext() -> Kernels:
    """The loaded extension module (call only after :func:`usable` returned True)."""
    if _ext is None:  # pragma: no cover - guarded by usable()
        raise RuntimeError("gradsync._native is not built")
    return _ext


def ptr(t: torch.Tensor) -> int:
    """Address of a tensor's first element (0 for an empty tensor), for a kernel to read or write
    ``t.nbytes`` bytes from it.

    Raises ``ValueError`` for a tensor that is not one flat buffer in host memory (on another
    device, or not contiguous): a kernel handed its address would read or write the wrong bytes.
    """
    if not t.is_cpu or not t.is_contiguous():
        where = "not on the CPU" if not t.is_cpu else "not contiguous"
        raise ValueError(
            f"native kernels take contiguous CPU tensors; got one {where} ({t.device}, {tuple(t.shape)})"
        )
    return t.data_ptr() if t.numel() else 0
