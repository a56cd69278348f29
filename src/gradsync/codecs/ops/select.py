"""Threshold selection: counting, compaction and exact top-k.

Every selection method of the papers is a threshold search over ``key(x)`` (``|x|``, or ``x`` /
``-x`` for one-signed selection) followed by a compaction. The expensive part is touching the whole
tensor, so this module gives them one primitive that touches it once:

:class:`CandidateSet` scans the tensor a single time, computing its statistics and compacting
every element whose key is at least a *floor*. The floor is estimated from a small sample taken
with a prime stride (:func:`sample_stride`) so that only a few times ``k`` elements survive.
Afterwards, counting or selecting at any threshold at or above the floor reads only the
candidates (kilobytes instead of megabytes); a threshold below the floor falls back to a pass
over the full tensor, so every answer is exact whatever the data.
On the torch path the floor is ``-inf`` and the candidates are the whole tensor, which makes that
path the plain definition of the same algorithms.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import struct
from dataclasses import dataclass

import torch

from gradsync.codecs.ops import native
from gradsync.codecs.ops.backend import compilable
from gradsync.codecs.ops.reduce import TensorStats, tensor_stats
from gradsync.codecs.ops.workspace import Workspace


class Key(enum.IntEnum):
    """What a threshold is compared with (the values match the native kernels)."""

    ABS = 0  # |x|
    POS = 1  # x
    NEG = 2  # -x


def f32(v: float) -> float:
    """Round a Python float to the nearest float32 (thresholds are compared in float32)."""
    if math.isinf(v) or math.isnan(v):
        return v
    return struct.unpack("<f", struct.pack("<f", max(min(v, 3.4028234663852886e38), -3.4028234663852886e38)))[
        0
    ]


def f32_above(v: float) -> float:
    """The smallest float32 strictly greater than ``v``: ``key >= f32_above(v)`` is ``key > v``."""
    v = f32(v)
    if math.isnan(v) or v == math.inf:
        return v
    if v == 0.0:
        return 1.401298464324817e-45  # the smallest positive subnormal
    bits = struct.unpack("<i", struct.pack("<f", v))[0]
    # float32 bit patterns are ordered like sign-magnitude integers
    bits = bits + 1 if v > 0 else bits - 1
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def keyed(x: torch.Tensor, key: Key) -> torch.Tensor:
    """``|x|``, ``x`` or ``-x`` as float32."""
    xf = x.float()
    if key == Key.ABS:
        return xf.abs()
    return xf if key == Key.POS else -xf


def count_ge(x: torch.Tensor, thresholds: list[float], key: Key = Key.ABS) -> list[int]:
    """``#{i : key(x_i) >= t}`` for each threshold, in one pass per 16 thresholds."""
    ts = [f32(t) for t in thresholds]
    if not ts:
        return []
    if native.usable(x):
        counts: list[int] = []
        for start in range(0, len(ts), 16):
            counts.extend(native.ext().count_ge(native.ptr(x), x.numel(), ts[start : start + 16], int(key)))
        return counts
    thresholds_t = torch.tensor(ts, dtype=torch.float32, device=x.device)
    return [int(c) for c in _count_ge(x, thresholds_t, int(key)).tolist()]


@compilable
def _count_ge(x: torch.Tensor, ts: torch.Tensor, key: int) -> torch.Tensor:
    k = keyed(x, Key(key))
    return torch.stack([(k >= ts[j]).sum() for j in range(ts.numel())])


def kth_largest(keys: torch.Tensor, k: int, ws: Workspace | None = None) -> float:
    """The ``k``-th largest entry of a 1-D float tensor without NaN (1-based)."""
    n = keys.numel()
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, {n}], got {k}")
    if native.usable(keys):
        scratch = (ws or Workspace()).get("kth", n, torch.float32)
        return native.ext().kth_largest(
            native.ptr(keys), n, k, int(Key.POS), native.ptr(scratch), scratch.nbytes
        )
    return float(torch.topk(keys.float(), k, sorted=False).values.min())


def keep_largest(
    idx: torch.Tensor, val: torch.Tensor, keys: torch.Tensor, k: int, kth: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the entries with key > kth, then ties (key == kth) in index order, ``k`` in total.

    ``idx``/``val``/``keys`` are aligned and in index order; the result keeps that order.
    """
    greater = keys > kth
    ties = keys == kth
    need = k - int(greater.sum())
    keep = greater | (ties & (torch.cumsum(ties, 0) <= need))
    return idx[keep], val[keep]


@dataclass
class CandidateSet:
    """Elements of ``x`` with ``key(x) >= floor``, in index order, plus ``x``'s statistics."""

    x: torch.Tensor
    key: Key
    floor: float
    idx: torch.Tensor
    val: torch.Tensor
    keys: torch.Tensor
    stats: TensorStats
    ws: Workspace

    @property
    def count(self) -> int:
        return self.idx.numel()

    @classmethod
    def scan(
        cls,
        x: torch.Tensor,
        key: Key,
        target: int,
        minimum: int = 0,
        at_least: float = -math.inf,
        ws: Workspace | None = None,
        want_sum: bool = True,
        addends: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> CandidateSet:
        """Scan ``x`` once; aim for about ``target`` candidates and guarantee ``minimum``.

        ``minimum`` candidates are guaranteed only when that many elements have a key of at least
        ``at_least`` (the floor never goes below ``at_least``). With ``want_sum=False`` the
        native pass skips ``sum |x|`` (``stats.sum_abs`` is then NaN).

        ``addends`` ``(a, b)``: ``x`` is not computed yet; it is to hold ``a + b`` (flat, of
        ``x``'s size and dtype), which the scan writes while it reads them (one pass instead of an
        addition and a scan: error feedback's residual + gradient). ``x`` holds the sum after.
        """
        ws = ws or Workspace()
        n = x.numel()
        if addends is not None and any(a.numel() != n for a in addends):
            sizes = [a.numel() for a in addends]
            raise ValueError(f"scan: addends of {sizes} elements for a tensor of {n}")
        if addends is not None and not native.usable(x, *addends):
            torch.add(addends[0], addends[1], out=x)
            addends = None
        if not native.usable(x):
            return cls._everything(x, key, at_least, ws)
        floor, rank, sample = _estimate_floor(x, key, target, ws, addends)
        floor = max(floor, at_least)
        expected = rank * n / sample.numel() if sample.numel() else n
        cap = min(n, max(int(1.5 * expected), 4096))
        while True:
            cnt, idx, val, stats = _native_scan(x, key, floor, want_sum, cap, ws, addends)
            addends = None  # x holds the sum from here on
            if cnt > cap:  # more candidates than room: grow and scan again (ties or a bad sample)
                cap = cnt
                continue
            if cnt < minimum and floor > at_least:  # floor too high: lower it
                floor, rank = _lower_floor(sample, rank, at_least, ws)
                continue
            break
        keys = ws.get("cand_keys", cnt, torch.float32)
        if key == Key.ABS:
            torch.abs(val, out=keys)
        elif key == Key.POS:
            keys.copy_(val)
        else:
            torch.neg(val, out=keys)
        return cls(x, key, floor, idx, val, keys, stats, ws)

    @classmethod
    def _everything(cls, x: torch.Tensor, key: Key, at_least: float, ws: Workspace) -> CandidateSet:
        keys = torch.nan_to_num(keyed(x, key), nan=-math.inf)
        idx = torch.arange(x.numel(), device=x.device)
        if at_least == -math.inf:
            return cls(x, key, at_least, idx, x, keys, tensor_stats(x), ws)
        keep = torch.nonzero(keys >= f32(at_least)).flatten()
        return cls(x, key, at_least, idx[keep], x[keep], keys[keep], tensor_stats(x), ws)

    @classmethod
    def at(
        cls,
        x: torch.Tensor,
        key: Key,
        floor: float,
        ws: Workspace | None = None,
        cap: int = 4096,
        want_sum: bool = True,
    ) -> CandidateSet:
        """All elements with ``key >= floor`` (one pass; a second only if ``cap`` was too small)."""
        ws = ws or Workspace()
        if not native.usable(x):
            return cls._everything(x, key, floor, ws)
        cap = max(1, min(x.numel(), cap))
        while True:
            cnt, idx, val, stats = _native_scan(x, key, floor, want_sum, cap, ws)
            if cnt <= cap:
                break
            cap = cnt
        return cls(x, key, floor, idx, val, keyed(val, key), stats, ws)

    def count_ge(self, t: float) -> int:
        """Exact ``#{i : key(x_i) >= t}`` over the whole tensor."""
        t = f32(t)
        if t >= self.floor:
            return count_ge(self.keys, [t], Key.POS)[0]
        return count_ge(self.x, [t], self.key)[0]

    def count_ge_many(self, thresholds: list[float]) -> list[int]:
        """:meth:`count_ge` for many thresholds: one pass over the candidates (and at most one over
        the full tensor, for the thresholds below the floor)."""
        ts = [f32(t) for t in thresholds]
        above = [t for t in ts if t >= self.floor]
        below = [t for t in ts if t < self.floor]
        counts: dict[float, int] = {}
        if above:
            counts.update(zip(above, count_ge(self.keys, above, Key.POS), strict=True))
        if below:
            counts.update(zip(below, count_ge(self.x, below, self.key), strict=True))
        return [counts[t] for t in ts]

    def restrict(self, lo: float, hi: float = math.inf) -> CandidateSet:
        """The elements with ``lo <= key < hi`` as a new set (read from the candidates when
        ``lo >= floor``, else from a new pass over the tensor)."""
        lo, hi = f32(lo), f32(hi)
        if lo < self.floor:
            # a private workspace: this set's candidates are views into self.ws
            sub = CandidateSet.at(self.x, self.key, lo, Workspace(), cap=2 * self.count + 4096)
            sub = dataclasses.replace(sub, stats=self.stats)
            return sub if hi == math.inf else sub.restrict(lo, hi)
        keep: torch.Tensor
        if native.usable(self.keys):
            pos = torch.empty(self.count, dtype=torch.int32, device=self.keys.device)
            m = native.ext().range_positions(
                native.ptr(self.keys), self.count, lo, hi, native.ptr(pos), pos.nbytes
            )
            keep = pos[:m]
        else:
            keep = (self.keys >= lo) & (self.keys < hi)
        return dataclasses.replace(
            self, floor=lo, idx=self.idx[keep], val=self.val[keep], keys=self.keys[keep]
        )

    def select(self, lo: float, hi: float = math.inf) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices and values of the elements with ``lo <= key < hi``, in index order."""
        sub = self.restrict(lo, hi)
        return sub.idx, sub.val

    def top(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` candidates with the largest keys (all if fewer), in index order.

        Ties at the k-th key are broken by lower index.
        """
        if k >= self.count:
            return self.idx, self.val
        if k <= 0:
            return self.idx[:0], self.val[:0]
        kth = kth_largest(self.keys, k, self.ws)
        if native.usable(self.val) and self.idx.dtype == torch.int32:
            idx, val = self.idx.clone(), self.val.clone()
            kept = native.ext().keep_top(
                idx.data_ptr(), val.data_ptr(), idx.numel(), k, f32(kth), int(self.key)
            )
            return idx[:kept], val[:kept]
        return keep_largest(self.idx, self.val, self.keys, k, kth)


def _native_scan(
    x: torch.Tensor,
    key: Key,
    floor: float,
    want_sum: bool,
    cap: int,
    ws: Workspace,
    addends: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[int, torch.Tensor, torch.Tensor, TensorStats]:
    """One fused pass: count, compact (up to ``cap``) and measure. Returns views into ``ws``.
    With ``addends`` the pass first computes ``x = a + b`` (see :meth:`CandidateSet.scan`)."""
    idx = ws.get("cand_idx", cap, torch.int32)
    val = ws.get("cand_val", cap, torch.float32)
    n = x.numel()
    if addends is not None:
        a, b = addends
        cnt, s, m, nf = native.ext().sum_scan_select(
            native.ptr(a), native.ptr(b), n, native.ptr(x), x.nbytes, f32(floor), int(key), want_sum,
            idx.data_ptr(), val.data_ptr(), cap,
        )  # fmt: skip
    else:
        cnt, s, m, nf = native.ext().scan_select(
            native.ptr(x), n, f32(floor), int(key), want_sum, idx.data_ptr(), val.data_ptr(), cap
        )
    kept = min(cnt, cap)
    return cnt, idx[:kept], val[:kept], TensorStats(n, s, m, nf)


# Sample sizes for the floor estimate: about n / 256 elements, at least 4096, at most 65536.
_SAMPLE_DIV, _SAMPLE_MIN, _SAMPLE_MAX = 256, 4096, 65536
_SMALLEST_POSITIVE = 1.401298464324817e-45  # float32
# Tensors up to this size are scanned with no floor at all (everything is a candidate).
_SMALL = 32768


@functools.lru_cache(maxsize=256)
def sample_stride(n: int, s: int) -> int:
    """The stride of the floor's sample of at most ``s`` of ``n`` elements: the smallest prime
    of at least ``n / s``.

    A prime keeps the sample from lining up with the tensor's rows. A power-of-two stride does:
    a 4096 x 4096 weight's gradient (VGG's classifier layer) is an outer product of the batch's
    errors and activations, so its columns differ by the activations, and a stride of 256
    through it sampled 16 of its 4096 columns. The floor then fell short of ``k`` in about half
    of the ``mstopk:density=0.01+ef`` encodes of that gradient's 16 MiB parts, and those read the
    tensor again (about 10 ms instead of 3.3; mean 6.5 ms against 3.4 with a prime stride,
    ``python scripts/floor_sample_stride.py``). A constant stride, unlike scattered positions,
    reads the sample as fast as the plain one did."""
    p = max(2, -(-n // s))
    while any(p % d == 0 for d in range(2, math.isqrt(p) + 1)):
        p += 1
    return p


def _estimate_floor(
    x: torch.Tensor,
    key: Key,
    target: int,
    ws: Workspace,
    addends: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[float, int, torch.Tensor]:
    """A threshold that about ``target`` elements reach, from a sample of keys taken with a prime
    stride (:func:`sample_stride`; of ``a + b`` with ``addends``: the same float32 sums the scan
    will compute)."""
    n = x.numel()
    empty = x.new_empty(0)
    if n <= _SMALL or target >= n:
        return -math.inf, 0, empty
    s = min(max(n // _SAMPLE_DIV, _SAMPLE_MIN), _SAMPLE_MAX)
    stride = sample_stride(n, s)
    picked = slice(stride // 2, None, stride)
    if addends is None:
        sample = x.reshape(-1)[picked]
    else:
        sample = addends[0].reshape(-1)[picked] + addends[1].reshape(-1)[picked]
    skeys = ws.get("sample_keys", sample.numel(), torch.float32)
    torch.abs(sample, out=skeys) if key == Key.ABS else (
        skeys.copy_(sample) if key == Key.POS else torch.neg(sample, out=skeys)
    )
    skeys = torch.nan_to_num(skeys, nan=-math.inf) if skeys.isnan().any() else skeys
    # The count above the sample's r-th key is about r * n / s with relative spread 1 / sqrt(r):
    # aim four spreads above the target so that falling short (and rescanning) is rare.
    r0 = target * skeys.numel() / n
    rank = max(1, math.ceil(r0 + 4 * math.sqrt(r0) + 4))
    if rank > skeys.numel():
        return -math.inf, rank, skeys
    floor = kth_largest(skeys, rank, ws)
    if key == Key.ABS and floor <= 0.0:
        # mostly exact zeros (dead units, untouched embedding rows, an already sparse tensor):
        # the non-zero elements are the natural candidates, not the whole tensor
        floor = _SMALLEST_POSITIVE
    return floor, rank, skeys


def _lower_floor(sample: torch.Tensor, rank: int, at_least: float, ws: Workspace) -> tuple[float, int]:
    rank = max(rank * 4, 1)
    if sample.numel() == 0 or rank > sample.numel():
        return at_least, rank
    return max(kth_largest(sample, rank, ws), at_least), rank


def topk(
    x: torch.Tensor, k: int, key: Key = Key.ABS, at_least: float = -math.inf, ws: Workspace | None = None
) -> tuple[torch.Tensor, torch.Tensor, TensorStats]:
    """Exact top-``k`` of ``key(x)`` (ties broken by lower index), indices in increasing order.

    Returns ``(indices, values, stats of x)``. Only elements with key >= ``at_least`` are
    eligible, so fewer than ``k`` may come back. Cost on the native path: one fused pass over
    ``x`` plus work on about ``2k`` candidates.
    """
    cand = CandidateSet.scan(x, key, target=k, minimum=k, at_least=at_least, ws=ws, want_sum=False)
    idx, val = cand.top(k)
    return idx, val, cand.stats


def dgc_sample(numel: int, k: int, sample: float) -> tuple[int, int]:
    """DGC's sampled estimate of the ``k``-th magnitude of ``numel`` elements, as sizes: how many
    positions it draws (``ceil(sample * numel)``, at least 1024, at most ``numel``) and which
    largest of their magnitudes stands for the ``k``-th of the whole (``round(k * s / numel)``,
    at least 1). One rule for the host, the device and the kernel forms."""
    s = min(numel, max(math.ceil(sample * numel), 1024))
    return s, min(s, max(1, round(k * s / numel)))


def chunk_positions(keys: torch.Tensor, chunk: int, per_chunk: int, of_tail: int) -> torch.Tensor:
    """Chunked top-k's positions: those of the ``per_chunk`` largest ``keys`` of every full
    ``chunk`` and of the ``of_tail`` largest of the shorter last one, ascending (int64). Its count
    is known before the data is seen. One rule for the host and device forms (which differ only in
    how they make ``keys`` and what they do with the positions)."""
    n = keys.numel()
    full = n // chunk
    parts = []
    if full:
        rows = keys[: full * chunk].view(full, chunk)
        top = rows.topk(per_chunk, dim=1, sorted=False).indices.sort(dim=1).values
        base = torch.arange(0, full * chunk, chunk, device=keys.device, dtype=top.dtype).unsqueeze(1)
        parts.append((top + base).view(-1))
    if of_tail:
        parts.append(keys[full * chunk :].topk(of_tail, sorted=False).indices.sort().values + full * chunk)
    if not parts:
        return torch.zeros(0, dtype=torch.int64, device=keys.device)
    return torch.cat(parts) if len(parts) > 1 else parts[0]
