"""Access to the fused CPU kernels in ``gradsync._native``.

The kernels are an accelerator for the common operators, never a requirement: every operator
has a torch implementation that is the definition (and the path on GPUs, under torch.compile,
for dtypes other than float32, and where the extension is not built). :func:`usable` decides per
call, following the backend chosen with :func:`gradsync.codecs.ops.backend`.
"""

from __future__ import annotations

import torch

from gradsync.codecs.ops.backend import backend
from gradsync.codecs.ops.backend import mode as backend_mode

__all__ = ["AVAILABLE", "MAX_NUMEL", "backend", "enabled", "ext", "ptr", "usable"]

try:  # the extension is optional (see setup.py)
    from gradsync import _native as _ext

    AVAILABLE = bool(_ext.SUPPORTED)
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


def ext() -> object:
    """The loaded extension module (call only after :func:`usable` returned True)."""
    if _ext is None:  # pragma: no cover - guarded by usable()
        raise RuntimeError("gradsync._native is not built")
    return _ext


def ptr(t: torch.Tensor) -> int:
    """Address of a tensor's first element (0 for an empty tensor)."""
    return t.data_ptr() if t.numel() else 0
