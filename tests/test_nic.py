"""NIC sampling and network utilization (gradsync.observe.nic, ``bench step/train --nic``).

The analysis runs on counter series written out here, with the throughputs worked out by hand;
the sampler reads a fake sysfs directory (and loopback, where there is one); the benchmarks'
``--nic`` path runs on 2 ranks over loopback with each rank's fake NIC counting at a known rate.
Nothing here needs the emulated cluster."""

import itertools
import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from gradsync.apps.commands import main
from gradsync.observe.nic import (
    NicSampler,
    Panel,
    Sample,
    check_interface_name,
    coarsen,
    link_speed_bytes_per_s,
    peak_window_s,
    phase_throughput,
    plot_throughput,
    throughput_series,
)
from worlds import run_world

pytestmark = pytest.mark.timeout(120)

# t (s), tx, rx: 10 kB out in each of the first two 10 ms, then 25 kB in, then 20 ms of silence
SERIES = [
    Sample(0.00, 0, 0),
    Sample(0.01, 10_000, 0),
    Sample(0.02, 20_000, 5_000),
    Sample(0.03, 20_000, 30_000),
    Sample(0.05, 20_000, 30_000),
]


def rates(series, direction):
    """The intervals flattened (t0, t1, bytes/s, t0, ...) so pytest.approx compares them."""
    return [x for iv in throughput_series(series, direction) for x in (iv.t0, iv.t1, iv.bytes_per_s)]


def flat(*intervals):
    return pytest.approx([x for iv in intervals for x in iv])


def test_throughput_series_per_direction():
    assert rates(SERIES, "tx") == flat((0, 0.01, 1e6), (0.01, 0.02, 1e6), (0.02, 0.03, 0), (0.03, 0.05, 0))
    assert rates(SERIES, "rx") == flat((0, 0.01, 0), (0.01, 0.02, 5e5), (0.02, 0.03, 2.5e6), (0.03, 0.05, 0))
    # max: the busier direction of each interval (a full-duplex link has its rate both ways)
    assert rates(SERIES, "max") == flat(
        (0, 0.01, 1e6), (0.01, 0.02, 1e6), (0.02, 0.03, 2.5e6), (0.03, 0.05, 0)
    )
    assert [iv.nbytes for iv in throughput_series(SERIES)] == [10_000, 10_000, 25_000, 0]


def test_throughput_series_skips_empty_intervals_and_counter_resets():
    series = [Sample(1.0, 100, 0), Sample(1.0, 200, 0), Sample(1.5, 50, 0), Sample(2.0, 550, 0)]
    # the zero-length pair is skipped; 200 -> 50 (a reset) counts as nothing; then 500 B in 0.5 s
    assert rates(series, "tx") == flat((1.0, 1.5, 0.0), (1.5, 2.0, 1000.0))
    assert throughput_series([]) == [] and throughput_series(SERIES[:1]) == []
    with pytest.raises(ValueError, match="direction must be one of tx, rx, max"):
        throughput_series(SERIES, "both")  # type: ignore[arg-type]


def test_phase_throughput_by_hand():
    # phase 5..25 ms, link 2 MB/s. Sent: half of interval 1 (5 kB) + all of interval 2 (10 kB) +
    # nothing = 15 kB; received: 0 + 5 kB + half of interval 3 (12.5 kB) = 17.5 kB
    tx = phase_throughput(SERIES, [(0.005, 0.025)], link_bytes_per_s=2e6, direction="tx")
    assert tx.seconds == pytest.approx(0.02) and tx.covered_s == pytest.approx(0.02)
    assert tx.nbytes == pytest.approx(15_000) and tx.mean_bytes_per_s == pytest.approx(0.75e6)
    assert tx.mean_share == pytest.approx(0.375)
    assert tx.peak_bytes_per_s == pytest.approx(1e6) and tx.busy_s == 0 and tx.busy_share == 0
    rx = phase_throughput(SERIES, [(0.005, 0.025)], link_bytes_per_s=2e6, direction="rx")
    assert rx.nbytes == pytest.approx(17_500) and rx.mean_share == pytest.approx(0.4375)
    assert rx.peak_bytes_per_s == pytest.approx(2.5e6) and rx.peak_share == pytest.approx(1.25)
    # >= 90 % of 2 MB/s (1.8 MB/s): only interval 3's 5 ms of the 20 ms
    assert rx.busy_s == pytest.approx(0.005) and rx.busy_share == pytest.approx(0.25)
    # the default: the busier direction (received here), figure by figure
    got = phase_throughput(SERIES, [(0.005, 0.025)], link_bytes_per_s=2e6)
    assert got.direction == "rx"
    assert (got.nbytes, got.peak_bytes_per_s, got.busy_s) == pytest.approx((17_500, 2.5e6, 0.005))
    assert got.mean_share == pytest.approx(0.4375) and got.busy_share == pytest.approx(0.25)


def test_busier_direction_is_chosen_over_the_phases_not_per_interval():
    # 10 kB out in the first 10 ms, 10 kB in during the next: each direction ran at 0.5 MB/s
    # over the 20 ms; the larger of each interval's two readings would claim 1 MB/s
    series = [Sample(0.0, 0, 0), Sample(0.01, 10_000, 0), Sample(0.02, 10_000, 10_000)]
    got = phase_throughput(series, [(0.0, 0.02)], link_bytes_per_s=1e6)
    assert got.mean_bytes_per_s == pytest.approx(0.5e6) and got.mean_share == pytest.approx(0.5)
    assert sum(iv.nbytes for iv in throughput_series(series, "max")) == 20_000  # the biased envelope
    # each direction was at the full rate half of the time
    assert got.peak_share == pytest.approx(1.0) and got.busy_share == pytest.approx(0.5)


def test_peak_and_busy_over_windows():
    # 64 kB packets counted whole: 0, 1, 2, 0, 1, 2 packets per 10 ms on a 6.4 MB/s link (one
    # packet per 10 ms is 100 %): per interval the peak reads 200 %, over 30 ms windows 100 %
    t, n, series = 0.0, 0, [Sample(0.0, 0, 0)]
    for packets in (0, 1, 2, 0, 1, 2):
        t, n = t + 0.01, n + 64_000 * packets
        series.append(Sample(t, n, 0))
    fine = phase_throughput(series, [(0.0, 0.06)], link_bytes_per_s=6.4e6, direction="tx")
    assert fine.peak_share == pytest.approx(2.0) and fine.busy_share == pytest.approx(4 / 6)
    wide = phase_throughput(series, [(0.0, 0.06)], link_bytes_per_s=6.4e6, direction="tx", window_s=0.03)
    assert wide.peak_share == pytest.approx(1.0) and wide.busy_share == pytest.approx(1.0)
    assert wide.mean_share == fine.mean_share == pytest.approx(1.0)  # the mean does not depend on it
    windows = coarsen(throughput_series(series, "tx"), 0.025)
    assert [x for w in windows for x in (w.t0, w.t1, w.nbytes)] == flat(
        (0, 0.03, 192_000), (0.03, 0.06, 192_000)
    )
    assert len(coarsen(throughput_series(series, "tx"), 0.04)) == 2  # 40 ms, then the 20 ms left
    # 64 KiB at 10 % resolution: 52.4 ms at 100 Mbit/s, the 10 ms interval at 1 Gbit/s
    assert peak_window_s(12.5e6, 0.01) == pytest.approx(0.0524288)
    assert peak_window_s(125e6, 0.01) == 0.01 and peak_window_s(None, 0.01) == 0.01
    with pytest.raises(ValueError, match="window_s must be a non-negative number"):
        phase_throughput(series, [(0, 1)], window_s=float("nan"))


def test_the_peak_is_never_below_the_mean_of_a_short_phase():
    """A 10 ms phase at 2 MB/s inside idle time: the 30 ms window around it averages in the idle
    20 ms (0.67 MB/s), but the peak reads at least the phase's own mean."""
    series = [Sample(0.0, 0, 0), Sample(0.01, 0, 0), Sample(0.02, 20_000, 0), Sample(0.03, 20_000, 0)]
    got = phase_throughput(series, [(0.01, 0.02)], link_bytes_per_s=2e6, direction="tx", window_s=0.03)
    assert got.mean_share == pytest.approx(1.0)
    assert got.peak_share == pytest.approx(1.0)


def test_phase_throughput_merges_phases_and_reports_uncovered_time():
    # two phases that overlap count their common time once: 0..20 ms, 20 kB, 1 MB/s
    got = phase_throughput(SERIES, [(0.0, 0.015), (0.01, 0.02)], link_bytes_per_s=1e6, direction="tx")
    assert got.seconds == pytest.approx(0.02) and got.nbytes == pytest.approx(20_000)
    assert got.mean_share == pytest.approx(1.0) and got.busy_share == pytest.approx(1.0)
    # separate phases, one reaching past the last sample: 40..60 ms covers only 40..50 ms
    got = phase_throughput(SERIES, [(0.02, 0.03), (0.04, 0.06)], link_bytes_per_s=2.5e6, direction="rx")
    assert got.seconds == pytest.approx(0.03) and got.covered_s == pytest.approx(0.02)
    assert got.nbytes == pytest.approx(25_000) and got.mean_bytes_per_s == pytest.approx(1.25e6)
    assert got.mean_share == pytest.approx(0.5) and got.busy_share == pytest.approx(0.5)
    # unknown link rate: bytes and rates, no shares; no phases: zeros
    got = phase_throughput(SERIES, [(0.0, 0.05)])
    assert got.mean_bytes_per_s == pytest.approx(30_000 / 0.05)  # received 30 kB, sent 20 kB
    assert got.mean_share is None and got.peak_share is None and got.busy_share is None
    none = phase_throughput(SERIES, [], link_bytes_per_s=1e6)
    assert (none.seconds, none.nbytes, none.mean_bytes_per_s, none.busy_share) == (0, 0, 0, 0)


def test_phase_throughput_refuses_bad_arguments():
    with pytest.raises(ValueError, match="link_bytes_per_s must be a positive number"):
        phase_throughput(SERIES, [(0, 1)], link_bytes_per_s=0)
    with pytest.raises(ValueError, match="busy_threshold must be in"):
        phase_throughput(SERIES, [(0, 1)], link_bytes_per_s=1.0, busy_threshold=1.5)


def fake_nic(root, name="fake0", speed=None):
    """A directory laid out like /sys/class/net/<name>; returns a writer of both counters
    (fixed width, written in place, so a reader never sees a half-written number)."""
    stats = Path(root, name, "statistics")
    stats.mkdir(parents=True)
    fds = []
    for what in ("tx_bytes", "rx_bytes"):
        (stats / what).write_text(f"{0:020d}\n")
        fds.append(os.open(stats / what, os.O_WRONLY))
    if speed is not None:
        Path(root, name, "speed").write_text(f"{speed}\n")

    def write(tx, rx):
        os.pwrite(fds[0], f"{tx:020d}\n".encode(), 0)
        os.pwrite(fds[1], f"{rx:020d}\n".encode(), 0)

    return write


def test_sampler_reads_a_fake_sysfs(tmp_path):
    write = fake_nic(tmp_path)
    s = NicSampler(["fake0"], 0.002, sysfs_root=str(tmp_path))
    assert s.available and s.reason is None
    a = s.read()
    write(1_000, 300)
    b = s.read()
    assert (b.tx - a.tx, b.rx - a.rx) == (1_000, 300) and b.t > a.t
    with s:  # the thread: counters grow while it samples
        for i in range(1, 11):
            write(1_000 + 500 * i, 300 + 100 * i)
            time.sleep(0.004)
    got = s.samples()
    assert len(got) >= 5
    assert all(x.t < y.t for x, y in itertools.pairwise(got))  # monotone timestamps
    assert got[-1].tx == 6_000 and got[-1].rx == 1_300  # stop() took a last sample
    series = throughput_series(got, "tx")
    assert sum(iv.nbytes for iv in series) == got[-1].tx - got[0].tx
    s.close()


def test_sampler_sums_interfaces_and_bounds_its_memory(tmp_path):
    w0, w1 = fake_nic(tmp_path, "fake0"), fake_nic(tmp_path, "fake1")
    w0(10, 1)
    w1(20, 2)
    s = NicSampler(["fake0", "fake1"], 0.001, sysfs_root=str(tmp_path), max_samples=3)
    assert s.read()[1:] == (30, 3)
    with s:
        time.sleep(0.05)
    assert len(s.samples()) == 3 and s.dropped > 0  # the oldest went
    s.clear()
    assert s.samples() == [] and s.dropped == 0
    s.close()


def test_sampler_is_a_no_op_with_a_reason(tmp_path, monkeypatch):
    missing = NicSampler(["nope0"], sysfs_root=str(tmp_path))
    assert not missing.available and "cannot read" in (missing.reason or "")
    assert "nope0/statistics/tx_bytes" in (missing.reason or "")
    with missing:
        pass
    assert missing.stop() == [] and missing._thread is None
    with pytest.raises(RuntimeError, match="NIC sampler not available: cannot read"):
        missing.read()
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert NicSampler().reason == "no interface given and GLOO_SOCKET_IFNAME is not set"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    assert "loopback (lo) is not a network link" in (NicSampler().reason or "")
    # a sysfs root that does not exist at all (no /sys: a container, another OS)
    assert not NicSampler(["eth0"], sysfs_root=str(tmp_path / "nosys")).available


def test_sampler_refuses_bad_arguments():
    for bad in ("../etc", "a/b", "", "x" * 16, "two words", ".."):
        with pytest.raises(ValueError, match="not a network interface name"):
            check_interface_name(bad)
    with pytest.raises(ValueError, match="interval_s must be"):
        NicSampler(["lo"], 0.0)
    with pytest.raises(ValueError, match="max_samples must be at least 2"):
        NicSampler(["lo"], max_samples=1)


@pytest.mark.skipif(not os.path.exists("/sys/class/net/lo/statistics/tx_bytes"), reason="no Linux sysfs")
def test_sampler_on_loopback():
    s = NicSampler(["lo"], 0.005, allow_loopback=True)
    assert s.available
    with s:
        time.sleep(0.06)
    got = s.samples()
    s.close()
    assert len(got) >= 4
    assert all(x.t < y.t and x.tx <= y.tx and x.rx <= y.rx for x, y in itertools.pairwise(got))


def test_link_speed_from_the_driver(tmp_path):
    fake_nic(tmp_path, "fast0", speed=1000)
    fake_nic(tmp_path, "virt0", speed=-1)
    assert link_speed_bytes_per_s("fast0", str(tmp_path)) == pytest.approx(125e6)
    assert link_speed_bytes_per_s("virt0", str(tmp_path)) is None
    assert link_speed_bytes_per_s("nope0", str(tmp_path)) is None


def test_plot_throughput_writes_a_png(tmp_path):
    path = tmp_path / "nic.png"
    plot_throughput(
        [Panel("ddp", SERIES, [(0.005, 0.025)]), Panel("empty", [], [])], str(path), 2e6, title="t"
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="at least one panel"):
        plot_throughput([], str(path))


@pytest.mark.parametrize("command", ["step", "train"])
@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--nic-interval-ms", "0"], "--nic-interval-ms must be from 1 to 1000"),
        (["--nic-interval-ms", "nan"], "--nic-interval-ms must be from 1 to 1000"),
        (["--nic-if", "../etc"], "--nic-if: not a network interface name: '../etc'"),
        (["--nic-if", ","], "--nic-if must name at least one interface"),
        (["--nic-rate", "fast"], "--nic-rate must be a positive rate like 25gbit, 100mbit or 12GB/s"),
        (["--nic-png", "/nonexistent-dir/x.png"], "--nic-png: the folder '/nonexistent-dir' does not exist"),
        (["--nic-png", "nic.svg"], "--nic-png must end in .png"),
        (["--nic-plot-steps", "0"], "--nic-plot-steps must be at least 1"),
        (["--nic-window-ms", "5"], "--nic-window-ms must be from --nic-interval-ms (10) to 10000"),
        (["--nic-sysfs", "/nonexistent-dir"], "--nic-sysfs: '/nonexistent-dir' is not a directory"),
    ],
)
def test_bad_nic_options_are_usage_errors(command, options, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["bench", command, "--nic", *options]) == 2
    assert message in capsys.readouterr().err


RATE = 1e6  # bytes/s each fake NIC counts, both ways; --nic-rate 8mbit is the same


def nic_bench(tmp):
    """``bench step --nic`` on two single-rank "nodes", each reading its own fake NIC whose
    counters grow at RATE while the benchmark runs (so the link is ~100 % busy all the time)."""
    rank = dist.get_rank()
    root = os.path.join(tmp, f"sys{rank}")
    write, stop = fake_nic(root), threading.Event()
    t_start = time.perf_counter()

    def count():  # the counters follow the clock, whatever the scheduler does to this thread
        while not stop.wait(0.002):
            n = int(RATE * (time.perf_counter() - t_start))
            write(n, n // 2)

    writer = threading.Thread(target=count, daemon=True)
    writer.start()
    sj, sm, png = (os.path.join(tmp, f"s.{ext}") for ext in ("json", "md", "png"))
    argv = ["bench", "step", "--model", "vgg-small", "--batch-size", "4", "--contenders", "local,ddp,none",
            "--warmup", "1", "--steps", "2", "--nodes", "2", "--per-node", "1", "--nic-if", "fake0",
            "--nic-sysfs", root, "--nic-rate", "8mbit", "--nic-png", png, "--nic-interval-ms", "5",
            "--nic-window-ms", "5", "--json", sj, "--markdown", sm]  # fmt: skip
    try:
        assert main(argv) == 0
    finally:
        stop.set()
        writer.join()
    if rank != 0:
        return
    s = json.loads(Path(sj).read_text())
    assert s["nic"]["link_bytes_per_s"] == pytest.approx(RATE)
    assert s["nic"]["link_source"] == "--nic-rate 8mbit" and s["nic"]["interfaces"] == ["fake0"]
    for r in s["rows"]:
        assert 60 <= r["nic_link_pct"] <= 140, r  # ~100 %, give or take the scheduling of 2 cores
        assert r["nic_mb_per_s"] == pytest.approx(r["nic_link_pct"] / 100 * RATE / 1e6)
        assert r["nic_peak_pct"] >= r["nic_link_pct"] * 0.99 and 0 <= r["nic_busy_pct"] <= 100, r
        nic = s["details"][r["contender"]]["nic"]
        assert [n["node"] for n in nic["nodes"]] == [0, 1]
        mean = sum(n["link_pct"] for n in nic["nodes"]) / 2
        assert r["nic_link_pct"] == pytest.approx(mean)
        plot = nic["plot"]
        assert len(plot["phases"]) == 2 and all(a < b for a, b in plot["phases"])
        assert all(x[0] < y[0] for x, y in zip(plot["samples"], plot["samples"][1:], strict=False))
    lines = Path(sm).read_text().splitlines()
    assert "% of link" in lines[0] and len(lines) == 2 + len(s["rows"])
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_step_nic_on_two_ranks(tmp_path):
    run_world(2, nic_bench, str(tmp_path))
