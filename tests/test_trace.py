"""The timeline (``trace=``, ``gradsync trace``) and the per-step telemetry.

A 2-rank world traces real steps; the trace is checked against the trace-event format's rules
(JSON level and our own checker, whose rules are tested on hand-made bad traces below), against
the model's own bucket sizes (bytes written out as formulas here), and for clock alignment with
one rank's clock moved a thousand seconds ahead."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.apps.commands import main as cli
from gradsync.collectives import Topology
from gradsync.observe.telemetry import format_line, step_record
from gradsync.observe.trace_events import rank_file
from gradsync.observe.trace_read import check_trace, load_trace, merge_traces
from worlds import expect_all, named_check, run_checks, run_world

# the engine's step check: ten int64 words (step, forward, backward and frozen counts as max/min
# pairs, the wait, the missed flag; gradsync.sync.sequence)
STEP_CHECK_BYTES = 10 * 8

STEPS = 6
WINDOW = (2, 5)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 96), nn.ReLU(), nn.Linear(96, 10)
    )


def _train(model: nn.Module, steps: int) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x = torch.randn(16, 3, 8, 8, generator=g)
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 10, (16,), generator=g))
        loss.backward()
        opt.step()
        opt.zero_grad()


def _events(doc: dict[str, Any], pid: int, ph: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        e
        for e in doc["traceEvents"]
        if e.get("pid") == pid and e["ph"] == ph and (name is None or e["name"].startswith(name))
    ]


def traced_dense(tmp: str) -> None:
    """Dense all-reduce, 2 buckets: every traced step has, per rank and bucket, a ready
    instant, an async slice, a flow pack -> all_reduce -> decode with the bytes of a ring
    all-reduce of that bucket; clocks aligned although rank 1's runs 1000 s ahead."""
    path = Path(tmp) / "dense.json"
    if dist.get_rank() == 1:  # a clock far from rank 0's: alignment must undo it
        real = time.perf_counter
        time.perf_counter = lambda: real() + 1000.0  # type: ignore[assignment]
    try:
        model = gradsync.wrap(_model(), "flat", bucket_bytes=20_000, trace=path, trace_steps=WINDOW)
        _train(model, STEPS)
        stats = model.last_stats
        assert stats is not None
        bucket_bytes = {b.index: b.raw_bytes for b in stats.bucket_stats}
        model.close()  # writes the trace (collective)
    finally:
        if dist.get_rank() == 1:
            time.perf_counter = real
    with expect_all() as expect:
        with expect("every rank wrote its own file"):
            assert rank_file(path, dist.get_rank()).is_file()
        if dist.get_rank() != 0:
            return
        doc = json.loads(path.read_text())
        with expect("JSON object format: traceEvents, displayTimeUnit, otherData with the format"):
            assert isinstance(doc["traceEvents"], list) and doc["displayTimeUnit"] == "ms"
            assert doc["otherData"]["format"] == "gradsync.trace/1" and doc["otherData"]["ranks"] == [0, 1]
            assert doc["otherData"]["steps"] == WINDOW[1] - WINDOW[0]
        with expect("every event has a phase, an integer pid and numeric times"):
            for e in doc["traceEvents"]:
                assert isinstance(e["ph"], str) and isinstance(e["pid"], int)
                assert e["ph"] == "M" or isinstance(e["ts"], (int, float))
        with expect("the format's rules hold"):
            assert check_trace(doc) == []
        with expect("one process per rank, named, with its three threads"):
            names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
            assert names == {0: "rank 0 (node 0)", 1: "rank 1 (node 0)"}
            threads = {
                (e["pid"], e["args"]["name"]) for e in doc["traceEvents"] if e["name"] == "thread_name"
            }
            assert {n for p, n in threads if p == 1} == {
                "training thread",
                "compute thread",
                "communication thread",
            }
        p = 2
        for pid in (0, 1):
            for step in range(*WINDOW):
                for b, nbytes in bucket_bytes.items():

                    def mine(e: dict[str, Any], step: int = step, b: int = b) -> bool:
                        return e.get("args", {}).get("step") == step and e.get("args", {}).get("bucket") == b

                    with expect(f"rank {pid} step {step} bucket {b}: one ready instant, one async slice"):
                        assert len([e for e in _events(doc, pid, "i", f"bucket {b} ready") if mine(e)]) == 1
                        assert len([e for e in _events(doc, pid, "b", f"bucket {b}") if mine(e)]) == 1
                    with expect(f"rank {pid} step {step} bucket {b}: pack, all_reduce, decode"):
                        assert len([e for e in _events(doc, pid, "X", f"pack bucket {b}") if mine(e)]) == 1
                        comm = [e for e in _events(doc, pid, "X", "all_reduce") if mine(e)]
                        assert len(comm) == 1 and comm[0]["args"]["level"] == "world" and comm[0]["tid"] == 3
                        # a ring all-reduce sends 2 (p - 1) / p of the bucket from every rank
                        assert comm[0]["args"]["bytes"] == int(2 * (p - 1) / p * nbytes)
                        assert len([e for e in _events(doc, pid, "X", f"decode bucket {b}") if mine(e)]) == 1
            with expect(f"rank {pid}: only the window's steps are traced"):
                steps = {e["args"]["step"] for e in _events(doc, pid, "X") if "step" in e.get("args", {})}
                assert steps == set(range(*WINDOW))
            with expect(f"rank {pid}: forward, backward, sync wait and optimizer slices of the window"):
                for name in ("forward", "backward", "sync wait", "optimizer"):
                    assert len(_events(doc, pid, "X", name)) == WINDOW[1] - WINDOW[0], name
            with expect(f"rank {pid}: counters of bytes per level"):
                counters = _events(doc, pid, "C", "bytes sent")
                assert len(counters) == WINDOW[1] - WINDOW[0]
                assert (
                    counters[0]["args"]["world"]
                    == sum(int(2 * (p - 1) / p * n) for n in bucket_bytes.values()) + STEP_CHECK_BYTES
                )
        with expect("each flow goes ready -> pack -> all_reduce -> decode, threads 1, 2, 3, 2"):
            flows: dict[int, list[tuple[str, int]]] = {}
            for e in doc["traceEvents"]:
                if e["ph"] in "stf" and e.get("cat") == "flow":
                    flows.setdefault(e["id"], []).append((e["ph"], e["tid"]))
            assert len(flows) == 2 * (WINDOW[1] - WINDOW[0]) * len(bucket_bytes)
            assert all(f == [("s", 1), ("t", 2), ("t", 3), ("f", 2)] for f in flows.values()), flows
        with expect("clocks aligned: the step checks (one all-reduce) end within 50 ms on both ranks"):
            ends = {
                pid: sorted(
                    e["ts"] + e["dur"]
                    for e in _events(doc, pid, "X", "all_reduce")
                    if e["args"]["bucket"] < 0
                )
                for pid in (0, 1)
            }
            assert len(ends[0]) == len(ends[1]) == WINDOW[1] - WINDOW[0]
            assert max(abs(a - b) for a, b in zip(ends[0], ends[1], strict=True)) < 50e3
        with expect("gradsync trace merge of the rank files gives the same events"):
            merged = merge_traces([load_trace(rank_file(path, r)) for r in (0, 1)])
            key = lambda e: json.dumps(e, sort_keys=True)  # noqa: E731
            assert sorted(map(key, merged["traceEvents"])) == sorted(map(key, doc["traceEvents"]))


def traced_compressed(tmp: str) -> None:
    """2 nodes of 1 rank, top-k with error feedback, always compressing: encode and decode
    slices, inter-node collectives, telemetry with a residual and a reduction above 1."""
    path = Path(tmp) / "topk.json"
    model = gradsync.wrap(
        _model(), "allgather/topk:density=0.05", Topology(2, 1), plan="compress", min_compress_bytes=0,
        bucket_bytes=20_000, trace=path,
    )  # fmt: skip
    _train(model, 3)
    stats = model.last_stats
    residual = model.engine.residual_norm()
    # independently: the norm of the residual tensors the engine's state holds
    state = model.sync_state_dict()
    squares = 0.0
    for codec in state["codecs"]:
        for stream in codec.get("streams", {}).values():
            if stream.get("residual") is not None:
                squares += float(stream["residual"].double().square().sum())
    model.close()
    with expect_all() as expect:
        assert stats is not None
        rec = step_record(stats, residual_norm=residual)
        with expect("telemetry: raw bytes are the float32 gradients, the reduction is above 1"):
            assert rec["raw_bytes"] == sum(p.numel() * 4 for p in _model().parameters())
            assert rec["reduction"] is not None and rec["reduction"] > 2
            assert rec["wire_bytes"]["inter"] > 0 and rec["compressed_buckets"] == rec["buckets_total"]
            assert sum(b["raw_bytes"] for b in rec["buckets"]) == rec["raw_bytes"]
            wire = sum(b["wire_bytes"] for b in rec["buckets"])
            assert wire + STEP_CHECK_BYTES == rec["wire_bytes"]["total"]
        with expect("telemetry: the residual norm is the norm of the residuals in the state"):
            assert residual is not None and residual > 0
            assert squares > 0 and residual == pytest.approx(squares**0.5, rel=1e-5)
        with expect("telemetry: the lag of the previous step is known after two steps"):
            assert rec["lag_ms"] is not None and rec["lag_ms"] >= 0
            assert "exposed" in format_line(rec)
        if dist.get_rank() != 0:
            return
        doc = load_trace(path)
        with expect("the format's rules hold"):
            assert check_trace(doc) == []
        with expect("encode and decode slices, all-gathers across nodes"):
            assert _events(doc, 0, "X", "encode bucket")
            assert _events(doc, 1, "X", "decode bucket")
            levels = {e["args"].get("level") for e in _events(doc, 0, "X") if e.get("tid") == 3}
            assert "inter" in levels
            assert all(
                e["args"]["bytes"] >= 0
                for e in _events(doc, 0, "X")
                if e.get("tid") == 3 and "bytes" in e["args"]
            )
        with expect("a counter of the reduction against dense"):
            assert any(e["args"]["x"] > 2 for e in _events(doc, 0, "C", "reduction"))


def tracing_block(tmp: str) -> None:
    """``with model.tracing(path):`` traces the block only and writes at its end."""
    path = Path(tmp) / "block.json"
    model = gradsync.wrap(_model(), "flat")
    _train(model, 1)
    with model.tracing(path):
        _train(model, 2)
    _train(model, 1)
    model.close()
    if dist.get_rank() == 0:
        doc = load_trace(path)
        assert check_trace(doc) == []
        assert sorted({e["args"]["step"] for e in _events(doc, 0, "X", "sync wait")}) == [1, 2]


def traced_bf16(tmp: str) -> None:
    """A bfloat16 model as a user writes it (data from a DistributedSampler, plain SGD): the
    trace is well formed and its all-reduces carry the bf16 buckets' bytes (2 per element)."""
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    path = Path(tmp) / "bf16.json"
    net = _model().to(torch.bfloat16)
    model = gradsync.wrap(net, "flat", bucket_bytes=10_000, trace=path)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 3, 8, 8, generator=g).bfloat16(), torch.randint(0, 10, (64,), generator=g)
    )
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for x, y in DataLoader(data, batch_size=8, sampler=sampler):
        nn.functional.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad()
    model.close()
    if dist.get_rank() != 0:
        return
    doc = load_trace(path)
    assert check_trace(doc) == []
    numel = sum(p.numel() for p in _model().parameters())
    per_step = [
        sum(
            e["args"]["bytes"]
            for e in _events(doc, 0, "X", "all_reduce")
            if e["args"]["step"] == s and e["args"]["bucket"] >= 0
        )
        for s in range(4)
    ]
    assert all(b == pytest.approx(2 * (2 - 1) / 2 * numel * 2, abs=8) for b in per_step), per_step


def bad_trace_options(tmp: str) -> None:
    """Refused on every rank before anything communicates, naming the option."""
    for kwargs, words in (
        ({"trace": ""}, "trace must be a file path"),
        ({"trace": tmp}, "is a directory"),
        ({"trace": Path(tmp) / "t.json", "trace_steps": (5, 2)}, "trace_steps must be (START, STOP)"),
        ({"trace": Path(tmp) / "t.json", "trace_steps": (0,)}, "trace_steps must be (START, STOP)"),
    ):
        with pytest.raises(ValueError, match=__import__("re").escape(words)):
            gradsync.wrap(_model(), "flat", **kwargs)


def bench_commands(tmp: str) -> None:
    """``bench step --trace`` traces each gradsync contender's measured steps; ``bench overhead``
    reports its ratios (the figures themselves are published, not asserted)."""
    base = str(Path(tmp) / "bs.json")
    argv = ["bench", "step", "--model", "vgg-small", "--batch-size", "2", "--image-size", "16",
            "--contenders", "local,ddp,topk:density=0.1", "--warmup", "1", "--steps", "2",
            "--trace", base]  # fmt: skip
    assert cli(argv) == 0
    out = str(Path(tmp) / "o.json")
    argv = ["bench", "overhead", "--model", "vgg-small", "--batch-size", "2", "--image-size", "16",
            "--scheme", "flat", "--rounds", "2", "--warmup", "1", "--steps", "2", "--json", out]  # fmt: skip
    assert cli(argv) == 0
    if dist.get_rank() != 0:
        return
    with expect_all() as expect:
        with expect("bench step: one trace per gradsync contender, of the measured steps, well formed"):
            assert sorted(p.name for p in Path(tmp).glob("bs.*.json") if ".rank" not in p.name) == [
                "bs.topk-density=0.1.json"
            ]
            doc = load_trace(Path(tmp) / "bs.topk-density=0.1.json")
            assert check_trace(doc) == []
            assert {e["args"]["step"] for e in _events(doc, 0, "X", "sync wait")} == {1, 2}
        with expect("bench overhead: a ratio per round and their summary"):
            r = json.loads(Path(out).read_text())
            assert len(r["rounds"]) == 2 and r["on_over_off"]["min"] <= r["on_over_off"]["median"]
            assert all(row["ratio"] == row["on"]["step_s"] / row["off"]["step_s"] for row in r["rounds"])
            assert r["bookkeeping_us"] > 0


def test_trace_world(tmp_path: Path) -> None:
    run_world(2, _checks, str(tmp_path))


def _checks(tmp: str) -> None:
    run_checks(
        named_check(traced_dense, tmp),
        named_check(traced_compressed, tmp),
        named_check(tracing_block, tmp),
        named_check(traced_bf16, tmp),
        named_check(bad_trace_options, tmp),
        named_check(bench_commands, tmp),
    )


# ---------------------------------------------------------------------- the checker's rules
def _doc(*events: dict[str, Any]) -> dict[str, Any]:
    return {"traceEvents": list(events)}


def _x(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, Any]:
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_checker_accepts_nesting_and_rejects_partial_overlap() -> None:
    assert check_trace(_doc(_x("a", 0, 10), _x("b", 2, 3), _x("c", 10, 5))) == []
    bad = check_trace(_doc(_x("a", 0, 10), _x("b", 5, 10)))
    assert len(bad) == 1 and "overlaps" in bad[0]
    assert check_trace(_doc(_x("a", 0, 10), _x("b", 5, 10, tid=2))) == []  # other thread


def test_checker_rules_for_flows_async_and_fields() -> None:
    flow = {"name": "f", "cat": "flow", "id": 1, "pid": 0, "tid": 1}
    assert check_trace(_doc({**flow, "ph": "s", "ts": 1}, {**flow, "ph": "f", "ts": 2})) == []
    assert "expected one start" in check_trace(_doc({**flow, "ph": "s", "ts": 1}))[0]
    assert "back in time" in check_trace(_doc({**flow, "ph": "s", "ts": 3}, {**flow, "ph": "f", "ts": 2}))[0]
    a = {"name": "b0", "cat": "bucket", "id2": {"local": "x"}, "pid": 0}
    assert check_trace(_doc({**a, "ph": "b", "ts": 1}, {**a, "ph": "e", "ts": 2})) == []
    assert "one begin then one end" in check_trace(_doc({**a, "ph": "b", "ts": 1}))[0]
    assert "missing" in check_trace(_doc({"name": "x", "ph": "X", "ts": 0, "pid": 0, "tid": 1}))[0]
    assert "unknown phase" in check_trace(_doc({"name": "x", "ph": "Q"}))[0]
    assert "not a finite number" in check_trace(_doc(_x("a", float("nan"), 1)))[0]
    assert (
        "args must be numbers"
        in check_trace(_doc({"name": "c", "ph": "C", "ts": 0, "pid": 0, "args": {"v": "x"}}))[0]
    )


# ---------------------------------------------------------------------- the command line
def test_trace_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = tmp_path / "t.json"
    for rank in (0, 1):
        doc = {
            "traceEvents": [_x("forward", 10.0 * rank, 5.0) | {"pid": rank, "args": {"step": 0}}],
            "otherData": {"format": "gradsync.trace/1", "rank": rank, "run_id": "abc"},
        }
        rank_file(base, rank).write_text(json.dumps(doc))
    assert cli(["trace", "merge", str(tmp_path / "m.json"), "--from", str(base)]) == 0
    merged = load_trace(tmp_path / "m.json")
    assert sorted(e["pid"] for e in merged["traceEvents"]) == [0, 1]
    assert cli(["trace", "check", str(tmp_path / "m.json")]) == 0
    assert cli(["trace", "plot", str(tmp_path / "m.json"), "--out", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    # a file of another run is refused
    other = json.loads(rank_file(base, 1).read_text())
    other["otherData"]["run_id"] = "zzz"
    rank_file(base, 1).write_text(json.dumps(other))
    assert cli(["trace", "merge", str(tmp_path / "m2.json"), "--from", str(base)]) == 1
    assert "different runs" in capsys.readouterr().err
    # a broken trace: check says what is wrong, exit 1
    (tmp_path / "bad.json").write_text(json.dumps(_doc(_x("a", 0, 10), _x("b", 5, 10))))
    assert cli(["trace", "check", str(tmp_path / "bad.json")]) == 1
    assert "overlaps" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["trace", "merge", "out.json"], "give the rank files or --from TRACE"),
        (["trace", "merge", "out.json", "--from", "/nonexistent/t.json"], "no rank files next to"),
        (["trace", "check", "/nonexistent.json"], "no such file"),
        (["trace", "plot", "/nonexistent.json", "--out", "x.png"], "no such file"),
        (["train", "--trace-steps", "0"], "--trace-steps takes N"),
        (["train", "--trace-steps", "4:2"], "--trace-steps takes N"),
        (["train", "--trace-steps", "a:b"], "--trace-steps takes N"),
        (["train", "--log-every", "0"], "--log-every must be a positive"),
        (["train", "--trace", "/proc/version/t.json"], "--trace:"),
        (["bench", "step", "--trace", "/proc/version/t.json"], "--trace:"),
        (["bench", "overhead", "--rounds", "0"], "--rounds must be at least 1"),
        (["bench", "overhead", "--scheme", "warp9"], "unknown codec 'warp9'"),
        (["bench", "overhead", "--nodes", "2"], "--nodes and --per-node go together"),
    ],
)
def test_bad_trace_options_exit_2(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert cli(argv) == 2
    assert words in capsys.readouterr().err


def test_plot_refuses_a_non_png_and_unknown_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "t.json"
    f.write_text(json.dumps(_doc(_x("forward", 0, 5) | {"args": {"step": 0}})))
    assert cli(["trace", "plot", str(f), "--out", str(tmp_path / "g.svg")]) == 2
    assert "--out must name a .png" in capsys.readouterr().err
    assert cli(["trace", "plot", str(f), "--out", str(tmp_path / "g.png"), "--steps", "3:1"]) == 2
    assert cli(["trace", "plot", str(f), "--out", str(tmp_path / "g.png"), "--steps", "5:6"]) == 1
    assert "no events of steps 5:6" in capsys.readouterr().err
