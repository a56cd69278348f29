"""``gradsync train`` end to end: the README's main command (shortened) on 2 workers, resume
equals an uninterrupted run (after an explicit --resume and after torchrun restarted a killed
worker), and every option error, reported before any process starts."""

import json
import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from gradsync.apps.commands import main
from gradsync.apps.train import checkpoint
from gradsync.apps.train.trainer import Trainer, TrainingDiverged
from worlds import run_checks, run_world

pytestmark = pytest.mark.timeout(600)

# deterministic: exact top-k, fixed plan (no calibration, one part per bucket, sizes alone fuse)
BASE = [
    "train",
    "--nproc",
    "2",
    "--data",
    "digits",
    "--model",
    "vgg-small",
    "--batch-size",
    "48",
    "--scheme",
    "topk:density=0.05",
    "--plan",
    "compress",
    "--quiet",
    "--sync-option",
    "calibrate=false",
    "--sync-option",
    "partitions=1",
    "--sync-option",
    "bucket_timeout_ms=1e9",
    "--sync-option",
    "dense_algorithm=flat",
]


def _final_model(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    folder = checkpoint.latest(ckpt_dir)
    assert folder is not None
    main_state, _ = checkpoint.load(folder, 0)
    return main_state["model"]


def test_main_command_resume_and_restart(tmp_path, monkeypatch, capfd):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    # 1. uninterrupted, with the summary as JSON; --save-costs where no closed-loop round runs
    # (--plan compress) says so and writes nothing (test_the_engines_refitted_costs_are_saved_for_whatif
    # checks what it writes where rounds run)
    out, costs = tmp_path / "a.json", tmp_path / "none.json"
    first = [*BASE, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "a"), "--json", str(out)]
    capfd.readouterr()
    assert main([*first, "--save-costs", str(costs)]) == 0
    assert "nothing written: the closed loop never refitted" in capfd.readouterr().err
    assert not costs.exists()
    s = json.loads(out.read_text())
    assert s["world"] == 2 and s["task"] == "classify" and len(s["history"]) == 2
    steps_per_epoch = 719 // 48  # digits: 1438 training images, 719 per worker, whole batches only
    assert s["steps"] == 2 * steps_per_epoch
    for r in s["history"]:
        assert 0.0 <= r["val_accuracy"] <= 1.0 and r["train_loss"] > 0 and r["samples_per_s"] > 0
        assert 0.0 <= r["exposed_sync_share"] <= 1.0
    last = s["history"][-1]
    # the large tensors travel as 5 % top-k: far fewer bytes than a dense ring all-reduce
    assert last["compression_ratio"] > 3
    # and the summary says what was compressed and why the rest was not
    assert s["plan_summary"].startswith("compressing ") and "min_compress_bytes" in s["plan_summary"]
    assert last["val_accuracy"] > 0.5  # 2 epochs already learn digits (10 classes: chance is 0.1)
    reference = _final_model(tmp_path / "a")

    # 2. killed at step 20 (checkpoints every 8 steps), no restarts: the run fails ...
    crash = [
        *BASE,
        "--epochs",
        "2",
        "--checkpoint-dir",
        str(tmp_path / "b"),
        "--checkpoint-every",
        "8",
        "--crash-at-step",
        "20",
    ]
    assert main(crash) == 1
    folder = checkpoint.latest(tmp_path / "b")
    assert folder is not None and folder.name == "step-00000016"
    # ... and --resume continues from step 16 to the same parameters, bit for bit
    assert main([*BASE, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "b"), "--resume"]) == 0
    for k, v in _final_model(tmp_path / "b").items():
        assert torch.equal(v, reference[k]), k

    # 3. the same kill under --max-restarts 1: torchrun restarts the workers, they resume by themselves
    assert (
        main(
            [
                *crash[:-4],
                "--checkpoint-dir",
                str(tmp_path / "c"),
                "--checkpoint-every",
                "8",
                "--crash-at-step",
                "20",
                "--max-restarts",
                "1",
            ]
        )
        == 0
    )
    for k, v in _final_model(tmp_path / "c").items():
        assert torch.equal(v, reference[k]), k

    # 4. a checkpoint of another run is refused, naming what differs
    other = [
        *BASE,
        "--epochs",
        "2",
        "--batch-size",
        "32",
        "--checkpoint-dir",
        str(tmp_path / "a"),
        "--resume",
    ]
    capfd.readouterr()
    assert main(other) == 1
    assert "saved by a different run (batch_size: saved 48, now 32)" in capfd.readouterr().err

    # 5. a damaged checkpoint: rank 1's file has 256 garbage bytes. Both ranks refuse it before
    # loading anything, naming the file (rank 0 passes on rank 1's reason), and the run fails
    damaged = checkpoint.latest(tmp_path / "a") / "rank-1.pt"
    data = bytearray(damaged.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 256] = bytes(b ^ 0xFF for b in data[mid : mid + 256])
    damaged.write_bytes(bytes(data))
    assert main([*BASE, "--epochs", "2", "--checkpoint-dir", str(tmp_path / "a"), "--resume"]) == 1
    err = capfd.readouterr().err
    reason = f"{damaged} is damaged: its SHA-256 digest does not match the manifest"
    assert f"gradsync: error: {reason}" in err  # rank 1
    assert f"gradsync: error: rank 1 cannot use its checkpoint: {reason}" in err  # rank 0
    assert "resumed from" not in err


def test_pto_auto_decides_from_its_measurements_and_changes_nothing_else(tmp_path, monkeypatch):
    """--pto auto times the trust ratios and a small all-gather, and reports what it chose; the
    run trains exactly as --pto off does (the operator's ratios are bitwise the local ones)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    lars = [*BASE, "--epochs", "1", "--optimizer", "lars"]
    summaries = {}
    for mode in ("auto", "off"):
        out = tmp_path / f"{mode}.json"
        assert main([*lars, "--pto", mode, "--json", str(out)]) == 0
        summaries[mode] = json.loads(out.read_text())
    choice = summaries["auto"]["pto_choice"]
    assert "pto_choice" not in summaries["off"]
    assert choice["layers"] > 0 and choice["local_ms"] > 0 and choice["gather_ms"] > 0
    # the prediction is the largest share's norms plus the all-gather: more than the gather alone
    assert choice["predicted_ms"] > choice["gather_ms"]
    assert choice["pto"] == ("on" if choice["predicted_ms"] < choice["local_ms"] else "off")
    assert summaries["auto"]["history"][-1]["train_loss"] == summaries["off"]["history"][-1]["train_loss"]
    assert summaries["auto"]["history"][-1]["val_accuracy"] == summaries["off"]["history"][-1]["val_accuracy"]


def test_lars_with_pto_and_bf16_autocast_resumes_bit_identically(tmp_path, monkeypatch):
    """LARS's momentum and the PTO's group survive a kill and --resume: the resumed run ends on
    the uninterrupted run's parameters, bit for bit."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    lars = [*BASE, "--epochs", "2", "--optimizer", "lars", "--pto", "--amp", "--trust-coefficient", "0.002"]
    assert main([*lars, "--checkpoint-dir", str(tmp_path / "a")]) == 0
    reference = _final_model(tmp_path / "a")
    crashed = [*lars, "--checkpoint-dir", str(tmp_path / "b"), "--checkpoint-every", "8"]
    crashed += ["--crash-at-step", "20"]
    assert main(crashed) == 1
    assert main([*lars, "--checkpoint-dir", str(tmp_path / "b"), "--resume"]) == 0
    for k, v in _final_model(tmp_path / "b").items():
        assert torch.equal(v, reference[k]), k
    folder = checkpoint.latest(tmp_path / "b")
    assert folder is not None
    state = checkpoint.load(folder, 0)[0]["optimizer"]["state"]
    assert state and all("momentum_buffer" in s for s in state.values())


def test_diverging_loss_fails_every_rank(tmp_path, monkeypatch, capfd):
    """A learning rate far too high: the loss turns non-finite within a few steps. Every rank stops
    with exit code 1, the message says where, and no checkpoint holds the diverged model (one
    every 2 steps: the verdict on an odd step comes a step later, on an even one at once)."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ckpt = tmp_path / "ckpt"
    argv = [*BASE, "--epochs", "1", "--lr", "1e6", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2"]
    assert main(argv) == 1
    err = capfd.readouterr().err
    found = re.search(
        r"gradsync train: the (?:training loss|model's parameters) became "
        r"(?:nan|inf|non-finite \(nan or inf\)) at epoch 1, step (\d+) \(batch \d+ of 14\).*; "
        r"lower --lr, add --clip-grad, or check the data",
        err,
    )
    assert found, err
    step = int(found.group(1))
    assert 2 < step < 13  # found within a step, not at the epoch's end
    folder = checkpoint.latest(ckpt)
    assert folder is not None and folder.name == f"step-{2 * ((step - 1) // 2):08d}"  # the last before
    model, _ = checkpoint.load(folder, 0)
    assert all(bool(torch.isfinite(v).all()) for v in model["model"].values())
    assert "exitcode  : 1" in err  # torchrun's failure report: the workers' own exit code


def _fake_trainer(world, rank):
    """What Trainer._check_finite reads, without data, model building or a launcher."""
    return SimpleNamespace(world=world, rank=rank, net=torch.nn.Linear(3, 2), epoch=1, global_step=0, batch=0,
                           steps_per_epoch=10, device=torch.device("cpu"), _unchecked=None)  # fmt: skip


def _advance(t, loss, now=False):
    t.global_step += 1
    t.batch += 1
    Trainer._check_finite(t, loss, now)


def test_non_finite_loss_or_parameters_stop_training():
    t = _fake_trainer(1, 0)
    _advance(t, 0.5, now=True)  # finite: nothing happens
    with pytest.raises(TrainingDiverged) as err:
        _advance(t, float("inf"))
    assert str(err.value) == (
        "the training loss became inf at epoch 2, step 2 (batch 2 of 10) on rank 0; "
        "lower --lr, add --clip-grad, or check the data"
    )
    t = _fake_trainer(1, 0)
    with torch.no_grad():
        t.net.weight[1, 2] = float("nan")
    _advance(t, 0.5)  # parameters are looked at only before a checkpoint and at an epoch's end
    with pytest.raises(
        TrainingDiverged, match=r"parameters became non-finite \(nan or inf\) at epoch 2, step 2"
    ):
        _advance(t, 0.5, now=True)


def _one_rank_diverges():
    rank = dist.get_rank()

    def check_verdict_a_step_later():
        """Only rank 1's loss is NaN, at step 3: both ranks stop at the same call (the next
        step's, as the verdict comes a step later), naming step 3 and rank 1."""
        t = _fake_trainer(2, rank)
        _advance(t, 1.0)
        _advance(t, 0.9)
        _advance(t, float("nan") if rank == 1 else 0.8)
        with pytest.raises(
            TrainingDiverged, match=r"loss became nan at epoch 2, step 3 \(batch 3 of 10\) on rank 1;"
        ):
            _advance(t, 0.7)

    def check_verdict_at_once_on_a_checkpoint_step():
        """The same, decided at once (a checkpoint step): both stop at step 2 already."""
        t = _fake_trainer(2, rank)
        _advance(t, 1.0)
        with pytest.raises(
            TrainingDiverged, match=r"loss became inf at epoch 2, step 2 \(batch 2 of 10\) on ranks 0 to 1"
        ):
            _advance(t, float("inf"), now=True)

    run_checks(check_verdict_a_step_later, check_verdict_at_once_on_a_checkpoint_step)


def test_ranks_agree_on_a_diverged_loss():
    run_world(2, _one_rank_diverges)


def test_a_fresh_run_is_refused_where_a_run_left_checkpoints(tmp_path, capsys, monkeypatch):
    """Starting afresh there would overwrite and prune that run's checkpoints; --resume continues
    it; a folder with only an unfinished save (no ``latest``) may start afresh."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    (tmp_path / "step-00000016").mkdir()
    (tmp_path / "latest").write_text("step-00000016\n")
    assert main(["train", "--quiet", "--checkpoint-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--checkpoint-dir {str(tmp_path)!r} already holds the checkpoints of a run" in err
    assert "latest: 'step-00000016'" in err and "pass --resume to continue it" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000016"]  # untouched


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--epochs", "0"], "--epochs must be a number >= 1"),
        (["--optimizer", "lamb9"], "--optimizer must be one of sgd, adamw"),
        (["--schedule", "linear"], "--schedule must be one of cosine, step, constant"),
        (["--plan", "always"], "--plan must be one of auto, compress, dense"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--momentum", "1.5"], "--momentum must be in [0, 1)"),
        (["--optimizer", "adamw", "--nesterov"], "--nesterov needs --optimizer sgd"),
        (["--optimizer", "lamb", "--nesterov"], "--nesterov needs --optimizer sgd or lars"),
        (["--optimizer", "lion"], "--optimizer must be one of sgd, adamw, lars, lamb"),
        (["--trust-coefficient", "0.01"], "--trust-coefficient needs --optimizer lars or lamb"),
        (["--optimizer", "lars", "--trust-coefficient", "0"], "--trust-coefficient must be a positive"),
        (["--optimizer", "adamw", "--pto"], "--pto needs --optimizer lars or lamb"),
        (["--optimizer", "lamb", "--pto", "sometimes"], "--pto must be one of off, on, auto"),
        (["--scheme", "warp9"], "unknown codec 'warp9'"),
        (["--sync-option", "bucket_bytes=-4"], "bucket_bytes"),
        (["--sync-option", "plan=dense"], "--sync-option plan=... has its own option"),
        (["--sync-option", "oops"], "--sync-option takes KEY=VALUE"),
        (["--nodes", "2"], "--nodes and --per-node go together"),
        (["--nodes", "2", "--per-node", "2", "--nproc", "3"], "--nproc (3) must equal --nodes x --per-node"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--data", "mnist"], "--data"),
        (["--model", "lstm"], "--model 'lstm' does not fit task 'classify'"),
        (["--data", "text", "--model", "resnet"], "--model 'resnet' does not fit task 'lm'"),
        (["--batch-size", "5000"], "--batch-size 5000 is larger than a worker's share"),
        (["--switch-to-dense-at", "-1"], "--switch-to-dense-at must be a number >= 0"),
        (["--threads", "0"], "--threads must be a number >= 1"),
        (["--weight-decay", "-0.1"], "--weight-decay must be a number >= 0"),
        (["--warmup-epochs", "-1"], "--warmup-epochs must be a number >= 0"),
        (["--dense-warmup", "-2"], "--dense-warmup must be a number >= 0"),
        (["--clip-grad", "0"], "--clip-grad must be a positive number"),
        (["--clip-mode", "bucket"], "--clip-mode bucket needs --clip-grad (the threshold)"),
        (["--density-schedule", "exp"], "--density-schedule takes STAGES@EPOCHS"),
        (["--density-schedule", "exp@-1"], "--density-schedule takes STAGES@EPOCHS"),
        (["--density-schedule", "5%,25%@1"], "--density-schedule must list falling densities"),
        (
            ["--density-schedule", "exp@1", "--scheme", "powersgd:rank=2"],
            "density_schedule='exp@1' needs a sparsifier configured by a density",
        ),
        (["--density-schedule", "exp@1", "--sync-option", "density_schedule=exp@3"], "has its own option"),
        (
            ["--scheme", "dgc:density=0.01+ef:momentum=0.9"],
            "carries the optimizer's momentum in its error feedback (momentum correction: "
            "dgc:density=0.01+ef:momentum=0.9); it needs --optimizer sgd with --momentum 0",
        ),
        (
            ["--scheme", "dgc+ef:momentum=0.9", "--momentum", "0", "--optimizer", "adamw"],
            "momentum correction",
        ),
        (
            ["--clip-grad", "1", "--sync-option", "clip_local=1"],
            "--sync-option clip_local=... has its own option",
        ),
        (["--max-restarts", "-1"], "--max-restarts must be a number >= 0"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds"),
        (["--keep-checkpoints", "0", "--checkpoint-dir", "x"], "--keep-checkpoints must be a number >= 1"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (
            ["--checkpoint-every", "0", "--checkpoint-dir", "x"],
            "--checkpoint-every must be a positive number of steps (omit it to save only at epoch ends), "
            "got 0",
        ),
        (["--checkpoint-every", "-3", "--checkpoint-dir", "x"], "--checkpoint-every must be a positive"),
        (["--checkpoint-every", "0"], "--checkpoint-every must be a positive"),
        (["--checkpoint-dir", __file__], "--checkpoint-dir must be a folder"),
        (["--json", "no-such-folder/x.json"], "--json must be a file path in an existing folder"),
        (["--save-costs", "no-such-folder/c.json"], "--save-costs must be a file path in an existing folder"),
        (["--seq-len", "0"], "--seq-len must be a number >= 1"),
        (["--batch-size", "-4"], "--batch-size must be a number >= 1"),
        (["--nproc", "0"], "--nproc must be a number >= 1"),
        (["--nodes", "0", "--per-node", "2"], "--nodes must be a number >= 1"),
        (["--data", "synthetic-images:size=0"], "--data"),
    ],
)
def test_option_errors_come_before_any_process(extra, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["train", "--quiet", *extra]) == 2
    assert message in capsys.readouterr().err


def test_the_engines_refitted_costs_are_saved_for_whatif(tmp_path, monkeypatch):
    """``--save-costs``: with the closed loop on, rank 0 writes what its last round refitted (a
    document ``gradsync whatif --costs`` reads). Where no round runs it says so and writes none:
    checked on test_main_command_resume_and_restart's first run (--plan compress), which saves
    a launch here."""
    from gradsync.planner.engine_costs import EngineCosts

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = ["train", "--nproc", "2", "--nodes", "2", "--per-node", "1", "--model", "vgg-small",
            "--epochs", "1", "--scheme", "topk:density=0.05", "--sync-option", "min_compress_bytes=0",
            "--quiet"]  # fmt: skip
    path = tmp_path / "costs.json"
    assert main([*base, "--plan", "auto", "--save-costs", str(path)]) == 0
    costs = EngineCosts.load(str(path))
    assert (costs.nodes, costs.per_node) == (2, 1) and costs.source == "allgather/topk:density=0.05"
    assert set(costs.codecs) == {"topk:density=0.05+ef"} and costs.params.inter.beta > 0


def test_language_model_with_bf16_autocast_and_powersgd(tmp_path, monkeypatch):
    """The text path (transformer LM, perplexity), bf16 autocast on CPU and a summable codec."""
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    out = tmp_path / "lm.json"
    argv = ["train", "--nproc", "2", "--data", "synthetic-text:n=20000,vocab=64", "--model", "transformer",
            "--seq-len", "32", "--batch-size", "32", "--epochs", "2", "--optimizer", "adamw", "--lr", "0.003",
            "--amp", "--scheme", "powersgd:rank=2", "--quiet", "--json", str(out)]  # fmt: skip
    assert main(argv) == 0
    s = json.loads(out.read_text())
    first, last = s["history"]
    assert s["task"] == "lm" and "val_accuracy" not in last
    # perplexity is exp(mean token cross-entropy) and falls well below the uniform guess (vocab 64)
    assert last["val_perplexity"] == pytest.approx(math.exp(last["val_loss"]), rel=1e-6)
    assert last["val_perplexity"] < first["val_perplexity"] < 64
    assert last["compression_ratio"] > 1


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--schemes", "topk,warp"], "--schemes takes names from none, topk"),
        (["--schemes", ","], "--schemes takes names from"),
        (["--datasets", "mnist"], "--datasets takes names from digits, text"),
        (["--epochs", "0"], "--epochs must be at least 1"),
        (["--nodes", "0"], "--nodes must be at least 1"),
        (["--ablation", "topk,warp"], "--ablation takes names from none, topk"),
    ],
)
def test_convergence_benchmark_option_errors_come_before_any_run(extra, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(["bench", "convergence", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "gradsync bench convergence: digits" not in err  # no run started


@pytest.mark.parametrize(
    "argv, where, clip_local, mode",
    [
        (["--scheme", "topk:density=0.01"], "local", 1.5, "global"),  # error feedback: local
        (["--scheme", "dgc:density=0.01+ef:momentum=0.9"], "local", 1.5, "global"),
        (["--scheme", "terngrad"], "sync", None, "global"),  # unbiased, no error feedback
        (["--scheme", "hierarchical"], "sync", None, "global"),
        (["--scheme", "topk:density=0.01", "--clip-mode", "sync"], "sync", None, "global"),
        (["--scheme", "none", "--clip-mode", "bucket"], "bucket", 1.5, "bucket"),
        (["--scheme", "auto:candidates=terngrad|powersgd:rank=1"], "local", 1.5, "global"),
    ],
)
def test_clip_grad_clips_before_error_feedback_where_the_scheme_has_it(argv, where, clip_local, mode):
    import argparse

    from gradsync.apps.train.arguments import add_arguments
    from gradsync.apps.train.options import clip_where, per_epoch, sync_config

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--clip-grad", "1.5", *argv])
    config = sync_config(args, per_epoch(10))
    assert clip_where(args, config) == where
    assert config.clip_local == clip_local and config.clip_local_mode == mode


def test_the_convergence_ablation_takes_away_one_ingredient_per_run():
    import argparse

    from gradsync.apps.commands.bench import convergence

    parser = argparse.ArgumentParser()
    convergence.add_arguments(parser)
    args = parser.parse_args(["--datasets", "text,digits", "--schemes", "none,onebit", "--ablation", "topk"])
    runs = {(d, s, v): argv for d, s, v, _, argv in convergence._runs(args, "/tmp")}

    def value(argv, option):
        return argv[argv.index(option) + 1] if option in argv else None

    # the recipe: local clipping (--clip-grad, auto) and the sparsity warm-up, for sparsifiers only
    recipe = runs[("text", "topk", "recipe")]
    assert value(recipe, "--clip-grad") == "1.0" and value(recipe, "--density-schedule") == "exp@1"
    assert value(runs[("text", "onebit", "recipe")], "--density-schedule") is None
    assert value(runs[("text", "none", "recipe")], "--density-schedule") is None
    assert value(runs[("text", "topk", "no clip")], "--clip-grad") is None
    assert value(runs[("text", "topk", "clip after sync")], "--clip-mode") == "sync"
    assert value(runs[("text", "topk", "no warm-up")], "--density-schedule") is None
    dense = runs[("text", "topk", "dense warm-up")]
    # topk at 1 %: stages 25 %, 6.25 %, 1.5625 % of one epoch each, so 3 dense epochs instead
    assert value(dense, "--density-schedule") is None and value(dense, "--dense-warmup") == "3"
    # digits clips nothing and has no warm-up: only the recipe runs there
    assert [v for d, s, v in runs if d == "digits" and s == "topk"] == ["recipe"]
