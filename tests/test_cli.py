"""The CLI: codec listing, the codec benchmark's arithmetic and output, argument errors."""

import json
import subprocess
import sys
import time

import pytest

import gradsync
from gradsync.bench.timing import paired
from gradsync.cli import main


def test_codecs_lists_every_codec(capsys):
    assert main(["codecs"]) == 0
    out = capsys.readouterr().out
    for name in gradsync.codec_names():
        assert name in out
    assert "density=None" in out and "rank=4" in out


def test_bench_codecs_writes_consistent_json(tmp_path, capsys):
    path = tmp_path / "b.json"
    argv = [
        "bench",
        "codecs",
        "--sizes",
        "12,13",
        "--densities",
        "0.01",
        "--codecs",
        "topk,fp16,onebit",
        "--budget",
        "0.01",
        "--json",
        str(path),
        "--markdown",
        str(tmp_path / "b.md"),
    ]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "torch.topk" in table and "enc/floor" in table
    result = json.loads(path.read_text())
    lines = (tmp_path / "b.md").read_text().splitlines()
    assert lines[0].startswith("| codec | variant |") and len(lines) == 2 + len(result["rows"])
    assert result["threads"] == 1
    rows = result["rows"]
    assert {(r["codec"], r["log2"]) for r in rows} == {
        (c, s) for c in ("torch.topk", "topk", "fp16", "onebit") for s in (12, 13)
    }
    for r in rows:
        assert r["numel"] == 2 ** r["log2"]
        assert r["encode_ms"] > 0 and r["floor_ms"] > 0 and r["encode_x_floor"] > 0
        if r["codec"] == "torch.topk":
            continue
        codec = gradsync.build_codec(r["codec"] + (f":density={r['density']}" if r["density"] else ""))
        assert r["payload_bytes"] == codec.estimate_nbytes(r["numel"])
        assert r["compression"] == pytest.approx(4 * r["numel"] / r["payload_bytes"])
        if r["codec"] == "topk":
            ref = next(x for x in rows if x["codec"] == "torch.topk" and x["log2"] == r["log2"])
            assert r["vs_torch_topk"] == pytest.approx(ref["encode_ms"] / r["encode_ms"])
        else:
            assert r["vs_torch_topk"] is None


def test_paired_timing_ratio():
    def slow():
        time.sleep(0.004)

    def fast():
        time.sleep(0.002)

    p = paired(slow, fast, min_reps=5, budget_s=0.01, warmup=1)
    assert p.reps >= 5
    assert 1.4 < p.ratio < 2.6
    assert p.seconds > p.reference


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "codecs", "--sizes", "40"], "sizes are log2 values in [0, 30]"),
        (["bench", "codecs", "--densities", "0"], "densities must be in (0, 1]"),
        (["bench", "codecs", "--densities", "x"], "expected comma-separated numbers"),
    ],
)
def test_bad_arguments_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "codecs", "--codecs", "zip"], "unknown codec 'zip'"),
        (
            ["bench", "codecs", "--variants", "fast"],
            "--variants: 'fast' is not one of eager, torch, compiled",
        ),
        (["bench", "codecs", "--threads", "0"], "--threads must be at least 1"),
        (["bench", "codecs", "--budget", "0"], "--budget must be positive"),
    ],
)
def test_bad_values_fail_before_any_work(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""  # nothing was benchmarked


def test_module_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "gradsync", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"gradsync {gradsync.__version__}"
