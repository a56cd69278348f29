"""The CLI: codec listing, the codec benchmark's arithmetic and output, argument errors, and
the exit status of every way a command ends (0 done, 1 failed while running, 2 usage error,
130 interrupted)."""

import json
import subprocess
import sys
import time

import pytest

import gradsync
import gradsync.apps.commands.train
from gradsync.apps.commands import main
from gradsync.apps.commands.bench import codecs as bench_codecs
from gradsync.apps.commands.bench.support.timing import paired
from gradsync.apps.train.checkpoint import CheckpointError
from gradsync.apps.train.trainer import TrainingDiverged
from gradsync.collectives import MismatchError, TopologyError
from gradsync.integrate.engine_failure import SyncError
from gradsync.sync import TaskError
from gradsync.sync.sequence import OutOfStepError


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
        (
            ["bench", "codecs", "--ef", "--variants", "torch"],
            "--ef times the eager variant, and --variants 'torch' leaves it out",
        ),
        (
            ["bench", "codecs", "--ef", "--codecs", "fp16,onebit"],
            "--ef times sparsifiers under error feedback, and --codecs 'fp16,onebit' has none",
        ),
    ],
)
def test_bad_values_fail_before_any_work(argv, message, capsys):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""  # nothing was benchmarked


def test_bench_codecs_ef_times_the_fused_and_the_plain_feedback(tmp_path, capsys):
    path = tmp_path / "ef.json"
    argv = ["bench", "codecs", "--sizes", "16", "--densities", "0.01", "--codecs", "mstopk,fp16", "--ef",
            "--budget", "0.01", "--json", str(path)]  # fmt: skip
    assert main(argv) == 0
    rows = {(r["codec"], r["variant"]): r for r in json.loads(path.read_text())["rows"]}
    assert ("fp16+ef", "ef fused") not in rows  # not a sparsifier
    fused, plain = rows[("mstopk+ef", "ef fused")], rows[("mstopk+ef", "ef add+encode")]
    want = gradsync.build_codec("mstopk:density=0.01").estimate_nbytes(2**16)
    assert fused["payload_bytes"] == plain["payload_bytes"] == want
    assert fused["encode_ms"] > 0 and plain["encode_ms"] > 0 and fused["vs_unfused"] > 0
    assert plain["vs_unfused"] is None
    assert "vs add+encode" in capsys.readouterr().out


def test_module_entry_point():
    out = subprocess.run(
        [sys.executable, "-m", "gradsync", "--version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == f"gradsync {gradsync.__version__}"


def test_usage_error_exits_2_with_one_line():
    done = subprocess.run(
        [sys.executable, "-m", "gradsync", "bench", "codecs", "--threads", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stderr == "gradsync: error: --threads must be at least 1, got 0\n"
    assert done.stdout == ""


def _failing_run(monkeypatch, error):
    """``gradsync bench codecs`` whose options pass and whose run raises ``error``."""

    def run(args):
        raise error

    monkeypatch.setattr(bench_codecs, "run", run)
    monkeypatch.delenv("GRADSYNC_DEBUG", raising=False)


@pytest.mark.parametrize(
    "error",
    [
        MismatchError("ranks 0 and 1 were given different schemes"),
        OutOfStepError("rank 1 is at step 4, rank 0 at step 5"),
        TopologyError("4 ranks do not form 3 nodes"),
        CheckpointError("ckpt/step-8/rank-1.pt is damaged"),
        SyncError("rank 1 stopped"),
        TaskError("encode of bucket 3 failed"),
        TrainingDiverged("the training loss became nan at epoch 1, step 3"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_gradsync_failures_while_running_exit_1_with_their_message(error, monkeypatch, capsys):
    """Failures after the options were accepted exit 1, not 2, even the ValueError subclasses
    (a cross-rank mismatch, a topology, a checkpoint): one line, gradsync's message as it is."""
    _failing_run(monkeypatch, error)
    assert main(["bench", "codecs"]) == 1
    err = capsys.readouterr().err
    assert err == f"gradsync: error: {error}\n"


def test_other_failures_exit_1_with_their_type_and_the_debug_switch(monkeypatch, capsys):
    """A ValueError raised while running is a failure, not a usage error; an exception from
    elsewhere is named by its type, and the line says how to see the traceback."""
    _failing_run(monkeypatch, ValueError("shape mismatch:\n  [8, 3] vs [8, 4]"))
    assert main(["bench", "codecs"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "gradsync: error: ValueError: shape mismatch: [8, 3] vs [8, 4] "
        "(GRADSYNC_DEBUG=1 prints the traceback)\n"
    )
    assert "Traceback" not in err


def test_debug_variable_prints_the_traceback(monkeypatch, capsys):
    _failing_run(monkeypatch, SyncError("rank 1 stopped"))
    monkeypatch.setenv("GRADSYNC_DEBUG", "1")
    assert main(["bench", "codecs"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "SyncError: rank 1 stopped" in err
    assert err.endswith("gradsync: error: rank 1 stopped\n")


def test_interrupt_exits_130(monkeypatch, capsys):
    _failing_run(monkeypatch, KeyboardInterrupt())
    assert main(["bench", "codecs"]) == 130
    assert capsys.readouterr().err == "gradsync: interrupted\n"


def test_missing_app_package_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main(["codecs"]) == 1
    captured = capsys.readouterr()
    assert captured.err == (
        'gradsync: the command line needs the apps extra (matplotlib missing): pip install "gradsync[apps]"\n'
    )
    assert captured.out == ""


def test_missing_app_package_while_running_names_the_extra(monkeypatch, capsys):
    _failing_run(monkeypatch, ModuleNotFoundError("No module named 'rich'", name="rich"))
    assert main(["bench", "codecs"]) == 1
    assert 'needs the apps extra (rich missing): pip install "gradsync[apps]"' in capsys.readouterr().err


def test_convergence_benchmark_checks_every_runs_train_options_first(monkeypatch, capsys):
    """Each run's ``gradsync train`` options, --train-option included, are checked before the
    first run: a bad one is a usage error, and no training starts."""

    def no_training(args):
        raise AssertionError("a run started")

    monkeypatch.setattr(gradsync.apps.commands.train, "main", no_training)
    monkeypatch.delenv("RANK", raising=False)
    base = ["bench", "convergence", "--schemes", "none,topk", "--datasets", "digits"]
    assert main([*base, "--train-option=--lr=-1"]) == 2
    assert capsys.readouterr().err == "gradsync: error: --lr must be a positive number, got -1.0\n"
    assert main([*base, "--train-option=--bogus"]) == 2
    assert "gradsync: error: --train-option: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_convergence_benchmark_run_failure_exits_1(monkeypatch, capsys):
    calls = []

    def failing_training(args):
        calls.append(args.argv)
        return 1

    monkeypatch.setattr(gradsync.apps.commands.train, "main", failing_training)
    monkeypatch.delenv("RANK", raising=False)
    assert main(["bench", "convergence", "--schemes", "none", "--datasets", "digits", "--epochs", "1"]) == 1
    assert capsys.readouterr().err.endswith("gradsync: error: the digits / none run failed (exit 1)\n")
    # the launcher hands its workers the whole command line, "train" first
    assert len(calls) == 1 and calls[0][0] == "train" and "--epochs" in calls[0]


def test_every_command_module_imports_on_its_own():
    """Each command module (bench convergence runs the train command itself) imports in a fresh
    interpreter without an import cycle, and defines the three functions of the protocol."""
    code = (
        "import importlib, gradsync.apps.commands as c\n"
        "for cmd in c.COMMANDS + c.BENCHMARKS:\n"
        "    m = importlib.import_module('gradsync.apps.commands.' + cmd.module)\n"
        "    assert all(callable(getattr(m, f, None)) for f in ('add_arguments', 'check', 'main')), cmd\n"
    )
    # one fresh interpreter per first module, all at once (each is a single-threaded import)
    running = {
        module: subprocess.Popen(
            [sys.executable, "-c", f"import gradsync.apps.commands.{module}\n" + code],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for module in ("train", "bench.convergence", "bench.large_batch", "whatif", "calibrate")
    }
    try:
        for module, proc in running.items():
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, (module, err)
    finally:
        for proc in running.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
