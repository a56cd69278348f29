"""How busy a node's network link is: NIC byte counters sampled every few milliseconds.

The network-bottleneck paper (§2.4, figure 4) asks whether training really uses the network it is
waiting for, and answers with the NIC's throughput over time against the link rate. This module does
the same on Linux: :class:`NicSampler` reads ``/sys/class/net/<if>/statistics/{tx,rx}_bytes`` from a
daemon thread every ``interval_s`` (10 ms by default) and keeps ``(time.perf_counter(), tx, rx)``
samples in a bounded buffer. The pure functions below turn the samples into throughput:

- :func:`throughput_series`: bytes/s in each sampling interval;
- :func:`phase_throughput`: the mean throughput inside given time spans (the communication
  phases of the training steps), the peak interval, and the share of the phases' time during
  which the link ran at >= 90 % of its rate;
- :func:`plot_throughput`: a matplotlib PNG, one panel per run, with the link rate as a line and
  the phases shaded.

Direction: a full-duplex link has its rate in each direction, so :func:`phase_throughput`
measures each direction on its own and by default reports the busier one (``direction="max"``;
``"tx"`` or ``"rx"`` select one). The busier direction is chosen over the whole phases, not per
sampling interval: the larger of two noisy 10 ms readings is biased upwards (a 100 Mbit/s link
running at 95 % each way reads as 104 % that way). Counters are cumulative and include the
link-layer headers, as a shaper (``tc``) counts them. Nothing here needs a NIC: the analysis
runs on any sample list, and the sampler's sysfs root can be any directory laid out like
``/sys/class/net`` (tests use a temporary one).

This module only measures; it never imports from the apps and never talks to other ranks.

References:

- network-bottleneck paper: Zhang et al., "Is Network the Bottleneck of Distributed Training?",
  NetAI 2020, arXiv:2006.10103.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import os
import re
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Literal, NamedTuple

SYSFS_NET = "/sys/class/net"
DEFAULT_INTERVAL_S = 0.01
DEFAULT_MAX_SAMPLES = 200_000  # about 33 minutes at 10 ms, a few MB of tuples
BUSY_THRESHOLD = 0.9
# The largest chunk a NIC counter can move by at once: with segmentation offload (GSO/TSO, on
# by default, and on veth) a whole 64 KiB super-packet is counted when it is sent.
COUNTER_QUANTUM_BYTES = 65536

Direction = Literal["tx", "rx", "max"]
_DIRECTIONS = ("tx", "rx", "max")
# Linux interface names: at most 15 bytes, no '/', no whitespace (IFNAMSIZ - 1)
_IFNAME = re.compile(r"^[A-Za-z0-9_.:@-]{1,15}$")


class Sample(NamedTuple):
    """Cumulative bytes sent (``tx``) and received (``rx``) at ``t`` (``time.perf_counter()``)."""

    t: float
    tx: int
    rx: int


class Interval(NamedTuple):
    """Bytes moved between two consecutive samples, and the resulting rate."""

    t0: float
    t1: float
    nbytes: float
    bytes_per_s: float


def check_interface_name(name: str) -> str:
    """``name`` if it is a valid Linux interface name, else ``ValueError`` (it becomes a path)."""
    if not isinstance(name, str) or not _IFNAME.match(name) or name in (".", ".."):
        raise ValueError(f"not a network interface name: {name!r} (1-15 characters, no '/' or spaces)")
    return name


def _direction(direction: str) -> Direction:
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be one of {', '.join(_DIRECTIONS)}, got {direction!r}")
    return direction  # type: ignore[return-value]


def throughput_series(samples: Sequence[Sample], direction: Direction = "max") -> list[Interval]:
    """One :class:`Interval` per pair of consecutive samples. A counter that went backwards (the
    interface was reset) counts as zero bytes; intervals of zero length are skipped. ``"max"``
    takes the busier direction of each interval (an envelope for a plot; see the module's note on
    its bias)."""
    _direction(direction)
    out: list[Interval] = []
    for a, b in itertools.pairwise(samples):
        dt = b.t - a.t
        if dt <= 0:
            continue
        tx, rx = max(b.tx - a.tx, 0), max(b.rx - a.rx, 0)
        n = float(tx if direction == "tx" else rx if direction == "rx" else max(tx, rx))
        out.append(Interval(a.t, b.t, n, n / dt))
    return out


def _merged(phases: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Phases sorted, empty ones dropped, overlapping ones joined (so no time counts twice)."""
    spans = sorted((float(a), float(b)) for a, b in phases if b > a)
    out: list[tuple[float, float]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


@dataclass(frozen=True)
class PhaseThroughput:
    """What the link did during a set of phases, in one direction (``direction``: ``"tx"`` or
    ``"rx"``; after ``direction="max"`` the one that moved more bytes, while each figure is the
    larger of the two directions').

    ``seconds``: the phases' total length; ``covered_s``: the part of it the samples cover;
    ``nbytes``: bytes moved in the covered part, each interval's bytes spread evenly over it (an
    interval half inside a phase contributes half its bytes); ``peak_bytes_per_s``: the fastest
    interval (or window of ``window_s``) that overlaps a phase, never below the mean;
    ``busy_s``: covered time during which that interval's (window's) rate was at least
    ``busy_threshold`` times the link rate (0 when the rate is unknown).
    """

    seconds: float
    covered_s: float
    nbytes: float
    peak_bytes_per_s: float
    busy_s: float
    link_bytes_per_s: float | None
    busy_threshold: float = BUSY_THRESHOLD
    direction: str = "tx"
    window_s: float | None = None

    @property
    def mean_bytes_per_s(self) -> float:
        return self.nbytes / self.covered_s if self.covered_s > 0 else 0.0

    def _share(self, v: float) -> float | None:
        return v / self.link_bytes_per_s if self.link_bytes_per_s else None

    @property
    def mean_share(self) -> float | None:
        """Mean throughput over the phases as a fraction of the link rate (None: rate unknown)."""
        return self._share(self.mean_bytes_per_s)

    @property
    def peak_share(self) -> float | None:
        return self._share(self.peak_bytes_per_s)

    @property
    def busy_share(self) -> float | None:
        """Fraction of the covered phase time with the link >= ``busy_threshold`` of its rate."""
        if not self.link_bytes_per_s:
            return None
        return self.busy_s / self.covered_s if self.covered_s > 0 else 0.0


def peak_window_s(link_bytes_per_s: float | None, interval_s: float, resolution: float = 0.1) -> float:
    """The shortest window over which a throughput reading is good to ``resolution`` of the
    link rate, given that counters move by up to :data:`COUNTER_QUANTUM_BYTES` at once (and at
    least one sampling interval). At 100 Mbit/s a 64 KiB packet is 5.2 ms of the link, so a 10 ms
    reading is 0, 52, 105 or 157 % by chance of where packets fall: this gives 52 ms there, and
    10 ms at 1 Gbit/s and above."""
    if not link_bytes_per_s:
        return interval_s
    return max(interval_s, COUNTER_QUANTUM_BYTES / resolution / link_bytes_per_s)


def coarsen(series: Sequence[Interval], window_s: float) -> list[Interval]:
    """Consecutive intervals joined into windows of at least ``window_s`` (the last may be
    shorter; a gap between intervals, which :func:`throughput_series` never leaves, starts a
    new window)."""
    out: list[Interval] = []
    start: Interval | None = None
    t1 = nbytes = 0.0
    for iv in series:
        if start is not None and iv.t0 != t1:
            out.append(Interval(start.t0, t1, nbytes, nbytes / (t1 - start.t0)))
            start = None
        if start is None:
            start, nbytes = iv, 0.0
        t1, nbytes = iv.t1, nbytes + iv.nbytes
        if t1 - start.t0 >= window_s:
            out.append(Interval(start.t0, t1, nbytes, nbytes / (t1 - start.t0)))
            start = None
    if start is not None:
        out.append(Interval(start.t0, t1, nbytes, nbytes / (t1 - start.t0)))
    return out


def _in_phases(
    series: list[Interval], spans: list[tuple[float, float]], link: float | None, busy_threshold: float
) -> tuple[float, float, float, float]:
    """(covered s, bytes, peak bytes/s, busy s) of ``series`` inside the merged ``spans``."""
    covered = nbytes = busy = peak = 0.0
    i = 0
    for a, b in spans:
        while i < len(series) and series[i].t1 <= a:  # both lists are sorted: one sweep
            i += 1
        j = i
        while j < len(series) and series[j].t0 < b:
            iv = series[j]
            overlap = min(b, iv.t1) - max(a, iv.t0)
            if overlap > 0:
                covered += overlap
                nbytes += iv.bytes_per_s * overlap
                peak = max(peak, iv.bytes_per_s)
                if link and iv.bytes_per_s >= busy_threshold * link:
                    busy += overlap
            j += 1
    return covered, nbytes, peak, busy


def phase_throughput(
    samples: Sequence[Sample],
    phases: Iterable[tuple[float, float]],
    link_bytes_per_s: float | None = None,
    direction: Direction = "max",
    busy_threshold: float = BUSY_THRESHOLD,
    window_s: float | None = None,
) -> PhaseThroughput:
    """Throughput of the link inside ``phases`` (``(t0, t1)`` spans on the samples' clock).

    Within one sampling interval the rate is taken as constant, which is all the counters say;
    with 10 ms samples a phase's edges are therefore uncertain by about one interval, so phases
    much shorter than a few intervals give rough figures. ``direction="max"`` measures sent and
    received bytes separately and reports, figure by figure, the larger (the busier direction).
    ``window_s``: the peak and the busy time are read over windows of at least this length
    (consecutive sampling intervals joined; see :func:`peak_window_s`); by default over each
    sampling interval. The mean does not depend on it.
    """
    if link_bytes_per_s is not None and not (math.isfinite(link_bytes_per_s) and link_bytes_per_s > 0):
        raise ValueError(f"link_bytes_per_s must be a positive number, got {link_bytes_per_s!r}")
    if not 0 < busy_threshold <= 1:
        raise ValueError(f"busy_threshold must be in (0, 1], got {busy_threshold!r}")
    _direction(direction)
    spans = _merged(phases)
    seconds = sum(b - a for a, b in spans)
    ways: tuple[Direction, ...] = ("tx", "rx") if direction == "max" else (direction,)
    if window_s is not None and not (math.isfinite(window_s) and window_s >= 0):
        raise ValueError(f"window_s must be a non-negative number of seconds, got {window_s!r}")
    fine = {w: throughput_series(samples, w) for w in ways}
    got = {w: _in_phases(fine[w], spans, link_bytes_per_s, busy_threshold) for w in ways}
    if window_s:
        coarse = {
            w: _in_phases(coarsen(fine[w], window_s), spans, link_bytes_per_s, busy_threshold) for w in ways
        }
        got = {w: (got[w][0], got[w][1], coarse[w][2], coarse[w][3]) for w in ways}
    busier = max(ways, key=lambda w: got[w][1])
    covered = got[busier][0]
    nbytes, peak, busy = (max(g[k] for g in got.values()) for k in (1, 2, 3))
    if covered > 0:  # a window straddling a short phase's edge averages in the time outside it,
        peak = max(peak, nbytes / covered)  # which can read below the phases' own mean
    return PhaseThroughput(
        seconds, covered, nbytes, peak, busy, link_bytes_per_s, busy_threshold, busier, window_s
    )


def link_speed_bytes_per_s(interface: str, sysfs_root: str = SYSFS_NET) -> float | None:
    """The rate the driver reports for ``interface`` (``speed``, Mbit/s), in bytes/s; None where
    it reports none (virtual interfaces often say -1, or report a nominal 10 Gbit/s that a
    shaper in front of them does not deliver: pass the shaped rate explicitly there)."""
    path = os.path.join(sysfs_root, check_interface_name(interface), "speed")
    try:
        with open(path) as fh:
            mbit = int(fh.read().strip())
    except (OSError, ValueError):
        return None
    return mbit * 1e6 / 8 if mbit > 0 else None


class NicSampler:
    """Samples the byte counters of network interfaces from a daemon thread.

    ``interfaces``: names under ``sysfs_root`` (their counters are summed); by default the ones
    in ``GLOO_SOCKET_IFNAME`` (comma-separated), the interfaces gloo sends on. Loopback is
    refused unless ``allow_loopback``: its traffic never leaves the machine, so a "link rate"
    means nothing for it. Where no interface is named or its counters cannot be read the sampler
    is a no-op: :attr:`available` is False, :attr:`reason` says why, and :meth:`start` and
    :meth:`stop` do nothing, so callers need no special case.

    At most ``max_samples`` samples are kept (the oldest are dropped, counted in
    :attr:`dropped`). Each sample costs two ``pread`` calls on already open files, about a
    microsecond each on Linux, and the thread holds the GIL only for that.
    """

    def __init__(
        self,
        interfaces: Sequence[str] | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        sysfs_root: str = SYSFS_NET,
        max_samples: int = DEFAULT_MAX_SAMPLES,
        allow_loopback: bool = False,
    ) -> None:
        if not (math.isfinite(interval_s) and 0.0005 <= interval_s <= 10.0):
            raise ValueError(f"interval_s must be from 0.0005 to 10 seconds, got {interval_s!r}")
        if max_samples < 2:
            raise ValueError(f"max_samples must be at least 2, got {max_samples!r}")
        self.interval_s = float(interval_s)
        self.sysfs_root = sysfs_root
        self.dropped = 0
        self.reason: str | None = None
        self._samples: collections.deque[Sample] = collections.deque(maxlen=max_samples)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fds: list[tuple[int, int]] = []  # (tx fd, rx fd) per interface
        if interfaces is None:
            env = os.environ.get("GLOO_SOCKET_IFNAME", "")
            interfaces = [s.strip() for s in env.split(",") if s.strip()]
            if not interfaces:
                self.reason = "no interface given and GLOO_SOCKET_IFNAME is not set"
        self.interfaces = [check_interface_name(i) for i in interfaces]
        if self.reason is None and not self.interfaces:
            self.reason = "no interface given"
        if self.reason is None and not allow_loopback and "lo" in self.interfaces:
            self.reason = "loopback (lo) is not a network link: its traffic never leaves the machine"
        if self.reason is None:
            self.reason = self._open()

    def _open(self) -> str | None:
        """Open every counter file once (the thread re-reads them with ``pread``); the reason
        when one cannot be opened or does not hold a number."""
        for name in self.interfaces:
            pair: list[int] = []
            for what in ("tx_bytes", "rx_bytes"):
                path = os.path.join(self.sysfs_root, name, "statistics", what)
                try:
                    fd = os.open(path, os.O_RDONLY)
                except OSError as e:
                    self._close(pair)
                    return f"cannot read {path}: {e.strerror}"
                pair.append(fd)
                try:
                    int(os.pread(fd, 32, 0))
                except (OSError, ValueError) as e:
                    self._close(pair)
                    return f"cannot read {path}: {e}"
            self._fds.append((pair[0], pair[1]))
        return None

    def _close(self, extra: Sequence[int] = ()) -> None:
        for fd in [*extra, *(fd for pair in self._fds for fd in pair)]:
            os.close(fd)
        self._fds = []

    @property
    def available(self) -> bool:
        return self.reason is None

    def read(self) -> Sample:
        """One sample now (``RuntimeError`` when the sampler is not available)."""
        if not self._fds:
            raise RuntimeError(f"NIC sampler not available: {self.reason or 'closed'}")
        t_before = time.perf_counter()
        tx = rx = 0
        for ftx, frx in self._fds:
            tx += int(os.pread(ftx, 32, 0))
            rx += int(os.pread(frx, 32, 0))
        return Sample((t_before + time.perf_counter()) / 2, tx, rx)

    def _append(self, s: Sample) -> None:
        with self._lock:
            if len(self._samples) == self._samples.maxlen:
                self.dropped += 1
            self._samples.append(s)

    def _run(self) -> None:
        next_t = time.perf_counter()
        while not self._stop.is_set():
            try:
                self._append(self.read())
            except ValueError:  # a counter caught mid-update (not on sysfs): skip this sample
                pass
            except OSError as e:  # the interface went away
                self.reason = f"stopped: {e}"
                return
            # keep the cadence, but after a late wake-up (a busy machine) wait at least half an
            # interval: a sliver of an interval holds one packet or none and reads as noise
            now = time.perf_counter()
            next_t = max(next_t + self.interval_s, now + self.interval_s / 2)
            self._stop.wait(next_t - now)

    def start(self) -> NicSampler:
        """Start sampling (a no-op when not available or already running)."""
        if not self.available or self._thread is not None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="gradsync-nic-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> list[Sample]:
        """Stop sampling, take one last sample, and return every sample kept."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            if self._fds:
                with contextlib.suppress(OSError, ValueError):
                    self._append(self.read())
        return self.samples()

    def samples(self) -> list[Sample]:
        with self._lock:
            return list(self._samples)

    def clear(self) -> None:
        with self._lock:
            self._samples.clear()
            self.dropped = 0

    def close(self) -> None:
        """Stop and release the counter files."""
        self.stop()
        self._close()

    def __enter__(self) -> NicSampler:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __del__(self) -> None:  # the counter files, if close() was never called
        if getattr(self, "_thread", None) is None and getattr(self, "_fds", None):
            self._close()


@dataclass
class Panel:
    """One panel of :func:`plot_throughput`: a run's samples and its phases."""

    title: str
    samples: Sequence[Sample]
    phases: Sequence[tuple[float, float]] = ()


def plot_throughput(
    panels: Sequence[Panel],
    path: str,
    link_bytes_per_s: float | None = None,
    *,
    title: str | None = None,
    window_s: float | None = None,
) -> None:
    """Throughput over time (MB/s, 1 MB = 10^6 bytes) as a PNG, one panel per run, sent and
    received bytes as two lines: time from the panel's first phase (or first sample), the link
    rate as a dashed line, phases shaded. ``window_s``: plot throughput over windows of at
    least this length (see :func:`peak_window_s`) instead of each sampling interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not panels:
        raise ValueError("plot_throughput needs at least one panel")
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.2 * len(panels) + 0.8), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels, strict=True):
        starts = [a for a, _ in panel.phases] + ([panel.samples[0].t] if panel.samples else [])
        origin = min(starts) if starts else 0.0
        for a, b in panel.phases:
            ax.axvspan(a - origin, b - origin, color="#ffd27f", alpha=0.45, lw=0)
        if len(panel.samples) > 1:
            lines: tuple[tuple[Direction, str, float], ...] = (("tx", "#1f77b4", 0.9), ("rx", "#2ca02c", 0.6))
            for way, color, width in lines:
                series = throughput_series(panel.samples, way)
                if window_s:
                    series = coarsen(series, window_s)
                xs = [x for iv in series for x in (iv.t0 - origin, iv.t1 - origin)]
                ys = [iv.bytes_per_s / 1e6 for iv in series for _ in (0, 1)]
                ax.plot(
                    xs, ys, color=color, lw=width, label=f"{way} (sent)" if way == "tx" else "rx (received)"
                )
            ax.legend(loc="upper right", fontsize=7, ncol=2, frameon=False)
        else:
            ax.text(0.5, 0.5, "no samples", transform=ax.transAxes, ha="center", va="center")
        if link_bytes_per_s:
            ax.axhline(link_bytes_per_s / 1e6, color="#d62728", ls="--", lw=1)
            ax.set_ylim(0, 1.35 * link_bytes_per_s / 1e6)
        ax.set_title(panel.title, fontsize=9, loc="left")
        ax.set_ylabel("MB/s")
    per = f"{window_s * 1e3:.0f} ms windows" if window_s else "per sampling interval"
    axes[-1, 0].set_xlabel(f"seconds (throughput {per}; shaded: communication phases; dashed: link rate)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
