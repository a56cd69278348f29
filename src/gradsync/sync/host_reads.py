"""An audit of host reads on the synchronization path: every torch call that makes the host wait
for a tensor's value (``.item()``, ``.tolist()``, ``bool(t)``, ``nonzero``, a tensor built from
host data...) made while gradients synchronize, with the gradsync line that made it.

On a GPU each such read stalls the launch queue until the device has caught up, so a read per
bucket serializes communication with the backward pass. ``torch.cuda.set_sync_debug_mode``
reports them on a GPU only and only on the thread that set it; this audit works on any device
(the CPU included, where it shows what *would* stall a GPU) and follows gradsync's own task
threads::

    with gradsync.audit_host_reads() as audit:
        loss.backward()
        optimizer.step()
    print(audit.summary())

A read that gradsync makes on purpose once per step (the step's agreed flags) is made inside
:func:`expected` and listed apart. The audit is a ``TorchFunctionMode`` entered on each thread
that runs gradsync's work while the audit is open; it slows every torch call a little, so it is
for checks, not for training.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import traceback
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gradsync.codecs.ops.backend import expected_host_read, host_read_reason

HOST_READS = frozenset(
    {
        "item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__", "__array__",
        "nonzero", "masked_select", "unique", "unique_consecutive", "bincount", "argwhere",
        "repeat_interleave", "cpu", "tensor", "as_tensor", "frombuffer", "__repr__", "__format__",
    }
)  # fmt: skip
"""The torch functions whose result depends on a value the host must first read from the device
(or, for ``tensor`` / ``as_tensor`` / ``frombuffer``, that copy host data to the device)."""


@dataclass(frozen=True)
class HostRead:
    """One host read: the torch function, where gradsync made it, on which thread, and whether
    it was one of the expected ones (and which)."""

    op: str
    where: str
    thread: str
    expected: str | None = None


@dataclass
class HostReadAudit:
    """What an open :func:`audit_host_reads` saw."""

    reads: list[HostRead] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, read: HostRead) -> None:
        with self._lock:
            self.reads.append(read)

    @property
    def unexpected(self) -> list[HostRead]:
        """The reads not made inside :func:`expected`."""
        return [r for r in self.reads if r.expected is None]

    def summary(self) -> str:
        """One line per distinct (op, place), with its count, unexpected ones first."""
        counts = Counter((r.expected or "", r.op, r.where) for r in self.reads)
        lines = [
            f"{n:5d}  {op:<12} {where}" + (f"  (expected: {exp})" if exp else "")
            for (exp, op, where), n in sorted(counts.items())
        ]
        return "\n".join(lines) if lines else "no host reads"


_active: HostReadAudit | None = None
_local = threading.local()


def _caller() -> str:
    """The innermost gradsync frame outside this module (else the innermost frame)."""
    frames = traceback.extract_stack(sys._getframe(2), limit=40)
    for fr in reversed(frames):
        name = fr.filename.replace("\\", "/")
        if "/gradsync/" in name and not name.endswith("sync/host_reads.py"):
            return f"{name.rsplit('/gradsync/', 1)[1]}:{fr.lineno} ({fr.name})"
    fr = frames[-1]
    return f"{fr.filename}:{fr.lineno} ({fr.name})"


class _Watch(TorchFunctionMode):
    def __init__(self, audit: HostReadAudit) -> None:
        super().__init__()
        self.audit = audit

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not getattr(_local, "inside", False) and _reads_host(name, args, kwargs):
            _local.inside = True  # (a read inside a read, e.g. __format__ -> item, counts once)
            try:
                thread = threading.current_thread().name
                self.audit.add(HostRead(name, _caller(), thread, host_read_reason()))
            finally:
                _local.inside = False
        return func(*args, **kwargs)


def _reads_host(name: str, args: Any, kwargs: dict[str, Any]) -> bool:
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None
    if name == "nonzero":
        return True
    if name in ("tensor", "as_tensor"):  # a copy from host data (not from a tensor already there)
        data = args[0] if args else kwargs.get("data")
        return not isinstance(data, torch.Tensor)
    return True


@contextlib.contextmanager
def audit_host_reads() -> Iterator[HostReadAudit]:
    """Record every host read made on this thread and on gradsync's task threads while open."""
    global _active
    if _active is not None:
        raise RuntimeError("audit_host_reads: an audit is already open")
    audit = _active = HostReadAudit()
    try:
        with _Watch(audit):
            yield audit
    finally:
        _active = None


def watching() -> contextlib.AbstractContextManager[Any]:
    """For gradsync's worker threads, around each piece of work: the open audit's mode on this
    thread (nothing when no audit is open)."""
    audit = _active
    return _Watch(audit) if audit is not None else contextlib.nullcontext()


expected = expected_host_read
"""Mark the host reads made inside as intended (``why`` names them in the audit)."""

LOSS_SCALE = "the loss scale"


def read_loss_scale(grad_scaler: Any) -> float:
    """``grad_scaler.get_scale()`` as a float: a read of the GradScaler's device tensor, made
    once per step (error feedback keeps its state unscaled)."""
    with expected_host_read(LOSS_SCALE):
        return float(grad_scaler.get_scale())


__all__ = [
    "HOST_READS", "LOSS_SCALE", "HostRead", "HostReadAudit", "audit_host_reads", "expected",
    "read_loss_scale", "watching",
]  # fmt: skip
