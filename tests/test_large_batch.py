"""The large-batch recipe of ``gradsync train``: gradient accumulation against one big batch on a
plain all-reduce, the batch plan, LR scaling rules, the poly schedule and their option errors."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync
from gradsync.apps.commands import main
from gradsync.apps.train.arguments import add_arguments
from gradsync.apps.train.optim import lr_factor
from gradsync.apps.train.options import batch_plan, scaled_lr
from gradsync.apps.train.trainer import accumulated_backward
from worlds import named_check, run_checks, run_world


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


def test_batch_plan_splits_the_global_batch_into_micro_batches() -> None:
    assert batch_plan(_args("--batch-size", "32"), 4) == (32, 1)
    assert batch_plan(_args("--batch-size", "32", "--global-batch", "1024"), 4) == (256, 8)
    assert batch_plan(_args("--batch-size", "64", "--global-batch", "128"), 4) == (32, 1)  # fits at once
    with pytest.raises(ValueError, match="--global-batch 1000 must be a multiple of the number of workers"):
        batch_plan(_args("--global-batch", "1000"), 3)
    with pytest.raises(ValueError, match="must be a multiple of --batch-size 48"):
        batch_plan(_args("--batch-size", "48", "--global-batch", "256"), 4)


def test_lr_scaling_rules() -> None:
    assert scaled_lr(0.1, _args("--global-batch", "1024"), 4) == 0.1  # none by default
    assert scaled_lr(0.1, _args("--global-batch", "1024", "--lr-scaling", "linear"), 4) == pytest.approx(0.4)
    sqrt = _args("--global-batch", "1024", "--lr-scaling", "sqrt", "--reference-batch", "64")
    assert scaled_lr(0.1, sqrt, 4) == pytest.approx(0.1 * math.sqrt(16))
    linear = _args("--batch-size", "32", "--lr-scaling", "linear")
    assert scaled_lr(0.2, linear, 2) == pytest.approx(0.2 * 64 / 256)


def test_poly_schedule_is_mlperfs_after_the_warm_up() -> None:
    f = lr_factor("poly", warmup_steps=10, total_steps=110, power=2.0)
    assert f(0) == pytest.approx(0.1) and f(5) == pytest.approx(0.55)  # the linear warm-up from lr/10
    for s in (10, 35, 60, 109):
        assert f(s) == pytest.approx((1 - (s - 10) / 100) ** 2)
    assert f(200) == 0.0


def check_accumulation_equals_one_big_batch() -> None:
    """4 micro-batches under no_sync, then a synchronizing one, on gradsync's dense scheme: the
    gradient is the world mean of each rank's whole-batch gradient (plain all-reduce here)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    reference = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    reference.load_state_dict(net.state_dict())
    model = gradsync.wrap(net, "none", plan="dense")
    g = torch.Generator().manual_seed(10 + dist.get_rank())
    x, y = torch.randn(32, 6, generator=g, dtype=torch.float64), torch.randint(3, (32,), generator=g)
    loss = accumulated_backward(model, nn.functional.cross_entropy, x, y, parts=4)
    full = nn.functional.cross_entropy(reference(x), y)
    full.backward()
    assert loss == pytest.approx(float(full), rel=1e-12)
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        assert q.grad is not None and p.grad is not None
        dist.all_reduce(q.grad)
        q.grad /= dist.get_world_size()
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    model.close()


def _world() -> None:
    run_checks(named_check(check_accumulation_equals_one_big_batch))


def test_gradient_accumulation_in_a_world() -> None:
    run_world(2, _world)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--global-batch", "0"], "--global-batch must be a number >= 1"),
        (["--global-batch", "3"], "--global-batch 3 must be a multiple of the number of workers (2)"),
        (["--global-batch", "100", "--batch-size", "32"], "must be a multiple of --batch-size 32"),
        (["--global-batch", "4096"], "--global-batch 4096 (2048 per worker) is larger than a worker's share"),
        (["--lr-scaling", "cubic"], "--lr-scaling must be one of none, linear, sqrt"),
        (["--reference-batch", "0"], "--reference-batch must be a number >= 1"),
        (["--schedule", "poly", "--poly-power", "0"], "--poly-power must be a positive number"),
        (["--label-smoothing", "1.0"], "--label-smoothing must be in [0, 1)"),
        (["--data", "text", "--label-smoothing", "0.1"], "--label-smoothing is for classifiers"),
    ],
)
def test_recipe_option_errors_come_before_any_process(extra, message, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err


def test_large_batch_lars_run_reports_its_batch_plan(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "run.json"
    argv = ["train", "--nproc", "2", "--epochs", "1", "--global-batch", "256", "--batch-size", "32",
            "--optimizer", "lars", "--lr-scaling", "sqrt", "--schedule", "poly", "--label-smoothing", "0.1",
            "--scheme", "hitopk:density=0.05", "--quiet", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    s = json.loads(out.read_text())
    assert (s["global_batch"], s["accumulation"], s["steps"]) == (256, 4, 1438 // 256)
    assert 0.0 < s["history"][-1]["val_accuracy"] <= 1.0


# ---------------------------------------------------------------------------------------- resizing
RESIZE = ["train", "--nproc", "2", "--data", "synthetic-images:n=384,size=16,channels=3", "--model", "resnet",
          "--batch-size", "32", "--epochs", "3", "--resize-schedule", "0:8,1:12,2:16", "--scheme",
          "hitopk:density=0.05", "--quiet", "--sync-option", "calibrate=false", "--sync-option",
          "bucket_timeout_ms=1e9"]  # fmt: skip


@pytest.mark.parametrize(
    ("resize_batch", "batches", "checkpoint_every", "crash_at"),
    [
        # 173 training images per worker; 5 steps of 32 in every epoch; killed in the second epoch
        ("constant", [64, 64, 64], "4", "9"),
        # --batch-size 32 holds at 16 pixels: 128 per worker at 8, floor(32 * (16/12)^2) = 56 at
        # 12, so 1, 3 and 5 steps; killed at step 3, in the second epoch, saved at step 2
        ("memory", [256, 112, 64], "2", "3"),
    ],
)
def test_progressive_resizing_trains_each_epoch_at_its_size_and_resumes(
    resize_batch, batches, checkpoint_every, crash_at, tmp_path, monkeypatch
) -> None:
    from gradsync.apps.train import checkpoint

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    run = [*RESIZE, "--resize-batch", resize_batch, "--lr-scaling", "linear", "--reference-batch", "64",
           "--lr", "0.1", "--schedule", "constant", "--warmup-epochs", "0"]  # fmt: skip
    out = tmp_path / "a.json"
    assert main([*run, "--checkpoint-dir", str(tmp_path / "a"), "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    history = summary["history"]
    assert [h["input_size"] for h in history] == [8, 12, 16]
    assert [h["global_batch"] for h in history] == batches
    assert summary["steps"] == sum(173 // (b // 2) for b in batches)
    # an epoch's record has the rate of the step after it: the next epoch's batch / 64 times 0.1
    expected = [0.1 * b / 64 for b in [*batches[1:], batches[-1]]]
    assert [h["lr"] for h in history] == pytest.approx(expected)
    # killed in the second epoch and resumed: the same parameters bit for bit, so every epoch
    # ran at the same size and batch as uninterrupted
    crashed = [*run, "--checkpoint-dir", str(tmp_path / "b"), "--checkpoint-every", checkpoint_every,
               "--crash-at-step", crash_at]  # fmt: skip
    assert main(crashed) == 1
    assert main([*run, "--checkpoint-dir", str(tmp_path / "b"), "--resume"]) == 0
    final = {}
    for name in ("a", "b"):
        folder = checkpoint.latest(tmp_path / name)
        assert folder is not None
        final[name] = checkpoint.load(folder, 0)[0]["model"]
    for k, v in final["a"].items():
        assert torch.equal(v, final["b"][k]), k


def test_epoch_plan_counts_each_epochs_own_steps() -> None:
    from gradsync.apps.train.epoch_plan import epoch_plan, memory_batch
    from gradsync.apps.train.options import per_epoch, sync_config

    assert [memory_batch(32, s, 16) for s in (16, 12, 8, 4)] == [32, 56, 128, 512]
    args = _args("--batch-size", "16", "--global-batch", "64", "--epochs", "4",
                 "--resize-schedule", "0:8,2:16", "--resize-batch", "memory")  # fmt: skip
    # 2 workers, 32 per worker in 2 micro-batches of 16 at 16 pixels; 64 per micro-batch at 8
    plan = epoch_plan(args, 2, share=300, native=16)
    assert plan.per_worker == (128, 128, 32, 32) and plan.accumulation == 2
    assert plan.steps == (2, 2, 9, 9) and plan.total_steps == 22
    assert plan.global_batches == [256, 256, 64, 64]
    assert [plan.to_steps(e) for e in (0, 0.5, 1, 2, 2.5, 4, 5)] == [0, 1, 2, 4, 4 + 4, 22, 31]
    steps = (0, 1, 2, 3, 4, 12, 13, 21, 22, 99)
    assert [plan.epoch_of_step(s) for s in steps] == [0, 0, 1, 1, 2, 2, 3, 3, 3, 3]
    # a micro-batch never outgrows the worker's share
    small = epoch_plan(args, 2, share=100, native=16)
    assert small.per_worker[:2] == (100, 100) and small.steps == (1, 1, 3, 3)
    # constant: every epoch alike, and the engine's epoch options counted the same either way
    constant = _args("--batch-size", "16", "--epochs", "3", "--resize-schedule", "0:8,2:16")
    same = epoch_plan(constant, 2, 300, 16)
    assert same.uniform and same.steps == (18, 18, 18)
    opts = _args("--dense-warmup", "1.5", "--switch-to-dense-at", "2.5", "--density-schedule", "exp@0.5",
                 "--scheme", "topk")  # fmt: skip
    config = sync_config(opts, plan.to_steps)
    assert (config.dense_warmup_steps, config.dense_from_step) == (2 + 1, 4 + 4)
    assert config.density_schedule.endswith("@1")
    uniform = sync_config(opts, per_epoch(18))
    assert sync_config(opts, same.to_steps).dense_warmup_steps == uniform.dense_warmup_steps == 27


def test_resize_keeps_a_constant_image_and_the_native_size() -> None:
    from gradsync.apps.train.resize import resize, size_at

    x = torch.full((2, 3, 16, 16), 0.25)
    assert resize(x, 16) is x
    torch.testing.assert_close(resize(x, 8), torch.full((2, 3, 8, 8), 0.25))
    torch.testing.assert_close(resize(x, 24), torch.full((2, 3, 24, 24), 0.25))
    stages = [(0, 8), (3, 12), (6, 16)]
    assert [size_at(stages, e) for e in range(8)] == [8, 8, 8, 12, 12, 12, 16, 16]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--resize-schedule", "1:16"], "--resize-schedule takes EPOCH:SIZE pairs"),
        (["--resize-schedule", "0:8,0:16"], "--resize-schedule takes EPOCH:SIZE pairs"),
        (["--resize-schedule", "0:2"], "sizes >= 4"),
        (["--resize-schedule", "0:16"], "asks for more than the data's own 8 x 8 pixels"),
        (["--resize-schedule", "0:6,2:8"], "the model cannot take 6 x 6 inputs"),
        (["--data", "text", "--resize-schedule", "0:8"], "--resize-schedule is for image data"),
        (["--resize-batch", "memory"], "--resize-batch memory needs --resize-schedule"),
        (["--resize-schedule", "0:8", "--resize-batch", "pixels"], "--resize-batch must be one of constant"),
    ],
)
def test_resize_option_errors_come_before_any_process(extra, message, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------- bench
def test_bench_large_batch_runs_compare_the_same_epochs_at_two_batches() -> None:
    from gradsync.apps.commands.bench import large_batch

    p = argparse.ArgumentParser()
    large_batch.add_arguments(p)
    args = p.parse_args(["--datasets", "digits"])
    runs = {run: argv for _, run, _, argv in large_batch._runs(args, "/tmp")}
    assert list(runs) == ["sgd small", "sgd large", "lars large", "lars large + hitopk"]

    def opt(argv: list[str], name: str) -> str | None:
        return argv[argv.index(name) + 1] if name in argv else None

    assert opt(runs["sgd small"], "--global-batch") is None  # 32 per worker x 4 workers = 128
    for run in ("sgd large", "lars large", "lars large + hitopk"):
        assert opt(runs[run], "--global-batch") == "1024"  # x8
        assert opt(runs[run], "--epochs") == "100"
    assert (opt(runs["sgd large"], "--lr-scaling"), opt(runs["sgd large"], "--reference-batch")) == (
        "linear",
        "128",
    )
    assert opt(runs["lars large"], "--optimizer") == "lars" and opt(runs["lars large"], "--scheme") == "none"
    assert opt(runs["lars large + hitopk"], "--scheme") == "hitopk:density=0.01"
    # LARS's recipe is the dataset's own; --lars-lr replaces its learning rate only
    assert opt(runs["lars large"], "--lr") == "2.0" and opt(runs["lars large"], "--label-smoothing") is None
    images_args = p.parse_args(["--datasets", "images"])
    images = {run: argv for _, run, _, argv in large_batch._runs(images_args, "/t")}
    assert opt(images["lars large"], "--lr") == "16"
    assert opt(images["lars large"], "--label-smoothing") == "0.1"
    assert opt(images["sgd small"], "--label-smoothing") is None
    tuned = p.parse_args(["--datasets", "images", "--lars-lr", "8"])
    lars = next(argv for _, run, _, argv in large_batch._runs(tuned, "/t") if run == "lars large")
    assert opt(lars, "--lr") == "8.0" and opt(lars, "--label-smoothing") == "0.1"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--datasets", "mnist"], "--datasets takes names from digits, images"),
        (["--runs", "adam"], "--runs takes names from sgd small"),
        (["--scale", "0"], "--scale must be at least 1"),
        (["--lars-lr", "0"], "--lars-lr must be a positive number"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--scale", "64"], "--global-batch 8192 (2048 per worker) is larger than a worker's share"),
    ],
)
def test_bench_large_batch_option_errors(extra, message, capsys, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert main(["bench", "large-batch", "--datasets", "digits", *extra]) == 2
    assert message in capsys.readouterr().err


def test_bench_large_batch_one_short_run(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "lb.json"
    argv = ["bench", "large-batch", "--datasets", "digits", "--runs", "lars large + hitopk", "--scale", "2",
            "--epochs", "2", "--nodes", "1", "--per-node", "2", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["run"], row["global_batch"], row["epochs"]) == ("lars large + hitopk", 128, 2)
    assert row["steps"] == 2 * (719 // 64) and 0.0 <= row["accuracy"] <= 1.0 and row["gap_pp"] is None
