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

    Dynamo keeps its compiled versions on the function's code object, so versions of one function
    would share them, and a constant that differs between them (the bit width) would turn into a
    symbolic integer on the second one (where torch 2.11 fails on ``1 << bits``). Each version
    therefore compiles its own copy of the function, with a code object of its own.
    """
    versions: dict[tuple[Any, ...], Callable[..., Any]] = {}

    @functools.wraps(fn)
    def run(*args: Any) -> Any:
        if _mode.get() != "compiled" or torch.compiler.is_compiling():
            return fn(*args)
        key = tuple(a for a in args if not isinstance(a, torch.Tensor))
        compiled = versions.get(key)
        if compiled is None:
            compiled = versions[key] = torch.compile(_own_code(fn))
        return compiled(*args)

    return cast(F, run)  # functools.wraps keeps fn's signature, which the checker cannot see


def _own_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A copy of ``fn`` with a code object of its own (dynamo's compiled versions live there)."""
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    return functools.update_wrapper(copy, fn)
