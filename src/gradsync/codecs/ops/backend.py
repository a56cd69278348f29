"""Which implementation the common operators run: native kernels, eager torch, or torch.compile.

- ``"native"`` (default): the fused kernels of ``gradsync._native`` for contiguous float32 CPU
  tensors where the extension is built, eager torch for everything else;
- ``"torch"``: every operator in eager torch (the definitions; also what runs on GPUs);
- ``"compiled"``: the torch definitions through ``torch.compile`` (Inductor generates fused C++
  on CPU and Triton on GPU). A codec built with ``compile=true`` encodes and decodes in this mode.

The mode is a context variable, so it is per thread and per task and never leaks out of a block.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import torch

BACKENDS = ("native", "torch", "compiled")

_mode: contextvars.ContextVar[str] = contextvars.ContextVar("gradsync_ops_backend", default="native")

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def backend(name: str) -> Iterator[None]:
    """Run a block with the given operator backend (one of ``BACKENDS``)."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    token = _mode.set(name)
    try:
        yield
    finally:
        _mode.reset(token)


def mode() -> str:
    """The backend selected in this context."""
    return _mode.get()


_host_read: contextvars.ContextVar[str | None] = contextvars.ContextVar("gradsync_host_read", default=None)


@contextlib.contextmanager
def expected_host_read(why: str) -> Iterator[None]:
    """Mark the host reads made inside as intended (a CPU-only tensor such as a stream's
    generator output, or the one flag read a step makes): an audit of host reads
    (:func:`gradsync.sync.host_reads.audit_host_reads`) lists them apart, named by ``why``."""
    token = _host_read.set(why)
    try:
        yield
    finally:
        _host_read.reset(token)


def host_read_reason() -> str | None:
    """Why host reads are expected here (None: they are not)."""
    return _host_read.get()


def compilable(fn: F) -> F:
    """Mark a pure tensor function (tensors in, tensors out) as one to compile in compiled mode.

    Scalars that change from call to call must be passed as 0-dim tensors. Non-tensor arguments
    (bit widths, dtypes, key modes) select one compiled version each, so they stay constants in
    the generated code. torch.compile specializes on the first shape and recompiles with dynamic
    shapes when a second one comes; static code is several times faster on the CPU, so fixed-size
    buckets pay off.

    Each version is a function of its own, compiled once: a copy of :func:`_with_constants`, with
    its own code object (where dynamo keeps compiled versions and counts recompilations) and its
    own globals holding ``fn`` and the constants. Dynamo takes integers read from globals as
    constants; passed as arguments, they would turn symbolic as soon as one version's value
    differed from another's (its profile of which inputs change is kept per source location,
    shared by every copy), and torch 2.11 fails on a symbolic shift such as ``1 << bits``.
    """
    versions: dict[tuple[Any, ...], Callable[..., Any]] = {}

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        if _mode.get() != "compiled" or torch.compiler.is_compiling():
            return fn(*args)
        slots = tuple(None if isinstance(a, torch.Tensor) else (a,) for a in args)
        compiled = versions.get(slots)
        if compiled is None:
            compiled = versions[slots] = torch.compile(_version(fn, slots))
        return compiled(*(a for a in args if isinstance(a, torch.Tensor)))

    return cast(F, run)  # functools.wraps keeps fn's signature, which the checker cannot see


def _with_constants(*tensors: torch.Tensor) -> Any:
    """The template of a compiled version: ``_FN`` called with ``tensors`` in the slots that are
    None in ``_SLOTS`` and the constants of the others (both globals of each copy)."""
    args = []
    i = 0
    for slot in _SLOTS:
        if slot is None:
            args.append(tensors[i])
            i += 1
        else:
            args.append(slot[0])
    return _FN(*args)


_SLOTS: tuple[tuple[Any] | None, ...] = ()
_FN: Callable[..., Any] = _with_constants


def _version(fn: Callable[..., Any], slots: tuple[tuple[Any] | None, ...]) -> Callable[..., Any]:
    """A copy of :func:`_with_constants` with a code object of its own and ``fn`` and ``slots``
    in its own globals."""
    template = _with_constants
    scope = {**template.__globals__, "_FN": fn, "_SLOTS": slots}
    version = types.FunctionType(template.__code__.replace(), scope, fn.__name__)
    version.__qualname__ = f"{fn.__qualname__}[compiled]"
    return version
