"""Replaying a resident codec's device work as CUDA graphs: the fixed cost of a call.

In resident mode (on a GPU, nothing read back by the host) a bucket's encode and decode are a
few dozen small kernels whose shapes never change from one step to the next. Launched one by one
from Python they cost about a millisecond per call whatever the tensor's size; captured once as
a CUDA graph and replayed, they cost one launch. A :class:`Replayer` does that for one codec.

The contract of a replayed function ``fn(*tensors)``:

- it only reads and writes the tensors it is given (and temporaries it makes), plus constants;
  it changes no Python state (counters, buffers swapped, generators drawn) and reads nothing on
  the host. Whatever Python decides before the call (a branch, a count) goes into ``consts``:
  a different value is another graph. What changes from call to call lives in device tensors
  (a stream's random-word counter, a reused threshold), updated in place by ``fn`` itself;
- ``static`` tensors are owned by the caller and come back at the same addresses (state,
  payload buffers, error feedback's two residual buffers: one graph per pair of addresses);
- ``inputs`` are whatever the caller hands over this time (a gradient, received bytes): when one
  comes at an address no graph of this site has seen, a graph is captured for it, and after
  :data:`ADDRESS_SETS` such misses the site keeps one graph over buffers of its own and copies
  each input into them before replaying (one copy of the input, device to device).

A site is one ``name`` with one set of constants and tensor shapes. Capture happens on the
site's second call (the first runs eagerly and also warms up lazily compiled kernels), on a side
stream, in thread-local capture mode (gradsync's task threads and the training thread keep
running). A capture that fails (an operation that cannot be captured) turns that site to the
eager path for good; where capture does not apply at all (CPU tensors, ``GRADSYNC_CUDA_GRAPHS=0``)
the eager path runs. Both are said once in the log (logger ``gradsync``), never per call.

On a CPU, :func:`emulate_on_cpu` makes a replayer trace a site's function to its tensor
operations on fake tensors instead of capturing it (:func:`torch.fx.experimental.proxy_tensor.make_fx`)
and run that trace on later calls, as a graph replays what it recorded: a function that bakes a
Python-side value into its work (a random word drawn on the host, a count) or changes Python
state then gives other results than the eager path, and one that reads a device value on the
host fails to trace, as it fails to capture. The tests compare the two paths with it. CUDA's own
capture rules are checked on a GPU.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("gradsync")

ENV = "GRADSYNC_CUDA_GRAPHS"
"""Set to ``0`` to keep every codec on its eager path (no CUDA graph is captured)."""

ADDRESS_SETS = 4
"""Graphs a site keeps for distinct input addresses before it copies inputs into its own."""

MAX_SITES = 256
"""Sites a replayer keeps (least recently used dropped first: a density schedule that changes
``k`` every step makes a new site every step)."""

_emulating: contextvars.ContextVar[bool] = contextvars.ContextVar("gradsync_graphs_emulate", default=False)
_inside: contextvars.ContextVar[bool] = contextvars.ContextVar("gradsync_graphs_inside", default=False)
_said: set[tuple[str, str]] = set()
_said_lock = threading.Lock()


@contextlib.contextmanager
def emulate_on_cpu() -> Iterator[None]:
    """Inside the block, replayers on CPU tensors replay the function of each site's capture
    instead of running the caller's (see the module text): the capture contract checked on a CPU."""
    token = _emulating.set(True)
    try:
        yield
    finally:
        _emulating.reset(token)


def say_once(owner: str, why: str) -> None:
    """Log ``why`` for ``owner`` the first time only (per process)."""
    with _said_lock:
        if (owner, why) in _said:
            return
        _said.add((owner, why))
    log.info("gradsync: %s runs its eager path: %s", owner, why)


def enabled() -> bool:
    """Whether CUDA graphs may be captured at all (``GRADSYNC_CUDA_GRAPHS`` is not ``0``)."""
    return os.environ.get(ENV, "1").strip() not in ("0", "false", "no", "off")


def _signature(t: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


def _address(t: torch.Tensor) -> tuple[int, int]:
    return (t.data_ptr(), int(t.storage_offset()))


@dataclass
class _Graph:
    replay: Callable[[], None]
    inputs: list[torch.Tensor]
    """The tensors the capture read its inputs from (the caller's, or the site's own copies)."""
    held: list[torch.Tensor]
    """Every tensor the graph reads or writes, kept alive so that no address is reused under it."""


@dataclass
class _Site:
    calls: int = 0
    graphs: dict[tuple[Any, ...], _Graph] = field(default_factory=dict)
    copy_in: bool = False
    eager: bool = False


class Replayer:
    """CUDA graphs of one owner's (a codec's) device work, by site; see the module text."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._sites: OrderedDict[tuple[Any, ...], _Site] = OrderedDict()
        self._lock = threading.Lock()
        self._stream: torch.cuda.Stream | None = None
        self.captured = 0
        """Graphs captured so far (for tests and telemetry)."""
        self.replayed = 0
        """Calls served by a replay."""

    def clear(self) -> None:
        """Forget every graph (the owner's state tensors were replaced: a state was loaded)."""
        with self._lock:
            self._sites.clear()

    def run(
        self,
        name: str,
        fn: Callable[..., None],
        *,
        inputs: Sequence[torch.Tensor],
        static: Sequence[torch.Tensor],
        consts: Hashable = (),
    ) -> None:
        """``fn(*inputs, *static)``: eagerly, or as the replay of a graph captured for it."""
        tensors = [*inputs, *static]
        mode = self._mode(tensors)
        if mode is None:
            fn(*tensors)
            return
        key = (name, consts, tuple(_signature(t) for t in tensors))
        with self._lock:
            site = self._sites.get(key)
            if site is None:
                site = self._sites[key] = _Site()
                while len(self._sites) > MAX_SITES:
                    self._sites.popitem(last=False)
            self._sites.move_to_end(key)
        if site.eager:
            fn(*tensors)
            return
        site.calls += 1
        if site.calls == 1:  # the first call runs eagerly (and compiles what compiles lazily)
            fn(*tensors)
            return
        statics = tuple(_address(t) for t in static)
        own = tuple(_address(t) for t in inputs)
        graph = site.graphs.get((statics, None)) if site.copy_in else site.graphs.get((statics, own))
        if graph is None:
            if not site.copy_in and len(site.graphs) >= ADDRESS_SETS:
                site.copy_in = True  # the inputs come at new addresses each time: copy them in
                site.graphs.clear()
            if len(site.graphs) >= ADDRESS_SETS:  # the caller's own buffers move: no graph fits
                site.eager = True
                site.graphs.clear()
                say_once(
                    f"{self.owner} ({name})", "its buffers move from call to call, so no CUDA graph fits"
                )
                fn(*tensors)
                return
            graph = self._capture(site, name, fn, list(inputs), list(static), mode)
            if graph is None:
                fn(*tensors)
                return
            site.graphs[(statics, None if site.copy_in else own)] = graph
        for mine, given in zip(graph.inputs, inputs, strict=True):
            if _address(mine) != _address(given):
                mine.copy_(given)
        graph.replay()
        self.replayed += 1

    def _mode(self, tensors: Sequence[torch.Tensor]) -> str | None:
        """``"cuda"``, ``"emulate"`` or None (eager: the reason said once)."""
        if _inside.get():  # a replayed function calls another owner's work: part of its graph
            return None
        if not tensors:
            return None
        if all(t.is_cuda for t in tensors):
            if not enabled():
                say_once(self.owner, f"{ENV}=0")
                return None
            return "cuda"
        if _emulating.get() and all(t.device.type == "cpu" for t in tensors):
            return "emulate"
        say_once(self.owner, "CUDA graphs need its tensors on a CUDA device")
        return None

    def _capture(
        self,
        site: _Site,
        name: str,
        fn: Callable[..., None],
        inputs: list[torch.Tensor],
        static: list[torch.Tensor],
        mode: str,
    ) -> _Graph | None:
        if site.copy_in:
            inputs = [t.clone() for t in inputs]
        tensors = [*inputs, *static]
        try:
            replay = self._capture_cuda(fn, tensors) if mode == "cuda" else _trace(fn, tensors)
        except Exception as e:  # (an operation that cannot be captured: stay eager here)
            site.eager = True
            say_once(
                f"{self.owner} ({name})", f"its capture as a CUDA graph failed ({type(e).__name__}: {e})"
            )
            return None
        self.captured += 1
        return _Graph(replay, inputs, tensors)

    def _capture_cuda(self, fn: Callable[..., None], tensors: list[torch.Tensor]) -> Callable[[], None]:
        device = tensors[0].device
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        side, current = self._stream, torch.cuda.current_stream(device)
        graph = torch.cuda.CUDAGraph()
        side.wait_stream(current)  # the capture starts after what the caller queued
        with torch.cuda.stream(side):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                _call(fn, tensors)
            finally:
                graph.capture_end()
        current.wait_stream(side)
        return graph.replay


def _trace(fn: Callable[..., None], tensors: list[torch.Tensor]) -> Callable[[], None]:
    """The emulated capture: ``fn`` traced to its tensor operations on fake tensors (nothing
    runs, as nothing runs in a CUDA capture; whatever Python computes becomes a constant of the
    trace, and a host read of a device value fails, as both do in a CUDA graph)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def body(*ts: torch.Tensor) -> None:
        _call(fn, ts)

    traced = make_fx(body, tracing_mode="fake")(*tensors)
    return lambda: traced(*tensors)


def _call(fn: Callable[..., None], tensors: Sequence[torch.Tensor]) -> None:
    token = _inside.set(True)
    try:
        fn(*tensors)
    finally:
        _inside.reset(token)


__all__ = ["ADDRESS_SETS", "ENV", "MAX_SITES", "Replayer", "emulate_on_cpu", "enabled", "say_once"]
