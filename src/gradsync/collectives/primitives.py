"""Thin, typed wrappers over torch.distributed used by every algorithm.

They add three things the algorithms need and torch.distributed does not give:

- byte accounting per level (:class:`Traffic`), with the standard per-rank send volumes of each
  collective (ring all-reduce ``2(p-1)/p * S``, all-gather and reduce-scatter ``(p-1)/p * S``, ...);
- exchange of byte buffers whose sizes differ across ranks (payloads), by first exchanging sizes
  as an int64 tensor, then padding (all-gather) or splitting (all-to-all): tensors only, no pickle;
- :func:`check_same`: a tiny all-gather of a signature before the real work, so that ranks that
  disagree (tensor size, codec, algorithm) fail with a message naming them instead of hanging.

Only tensors move. A ``group`` of ``None`` means the default (world) group.

Devices: a collective's tensors must be on its backend's device (:func:`comm_device`: the current
GPU under NCCL, the CPU under gloo). Every function here hands torch.distributed tensors on that
device only: a tensor elsewhere (CUDA gradients on a gloo group) is staged through a copy there
and the result copied back, and the small tensors made here (sizes, agreement words) are made
there directly.
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import hashlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync.collectives.topology import backend_device

# all_gather_single is the new name (torch >= 2.13); all_gather_into_tensor exists since 2.0
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

PAIR_CHUNKS = 4
PAIR_CHUNK_MIN = 64 << 10
"""An all-gather between exactly two gloo ranks of at least 2 x ``PAIR_CHUNK_MIN`` bytes per
rank runs as up to ``PAIR_CHUNKS`` concurrent all-gathers of slices (see :func:`_gather`)."""


class _Works:
    """Several collectives in flight, waited for as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for w in self.works:
            w.wait()
        return True


def _gather(
    out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
) -> Any:
    """``all_gather_into_tensor(out, inp)``, with one exception: between exactly two gloo ranks
    a large buffer travels as concurrent all-gathers of its slices. Gloo's two-rank all-gather
    sends and receives on the same connection at once and reached 64 % of the emulated cable's
    rate (2 nodes at 200 Mbit/s, 0.25 to 4 MB per rank), four concurrent slices 86 %; with more
    ranks each rank sends to one neighbour and receives from another, and one all-gather already
    reached 87-92 % (4 nodes at 250 Mbit/s). Returns the work when ``async_op``."""
    p, nbytes = size(group), _nbytes(inp)
    if p != 2 or not _is_gloo(group) or nbytes < 2 * PAIR_CHUNK_MIN:
        return _all_gather_single(out, inp, group=group, async_op=async_op)
    k, n = min(PAIR_CHUNKS, nbytes // PAIR_CHUNK_MIN), inp.numel()
    cuts = [n * i // k for i in range(k + 1)]
    works = []
    for lo, hi in itertools.pairwise(cuts):
        slots = [out[r * n + lo : r * n + hi] for r in range(p)]
        works.append(dist.all_gather(slots, inp[lo:hi], group=group, async_op=True))
    done = _Works(works)
    if async_op:
        return done
    done.wait()
    return None


@dataclass
class Traffic:
    """Bytes this rank sent, per level (``intra``, ``inter``, ``world``), and collective calls.

    Thread-safe: a communication thread adds while the training thread takes."""

    sent: dict[str, int] = field(default_factory=dict)
    calls: int = 0
    total_sent: int = 0
    """All bytes counted since this object was made (:meth:`take` does not reset it)."""
    log: list[tuple[str, str, int, float]] | None = None
    """When a list: every collective appends ``(op, level, bytes, perf_counter() at its end)``
    (a timeline asks for it; off by default)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, level: str, nbytes: float, op: str = "collective") -> None:
        with self._lock:
            if nbytes:
                self.sent[level] = self.sent.get(level, 0) + int(nbytes)
                self.total_sent += int(nbytes)
            self.calls += 1
            if self.log is not None:
                self.log.append((op, level, int(nbytes), time.perf_counter()))

    def take(self) -> dict[str, int]:
        """The bytes per level counted so far, and start counting afresh."""
        with self._lock:
            sent, self.sent = self.sent, {}
        return sent

    def total(self) -> int:
        with self._lock:
            return sum(self.sent.values())


_traffic: contextvars.ContextVar[Traffic | None] = contextvars.ContextVar("gradsync_traffic", default=None)


@contextlib.contextmanager
def record_traffic() -> Iterator[Traffic]:
    """Count the bytes the collectives of this block send from this rank."""
    t = Traffic()
    token = _traffic.set(t)
    try:
        yield t
    finally:
        _traffic.reset(token)


def set_traffic(traffic: Traffic | None) -> None:
    """Count the bytes of this thread's collectives into ``traffic`` from now on (a long-lived
    communication thread uses it instead of :func:`record_traffic`)."""
    _traffic.set(traffic)


def current_traffic() -> Traffic | None:
    """The :class:`Traffic` this thread's collectives count into now (None outside any
    :func:`record_traffic` block): a component that counts its own bytes in a block of its own
    passes them on to it, so an enclosing count misses nothing."""
    return _traffic.get()


EXIT_RELEASE_S = 0.05
"""How long a process that ran gradsync's collectives leaves the GIL free when it exits."""

_exit_callbacks: list[Callable[[], None]] = []
_exit_registered = False


def at_exit(callback: Callable[[], None] | None = None) -> None:
    """Have the interpreter, before it shuts down, run ``callback`` (if given; callbacks run in
    the order given, errors ignored) and then leave the GIL free for :data:`EXIT_RELEASE_S`.

    The pause is for gloo's own worker threads. A gloo worker drops its references to a
    collective's tensors after the caller's wait has returned; where Python no longer holds those
    tensors the worker must take the GIL to free them, and if that happens only once the
    interpreter is shutting down, the worker is ended inside gloo's C++ loop and the process
    aborts ("terminate called without an active exception"). PyTorch does this without gradsync
    too (a script of DDP, one all-gather and destroy_process_group aborted in 3 of 29 runs on
    this project's two-core machine); the pause covers gradsync's last collectives and the
    script's own."""
    global _exit_registered
    if callback is not None and callback not in _exit_callbacks:
        _exit_callbacks.append(callback)
    if not _exit_registered:
        atexit.register(_run_at_exit)
        _exit_registered = True


def _run_at_exit() -> None:
    for callback in _exit_callbacks:
        with contextlib.suppress(Exception):
            callback()
    time.sleep(EXIT_RELEASE_S)


def _account(level: str, nbytes: float, op: str) -> None:
    if not _exit_registered:
        at_exit()
    t = _traffic.get()
    if t is not None:
        t.add(level, nbytes, op)


def comm_device(group: dist.ProcessGroup | None) -> torch.device:
    """The device a collective on ``group`` (``None``: the default group) needs its tensors on."""
    if dist.is_available() and dist.is_initialized():
        return backend_device(dist.get_backend(group))
    return torch.device("cpu")


def _staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` itself on ``device``, else a copy there (the caller copies results back)."""
    return t if t.device == device else t.to(device)


def size(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def global_rank(group: dist.ProcessGroup | None, rank_in_group: int) -> int:
    return dist.get_global_rank(group, rank_in_group) if group is not None else rank_in_group


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ---------------------------------------------------------------------------------- collectives
def all_reduce(
    t: torch.Tensor,
    group: dist.ProcessGroup | None,
    level: str,
    op: dist.ReduceOp | dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> None:
    p = size(group)
    if p > 1 and t.numel():
        w = _staged(t, comm_device(group))
        dist.all_reduce(w, op=op, group=group)
        if w is not t:
            t.copy_(w)
        _account(level, 2 * (p - 1) / p * _nbytes(t), "all_reduce")


def reduce(t: torch.Tensor, dst: int, group: dist.ProcessGroup | None, level: str) -> None:
    """Sum onto global rank ``dst``; other ranks' ``t`` is scratch afterwards."""
    if size(group) > 1 and t.numel():
        w = _staged(t, comm_device(group))
        dist.reduce(w, dst=dst, group=group)
        if w is not t and dist.get_rank() == dst:
            t.copy_(w)
        _account(level, _nbytes(t), "reduce")


def broadcast(t: torch.Tensor, src: int, group: dist.ProcessGroup | None, level: str) -> None:
    if size(group) > 1 and t.numel():
        w = _staged(t, comm_device(group))
        dist.broadcast(w, src=src, group=group)
        if w is not t and dist.get_rank() != src:
            t.copy_(w)
        _account(level, _nbytes(t) if dist.get_rank() == src else 0, "broadcast")  # receivers send nothing


def _is_gloo(group: dist.ProcessGroup | None) -> bool:
    return dist.get_backend(group) == "gloo"


def reduce_scatter(
    out: torch.Tensor,
    inp: torch.Tensor,
    group: dist.ProcessGroup | None,
    level: str,
    scratch: torch.Tensor | None = None,
) -> None:
    """``out`` (numel ``inp.numel() / p``) gets this rank's shard of the sum of every ``inp``;
    ``scratch`` (at least ``inp``'s size, same dtype) saves an allocation.

    Inside a node on gloo this is an all-to-all of the shards followed by a local sum: gloo's own
    reduce-scatter moved 64 MiB between two local ranks 4-5x slower than this (measured on the
    testbed, see docs/benchmarks.md). Across nodes gloo's ring is kept: an all-to-all would
    send more bytes over each node's cable.
    """
    p = size(group)
    if p == 1:
        out.copy_(inp)
        return
    if not inp.numel():
        return
    dev = comm_device(group)
    result, inp = out, _staged(inp, dev)
    out = _staged(out, dev)
    if level == "intra" and _is_gloo(group):
        if scratch is not None and scratch.numel() >= inp.numel() and scratch.device == dev:
            parts = scratch[: inp.numel()].view(p, -1)
        else:
            parts = torch.empty_like(inp).view(p, -1)
        dist.all_to_all_single(parts.view(-1), inp, group=group)
        out.copy_(parts[0])  # streaming adds: several times faster than torch.sum over dim 0
        for j in range(1, p):
            out.add_(parts[j])
    else:
        dist.reduce_scatter_tensor(out, inp, group=group)
    if out is not result:
        result.copy_(out)
    _account(level, (p - 1) / p * _nbytes(inp), "reduce_scatter")


def all_gather(out: torch.Tensor, inp: torch.Tensor, group: dist.ProcessGroup | None, level: str) -> None:
    """``out`` (numel ``p * inp.numel()``) gets every rank's ``inp`` in group-rank order.

    Inside a node on gloo this is an all-to-all of ``p`` copies of ``inp`` (gloo's all-gather was
    about 5x slower for 64 MiB between two local ranks); across nodes gloo's ring is kept.
    """
    p = size(group)
    if p == 1:
        out.copy_(inp)
        return
    if not inp.numel():
        return
    dev = comm_device(group)
    result, inp = out, _staged(inp, dev)
    out = _staged(out, dev)
    if level == "intra" and _is_gloo(group):
        dist.all_to_all_single(out, inp.repeat(p), group=group)
    else:
        _gather(out, inp, group)
    if out is not result:
        result.copy_(out)
    _account(level, (p - 1) * _nbytes(inp), "all_gather")


def all_gather_bytes(
    data: torch.Tensor, group: dist.ProcessGroup | None, level: str, known_size: bool = False
) -> list[torch.Tensor]:
    """Every rank's uint8 buffer, whatever their sizes (padded to the largest on the wire).

    With ``known_size`` every rank promises the same size and the size exchange is skipped.
    """
    p = size(group)
    if p == 1:
        return [data]
    if known_size:
        sizes = [data.numel()] * p
    else:
        dev = comm_device(group)
        mine = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
        all_sizes = torch.empty(p, dtype=torch.int64, device=dev)
        all_gather(all_sizes, mine, group, level)
        sizes = all_sizes.tolist()
    width = max(sizes)
    if width == 0:
        return [data.new_empty(0) for _ in range(p)]
    if data.numel() == width:
        padded = data
    else:
        padded = data.new_zeros(width)
        padded[: data.numel()] = data
    out = data.new_empty(p * width)
    all_gather(out, padded, group, level)
    return [out[i * width : i * width + s] for i, s in enumerate(sizes)]


@dataclass
class PendingGather:
    """An all-gather of fixed-capacity byte buffers in flight (see :func:`start_all_gather_fixed`)."""

    work: Any
    out: torch.Tensor
    capacity: int
    ranks: int
    send: torch.Tensor | None = None  # kept alive until the transfer is done
    device: torch.device | None = None  # where the caller's data is, when not on the comm device

    def wait(self) -> list[torch.Tensor]:
        """Every rank's buffer, each ``capacity`` bytes (the payload is a prefix of it)."""
        if self.work is not None:
            self.work.wait()
            self.work = self.send = None
            if self.device is not None:
                self.out = self.out.to(self.device)
        return [self.out[i * self.capacity : (i + 1) * self.capacity] for i in range(self.ranks)]


def start_all_gather_fixed(
    data: torch.Tensor, capacity: int, group: dist.ProcessGroup | None, level: str
) -> PendingGather:
    """Start gathering ``data`` (at most ``capacity`` bytes, zero-padded) from every rank.

    No size exchange is needed, so the call does not block: the caller overlaps other work
    (another process group's collectives, compression) and then calls ``wait()``.
    """
    if data.numel() > capacity:
        raise ValueError(f"{data.numel()} bytes do not fit the agreed capacity of {capacity}")
    p = size(group)
    dev = comm_device(group) if p > 1 else data.device  # one rank: nothing goes to the backend
    buf = torch.zeros(capacity, dtype=data.dtype, device=dev)
    buf[: data.numel()] = data
    if p == 1:
        return PendingGather(None, buf, capacity, 1)
    out = torch.empty(p * capacity, dtype=data.dtype, device=dev)
    work = _gather(out, buf, group, async_op=True)
    _account(level, (p - 1) * capacity, "all_gather_start")
    return PendingGather(work, out, capacity, p, buf, None if dev == data.device else data.device)


def all_gather_fixed(
    data: torch.Tensor, capacity: int, group: dist.ProcessGroup | None, level: str
) -> list[torch.Tensor]:
    """:func:`start_all_gather_fixed` and its wait in one call (one step, when nothing is to
    overlap it)."""
    return start_all_gather_fixed(data, capacity, group, level).wait()


def all_to_all_bytes(
    chunks: list[torch.Tensor], group: dist.ProcessGroup | None, level: str
) -> list[torch.Tensor]:
    """Send ``chunks[j]`` to group rank ``j``; return what every rank sent to this one."""
    p = size(group)
    if p == 1:
        return list(chunks)
    if len(chunks) != p:
        raise ValueError(f"all_to_all needs one chunk per rank ({p}), got {len(chunks)}")
    home, device = chunks[0].device, comm_device(group)
    send_sizes = torch.tensor([c.numel() for c in chunks], dtype=torch.int64, device=device)
    recv_sizes = torch.empty(p, dtype=torch.int64, device=device)
    dist.all_to_all_single(recv_sizes, send_sizes, group=group)
    _account(level, (p - 1) * 8, "all_to_all_sizes")
    ins, outs = send_sizes.tolist(), recv_sizes.tolist()
    inp = _staged(torch.cat(chunks), device)
    out = torch.empty(sum(outs), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, inp, output_split_sizes=outs, input_split_sizes=ins, group=group)
    me = group_rank(group)
    _account(level, sum(s for j, s in enumerate(ins) if j != me), "all_to_all")
    return list(torch.split(_staged(out, home), outs))


def all_to_all_fixed(
    chunks: list[torch.Tensor], capacities: list[int], group: dist.ProcessGroup | None, level: str
) -> list[torch.Tensor]:
    """Send ``chunks[j]`` (at most ``capacities[j]`` bytes, zero-padded) to group rank ``j`` and
    return what every rank sent to this one, each in a buffer of ``capacities[me]`` bytes (the
    payload is a prefix of it). Every rank passes the same capacities, so no sizes travel first:
    one collective, nothing read back on the host."""
    p = size(group)
    if len(chunks) != p or len(capacities) != p:
        raise ValueError(f"all_to_all needs one chunk and one capacity per rank ({p}), got {len(chunks)}")
    for c, cap in zip(chunks, capacities, strict=True):
        if c.numel() > cap:
            raise ValueError(f"{c.numel()} bytes do not fit the agreed capacity of {cap}")
    me = group_rank(group)
    if p == 1:
        buf = chunks[0].new_zeros(capacities[0])
        buf[: chunks[0].numel()] = chunks[0]
        return [buf]
    home, device = chunks[0].device, comm_device(group)
    inp = torch.zeros(sum(capacities), dtype=torch.uint8, device=device)
    at = 0
    for c, cap in zip(chunks, capacities, strict=True):
        inp[at : at + c.numel()] = c
        at += cap
    out = torch.empty(p * capacities[me], dtype=torch.uint8, device=device)
    dist.all_to_all_single(
        out, inp, output_split_sizes=[capacities[me]] * p, input_split_sizes=capacities, group=group
    )
    _account(level, sum(cap for j, cap in enumerate(capacities) if j != me), "all_to_all")
    return list(torch.split(_staged(out, home), capacities[me]))


def send_recv(
    send: torch.Tensor, dst: int, recv: torch.Tensor, src: int, group: dist.ProcessGroup | None, level: str
) -> None:
    """Send to global rank ``dst`` and receive from global rank ``src`` at the same time."""
    dev = comm_device(group)
    result, send, recv = recv, _staged(send, dev), _staged(recv, dev)
    ops = []
    if send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group))
    if recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    if recv is not result:
        result.copy_(recv)
    _account(level, _nbytes(send), "send_recv")


def send_recv_bytes(
    send: torch.Tensor,
    dst: int,
    src: int,
    group: dist.ProcessGroup | None,
    level: str,
    recv_size: int | None = None,
) -> torch.Tensor:
    """Exchange uint8 buffers with two neighbours: of unknown size (the size travels first), or of
    at most ``recv_size`` bytes (then ``send`` is zero-padded to it, the caller reads the payload
    from the prefix, and nothing is read back on the host)."""
    if recv_size is not None and send.numel() < recv_size:
        padded = send.new_zeros(recv_size)
        padded[: send.numel()] = send
        send = padded
    if recv_size is None:
        dev = comm_device(group)
        mine = torch.tensor([send.numel()], dtype=torch.int64, device=dev)
        theirs = torch.empty(1, dtype=torch.int64, device=dev)
        send_recv(mine, dst, theirs, src, group, level)
        recv_size = int(theirs)
    recv = torch.empty(recv_size, dtype=torch.uint8, device=send.device)
    send_recv(send, dst, recv, src, group, level)
    return recv


# ---------------------------------------------------------------------------------- agreement
def stable_hash(text: str) -> int:
    """A 63-bit hash of a string that is the same in every process."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & (2**63 - 1)


class MismatchError(ValueError):
    """Ranks called a collective with different arguments (or different collectives)."""


AGREEMENT_WORDS = 16  # int64 words of every agreement message, whatever is compared


def check_same(
    group: dist.ProcessGroup | None,
    what: str = "",
    explain: dict[str, Callable[[list[str]], str]] | None = None,
    **fields: int | str,
) -> None:
    """Raise :class:`MismatchError` on every rank unless every rank passes the same ``fields``.

    ``what`` names the operation (``allreduce``, ``compressed_allreduce``...). The message has
    the same size on every rank (:data:`AGREEMENT_WORDS` int64 words: a hash of the operation
    and of the field names, then one word per field, strings by a stable hash), so ranks that
    call different operations get a :class:`MismatchError` naming them, never a transport
    error. Only when something differs, every rank (they all see the same table) gathers the
    texts to show them; ``explain`` turns the ranks' texts of a string field into a sentence.
    """
    p = size(group)
    if p == 1:
        return
    device = comm_device(group)
    names = list(fields)
    if len(names) > AGREEMENT_WORDS - 1:
        raise ValueError(f"check_same compares at most {AGREEMENT_WORDS - 1} fields, got {len(names)}")
    signature = f"{what}({', '.join(names)})"
    values = [stable_hash(signature)]
    values += [stable_hash(v) if isinstance(v, str) else int(v) for v in fields.values()]
    values += [0] * (AGREEMENT_WORDS - len(values))
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    table = torch.empty(p * AGREEMENT_WORDS, dtype=torch.int64, device=device)
    _all_gather_single(table, mine, group=group)
    rows = table.view(p, AGREEMENT_WORDS).tolist()

    def texts(text: str) -> list[str]:
        raw = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
        return [bytes(b.tolist()).decode(errors="replace") for b in all_gather_bytes(raw, group, "world")]

    def ranks(shown: list[str]) -> str:
        return ", ".join(f"rank {global_rank(group, r)}={v}" for r, v in enumerate(shown))

    if len({row[0] for row in rows}) > 1:
        raise MismatchError("ranks called different operations: " + ranks(texts(signature)))
    bad = []
    for i, name in enumerate(names, start=1):
        if len({row[i] for row in rows}) == 1:
            continue
        value = fields[name]
        if isinstance(value, str):
            every = texts(value)
            if explain and name in explain:
                bad.append(f"{name}: {explain[name](every)}")
                continue
            shown = [repr(v) for v in every]
        else:
            shown = [str(row[i]) for row in rows]
        bad.append(f"{name}: " + ranks(shown))
    if bad:
        raise MismatchError("ranks disagree on " + "; ".join(bad))
