"""The distributed benchmarks' logic on 2 ranks on loopback (briefly; the emulated-cluster runs
are benchmarks, not tests): the arithmetic of their figures, their JSON and markdown, and their
argument errors (which come before any process group)."""

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist

from gradsync.apps.commands import main
from gradsync.apps.commands.bench import step as bench_step
from gradsync.apps.commands.bench import train as bench_train
from worlds import named_check, run_checks, run_world

pytestmark = pytest.mark.timeout(300)


def benches(tmp):
    run_checks(
        named_check(check_collectives_bench, tmp),
        named_check(check_step_bench, tmp),
        named_check(check_fsdp_bench, tmp),
        named_check(check_whatif_bench, tmp),
        named_check(check_language_model_train_bench, tmp),
    )


def check_language_model_train_bench(tmp):
    """``bench train`` on a sized Transformer LM with AdamW inside, 0/1 Adam as a contender (it
    synchronizes the model itself) and an outer loop: the bytes each sends, and the summary's
    outer loop against the best contender that synchronizes every step."""
    from gradsync.apps.models.text import TransformerLanguageModel

    lj = os.path.join(tmp, "lm.json")
    names = ["local", "ddp", "zeroone-adam", "onebit-adam@freeze_step=2", "outer@every=2"]
    argv = ["bench", "train", "--model", "transformer", "--dim", "16", "--layers", "1", "--seq-len", "8",
            "--vocab", "16", "--batch-size", "2", "--optimizer", "adamw", "--contenders", ",".join(names),
            "--warmup", "2", "--steps", "2", "--rounds", "1", "--nodes", "2", "--per-node", "1",
            "--json", lj]  # fmt: skip
    assert main(argv) == 0
    if dist.get_rank() != 0:
        return  # rank 0 reports
    t = json.loads(Path(lj).read_text())
    rows = {r["contender"]: r for r in t["rows"]}
    assert list(rows) == names
    assert t["model"] == "transformer dim=16 layers=1"
    model = TransformerLanguageModel(16, 8, 16, 4, 1, 64)
    assert t["parameters"] == sum(p.numel() for p in model.parameters())
    dense = t["parameters"] * 4 / 2**20  # a dense float32 copy of the gradients, MB
    for name in ("zeroone-adam", "onebit-adam@freeze_step=2"):
        # compressed momentum (1 bit per element plus scales per tensor): well under dense
        sent = sum(rows[name]["sent_mb"].values())
        assert 0 < sent < dense / 4, (name, sent, dense)
    assert 0 < sum(rows["outer@every=2"]["sent_mb"].values()) < dense  # one dense meeting in 2 steps
    summary = t["summary"]
    per_step = ("zeroone-adam", "onebit-adam@freeze_step=2")
    assert summary["best_outer"] == "outer@every=2"
    assert summary["best_per_step"] == max(per_step, key=lambda c: rows[c]["samples_per_s"])
    assert summary["outer_over_best_per_step"] == pytest.approx(
        rows["outer@every=2"]["samples_per_s"] / rows[summary["best_per_step"]]["samples_per_s"]
    )
    assert summary["outer_over_ddp"] == pytest.approx(
        rows["outer@every=2"]["samples_per_s"] / rows["ddp"]["samples_per_s"]
    )
    assert "outer loop outer@every=2: " in bench_train.headline(summary)


def check_whatif_bench(tmp):
    """``bench whatif`` end to end on 2 ranks: its predictions, PyTorch's PowerSGD hook timed
    running and charged, and a replay of the stored result that predicts the same."""
    wj = os.path.join(tmp, "w.json")
    names = ["local", "ddp", "ddp-powersgd:rank=1", "hitopk:density=0.1", "zeroone-adam",
             "outer@every=2@codec=onebit", "fsdp", "hsdp/topk:density=0.1", "replicate"]  # fmt: skip
    argv = ["bench", "whatif", "--model", "vgg-small", "--batch-size", "4", "--contenders", ",".join(names),
            "--warmup", "2", "--steps", "2", "--rounds", "1", "--profile-steps", "2", "--nodes", "2",
            "--per-node", "1", "--json", wj, "--markdown", os.path.join(tmp, "w.md")]  # fmt: skip
    assert main(argv) == 0
    if dist.get_rank() != 0:
        return  # rank 0 reports
    w = json.loads(Path(wj).read_text())
    assert [r["contender"] for r in w["rows"]] == names
    from gradsync.apps.commands.bench.whatif import compare

    stored = {k: v for k, v in w.items() if k not in ("rows", "predicted", "summary")}
    again = compare(stored)
    assert [r["predicted_ms"] for r in again["rows"]] == pytest.approx([r["predicted_ms"] for r in w["rows"]])
    # what a small collective waits for with 1 and 2 threads computing per rank, measured and
    # recorded; charged only when asked (then never faster), and an older result without the
    # measurement replays as before
    assert w["contention"]["cpus"] >= 1  # what bounds the effective cores read from local
    # every rank's step at once: the slowest rank's (the median over steps of the largest) and
    # the ranks' mean, which cannot exceed it
    c = w["contention"]
    assert 0 < c["together_mean_ms"] <= c["together_ms"] * (1 + 1e-9), c
    # local's ranks' mean step next to its slowest rank's, the ranks' lag the simulator charges
    # at each meeting (Cpu.lag_s): read from local (the same rounds as the effective cores), else
    # from the contention measurement, else none (older results)
    local = next(r for r in w["measured"] if r["contender"] == "local")
    assert 0 < local["mean_step_ms"] <= local["step_ms"] * (1 + 1e-9), local
    used = w["contention_used"]
    if local["step_ms"] > local["mean_step_ms"]:
        assert used["lag_from"] == "local" and used["lag_span_ms"] == pytest.approx(local["step_ms"])
        assert used["lag_ms"] == pytest.approx(local["step_ms"] - local["mean_step_ms"])
    no_local = {**stored, "measured": [{**r, "mean_step_ms": None} for r in stored["measured"]]}
    if c["together_ms"] > c["together_mean_ms"]:
        assert compare(no_local)["contention_used"]["lag_ms"] == pytest.approx(
            c["together_ms"] - c["together_mean_ms"]
        )
    neither = {**no_local, "contention": {k: v for k, v in c.items() if k != "together_mean_ms"}}
    assert compare(neither)["contention_used"]["lag_ms"] == 0.0
    # the host probed before each round (one here) for streaming and computing work, the spread
    # reported: each reading ranks x alone / together, so within (0, ranks] up to timing noise
    probes = w["contention"]["rounds"]
    assert len(probes) == 1 and set(probes[0]) == {"stream_cores", "compute_cores"}, probes
    ranks = w["contention"]["ranks_per_host"]
    assert all(0 < v <= 1.5 * ranks for v in probes[0].values()), probes
    assert w["summary"]["host_stream_cores"] == pytest.approx([probes[0]["stream_cores"]] * 2)
    assert w["summary"]["host_compute_cores"] == pytest.approx([probes[0]["compute_cores"]] * 2)
    assert "the host over the rounds: streaming work" in Path(tmp, "w.md").read_text()
    waits = w["contention"]["busy_call_ms"]
    assert len(waits) == 2 and all(v >= 0 for v in waits), waits
    assert w["contention_used"]["busy_call_ms_charged"] == []
    charged = compare(stored, charge_busy_calls=True)
    assert charged["contention_used"]["busy_call_ms_charged"] == pytest.approx(waits)
    for a, b in zip(again["rows"], charged["rows"], strict=True):
        assert a["predicted_ms"] <= b["predicted_ms"] + 1e-9, (a["contender"], a["predicted_ms"])
    older = {**stored, "contention": {k: v for k, v in stored["contention"].items() if k != "busy_call_ms"}}
    assert [r["predicted_ms"] for r in compare(older, charge_busy_calls=True)["rows"]] == pytest.approx(
        [r["predicted_ms"] for r in again["rows"]]
    )
    # PyTorch's PowerSGD hook was timed running, and the prediction charges that work: without
    # the measured rate (gradsync's codec's timing instead) the hook's step is predicted otherwise
    sharded = {"fsdp", "hsdp/topk:density=0.1", "replicate"}  # FSDP2's own work, measured on one rank
    outer = "outer@every=2@codec=onebit"  # its meetings' own work, measured on one rank
    assert set(w["hook_rates"]) == {"ddp-powersgd:rank=1", "zeroone-adam", outer} | sharded
    assert w["hook_rates"][outer] > 0
    assert w["hook_rates"]["ddp-powersgd:rank=1"] > 0
    # the modes are predicted from the codecs they run (timed in the run) and say how
    rows = {r["contender"]: r for r in w["rows"]}
    assert "onebit+ef" in w["codecs"]["codecs"]
    assert "largest exchange" in rows["outer@every=2@codec=onebit"]["predicted_plan"]
    assert "momentum as onebit+ef" in rows["zeroone-adam"]["predicted_plan"]
    # FSDP2, HSDP (its all-reduce across nodes compressed) and replicate trained unit by unit and
    # predicted so: serial on the CPU
    assert "topk:density=0.1+ef" in w["codecs"]["codecs"]
    for name in ("fsdp", "hsdp/topk:density=0.1", "replicate"):
        assert rows[name]["measured_ms"] > 0 and rows[name]["predicted_ms"] > 0, name
        assert "units (serial)" in rows[name]["predicted_plan"], name
    # 0/1 Adam's own step, measured in a process of its own: more work than SGD's step
    assert w["hook_rates"]["zeroone-adam"] > 0
    # the optimizer steps it measured (after 2 unmeasured: the dense step and the first
    # compressed one), which its predicted mean follows: an exchange on every one of them here
    first, last = w["details"]["zeroone-adam"]["optimizer_steps"]
    assert first == 3 and last >= first
    assert "an exchange on" not in rows["zeroone-adam"]["predicted_plan"]
    # the same contenders predicted again with the refitted costs of the engine that ran first
    # (hitopk's closed loop settled before its measured steps): links, call, efficiencies, codecs
    summary = w["summary"]
    # the largest error against any single round, and what advise would choose against the
    # measured fastest mode (local is no mode)
    worst = max(
        (abs(r["predicted_ms"] / m - 1), r["contender"]) for r in w["rows"] if r["contender"] != "local"
        for m in next(x for x in w["measured"] if x["contender"] == r["contender"])["round_step_ms"]
    )  # fmt: skip
    assert (
        abs(summary["worst_round_error"]) == pytest.approx(worst[0])
        and summary["worst_round_contender"] == worst[1]
    )
    measured = {r["contender"]: r["measured_ms"] for r in w["rows"] if r["contender"] != "local"}
    assert summary["measured_fastest"] == min(measured, key=lambda c: measured[c])
    assert summary["advise_choice"] in measured and summary["advise_choice_over_fastest"] == pytest.approx(
        measured[summary["advise_choice"]] / measured[summary["measured_fastest"]]
    )
    assert summary["refit_from"] == "hitopk:density=0.1"
    assert all("refit_ms" in r and r["refit_ms"] > 0 for r in w["rows"])
    assert summary["refit_median_abs_error"] >= 0 and set(summary["refit_efficiency"]) <= {
        f"{k}/{c}" for k in ("allreduce", "allgather", "sendrecv") for c in ("small", "large")
    }
    codec_only = compare({**stored, "hook_rates": {}})
    hook = names.index("ddp-powersgd:rank=1")
    assert codec_only["rows"][hook]["predicted_ms"] != again["rows"][hook]["predicted_ms"]


def check_collectives_bench(tmp):
    cj, cm = os.path.join(tmp, "c.json"), os.path.join(tmp, "c.md")
    argv = ["bench", "collectives", "--schemes", "flat,torus2d/fp16,hitopk/topk:density=0.1,ps/onebit",
            "--sizes-mb", "0.0625,0.25", "--budget", "0.05", "--max-iters", "3", "--calibration-reps", "1",
            "--nodes", "2", "--per-node", "1", "--json", cj, "--markdown", cm]  # fmt: skip
    assert main(argv) == 0
    if dist.get_rank() != 0:
        return  # rank 0 reports
    c = json.loads(Path(cj).read_text())
    assert [(r["scheme"], r["mbytes"]) for r in c["rows"]] == [
        (s, mb)
        for s in ("flat", "torus2d/fp16", "hitopk/topk:density=0.1", "ps/onebit")
        for mb in (0.0625, 0.25)
    ]
    for r in c["rows"]:
        t = r["time_ms"] / 1e3
        assert r["algbw_gbs"] == pytest.approx(r["nbytes"] / t / 1e9)
        assert r["busbw_gbs"] == pytest.approx(r["algbw_gbs"] * 2 * (2 - 1) / 2)  # nccl-tests, p = 2
        assert r["model_ms"] > 0 and r["measured_over_model"] == pytest.approx(r["time_ms"] / r["model_ms"])
        assert r["busbw_pct_link"] is None and r["cable_bytes_per_op"] is None  # loopback: no link, no NIC
    assert len(Path(cm).read_text().splitlines()) == 2 + len(c["rows"])


def check_fsdp_bench(tmp):
    fj, fm = os.path.join(tmp, "f.json"), os.path.join(tmp, "f.md")
    names = ["hsdp", "hsdp/topk:density=0.05", "fsdp/onebit", "replicate/topk:density=0.05", "ddp"]
    argv = ["bench", "fsdp", "--contenders", ",".join(names), "--dim", "16", "--layers", "1",
            "--seq-len", "8", "--vocab", "16", "--batch-size", "2", "--warmup", "1", "--steps", "1",
            "--rounds", "2", "--nodes", "2", "--per-node", "1", "--json", fj, "--markdown", fm]  # fmt: skip
    assert main(argv) == 0
    if dist.get_rank() != 0:
        return  # rank 0 reports
    f = json.loads(Path(fj).read_text())
    rows = {r["contender"]: r for r in f["rows"]}
    assert list(rows) == names and f["baseline"] == "hsdp"
    assert rows["hsdp"]["speedup"] == 1.0 and rows["hsdp"]["speedup_range"] == [1.0, 1.0]
    for name, r in rows.items():
        assert len(r["round_step_ms"]) == 2 and r["step_ms"] == pytest.approx(
            sorted(r["round_step_ms"])[0] / 2 + sorted(r["round_step_ms"])[1] / 2
        )
        assert r["cable_mb"] is None  # loopback: no NIC counters
        # gradsync counts its own collectives only where it synchronizes
        assert (r["gradsync_mb"] != {}) == ("/" in name), (name, r["gradsync_mb"])
    assert set(rows["fsdp/onebit"]["gradsync_mb"]) == {"shard"}
    assert set(rows["hsdp/topk:density=0.05"]["gradsync_mb"]) == {"replicate"}
    assert len(Path(fm).read_text().splitlines()) == 4 + len(names)


def check_step_bench(tmp):
    sj, sm = os.path.join(tmp, "s.json"), os.path.join(tmp, "s.md")
    argv = ["bench", "step", "--model", "vgg-small", "--batch-size", "4", "--contenders",
            "local,ddp,none,hitopk:density=0.1", "--warmup", "1", "--steps", "2", "--nodes", "2",
            "--per-node", "1", "--sync-option", "plan=compress", "--sync-option", "calibrate=false",
            "--json", sj, "--markdown", sm]  # fmt: skip
    assert main(argv) == 0
    if dist.get_rank() != 0:
        return  # rank 0 reports
    s = json.loads(Path(sj).read_text())
    rows = {r["contender"]: r for r in s["rows"]}
    assert list(rows) == ["local", "ddp", "none", "hitopk:density=0.1"]
    assert rows["local"]["exposed_ms"] is None and rows["local"]["sent_mb"] == {}
    assert rows["ddp"]["exposed_ms"] == pytest.approx(
        max(rows["ddp"]["backward_ms"] - rows["local"]["backward_ms"], 0)
    )
    hi = rows["hitopk:density=0.1"]
    assert hi["exposed_ms"] is not None and hi["compress_ms"] > 0 and hi["sent_mb"]["inter"] > 0
    done, total = (int(v) for v in hi["compressed_buckets"].split("/"))
    plan = s["details"]["hitopk:density=0.1"]["plan_buckets"]
    assert len(plan) == total
    # plan=compress: every bucket with a codec (tensors above min_compress_bytes) is compressed,
    # the others (biases, norms) are not
    assert done == sum(b["codec_id"] >= 0 for b in plan) > 0
    assert all(b["compress"] == (b["codec_id"] >= 0) for b in plan)
    # none sends its gradient dense: the bytes match a ring all-reduce over 2 ranks, 2(p-1)/p * S
    assert sum(rows["none"]["sent_mb"].values()) == pytest.approx(s["parameters"] * 4 / 2**20, rel=1e-3)
    assert s["best"]["contender"] in ("none", "hitopk:density=0.1")
    assert "synchronized as" in s["details"]["hitopk:density=0.1"]["plan"]


OUTER = "outer@every=2@codec=chunktopk:density=0.1"


def train_bench(tmp):
    """One ``bench train`` run; rank 0 checks what it wrote."""
    tj, tm, tp = (os.path.join(tmp, f"t.{ext}") for ext in ("json", "md", "png"))

    def check_bench_train_runs():
        argv = ["bench", "train", "--model", "vgg-small", "--batch-size", "4", "--contenders",
                "local,ddp,ddp-fp16,ddp-powersgd:rank=1,hitopk:density=0.1,auto,"
                "outer@every=2@codec=chunktopk:density=0.1", "--warmup", "2",
                "--steps", "2", "--rounds", "2", "--nodes", "2", "--per-node", "1", "--json", tj,
                "--markdown", tm, "--png", tp]  # fmt: skip
        assert main(argv) == 0

    def rows():
        t = json.loads(Path(tj).read_text())
        return t, {r["contender"]: r for r in t["rows"]}

    def check_throughput_and_scaling_figures():
        t, rows_ = rows()
        hooks = ["ddp", "ddp-fp16", "ddp-powersgd:rank=1"]
        assert list(rows_) == ["local", *hooks, "hitopk:density=0.1", "auto", OUTER]
        single = t["single_worker_step_ms"] / 1e3
        assert single > 0
        for r in rows_.values():
            step = r["step_ms"] / 1e3
            assert r["samples_per_s"] == pytest.approx(2 * 4 / step)  # 2 workers x 4 samples per step
            assert r["speedup_vs_ddp"] == pytest.approx(rows_["ddp"]["step_ms"] / r["step_ms"])
            # paper 02: T_n / (n T_1), T_1 = one worker alone = 4 samples / single
            assert r["scaling_factor"] == pytest.approx(r["samples_per_s"] / (2 * 4 / single))
            assert r["scaling_vs_local"] == pytest.approx(rows_["local"]["step_ms"] / r["step_ms"])
            assert r["compute_ms"] == pytest.approx(r["step_ms"] - (r["exposed_ms"] or 0.0))

    def check_exposed_time_and_bytes_across_nodes():
        _, rows_ = rows()
        for hook in ("ddp", "ddp-fp16", "ddp-powersgd:rank=1"):  # DDP's exposed time: backward over local's
            assert rows_[hook]["exposed_ms"] == pytest.approx(
                max(rows_[hook]["backward_ms"] - rows_["local"]["backward_ms"], 0)
            )
            assert rows_[hook]["crossing_mb_per_worker"] is None  # loopback: no NIC to read
        hi = rows_["hitopk:density=0.1"]
        assert hi["crossing_mb_per_worker"] == hi["sent_mb"]["inter"]
        # the outer loop meets once in its 2 measured steps: what it sent is a mean over them,
        # far below what a per-step dense all-reduce sends
        assert 0 < rows_[OUTER]["sent_mb"]["inter"] < rows_["hitopk:density=0.1"]["sent_mb"]["inter"]
        assert rows_[OUTER]["steps"] == 2 * 2  # 2 measured steps (one outer period) in each of 2 rounds

    def check_summary_names_the_best():
        t, rows_ = rows()
        summary = t["summary"]
        ours = ("hitopk:density=0.1", "auto", OUTER)
        assert summary["best"] == max(ours, key=lambda c: rows_[c]["samples_per_s"])
        assert summary["best_hook"] in ("ddp-fp16", "ddp-powersgd:rank=1")
        assert summary["best_over_ddp"] == pytest.approx(
            rows_[summary["best"]]["samples_per_s"] / rows_["ddp"]["samples_per_s"]
        )
        assert summary["best_fixed"] == "hitopk:density=0.1"

    def check_rounds_are_interleaved_and_carry_the_state():
        t, rows_ = rows()
        for r in rows_.values():  # two rounds, each measured 2 steps; the step is their median
            assert len(r["round_step_ms"]) == 2 and r["steps"] == 4
            assert r["step_ms"] == pytest.approx(sum(r["round_step_ms"]) / 2)
        # the per-round ratio: DDP's step over auto's, round by round
        spread = t["summary"]["auto_over_ddp_rounds"]
        ddp, auto = rows_["ddp"]["round_step_ms"], rows_["auto"]["round_step_ms"]
        expect = [d / a for d, a in zip(ddp, auto, strict=True)]
        assert spread["rounds"] == pytest.approx(expect)
        assert spread["min"] <= spread["median"] <= spread["max"]
        # the second round went on from the first one's engine state: 2 + 2 steps (more while
        # the closed loop re-planned), then 1 + 2 (a fresh engine would be at its step 2, and
        # would have planned again); the loop had settled before the first measured step
        details = t["details"]["hitopk:density=0.1"]
        assert details["last_step"]["step"] >= 2 + 2 + bench_step.ROUND_WARMUP + 2 - 1
        assert details["closed_loop"]["settled"] and len(details["closed_loop"]["rounds"]) >= 1

    def check_png_and_markdown():
        _, rows_ = rows()
        assert Path(tp).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert len(Path(tm).read_text().splitlines()) == 2 + len(rows_)

    def on_rank_0(check):
        """Rank 0 wrote the report: the other ranks pass its checks."""

        def run():
            if dist.get_rank() == 0:
                check()

        run.__name__ = check.__name__
        return run

    run_checks(
        check_bench_train_runs,
        on_rank_0(check_throughput_and_scaling_figures),
        on_rank_0(check_exposed_time_and_bytes_across_nodes),
        on_rank_0(check_summary_names_the_best),
        on_rank_0(check_rounds_are_interleaved_and_carry_the_state),
        on_rank_0(check_png_and_markdown),
    )


def _row(contender, step_ms, exposed_ms, sent_mb):
    """A measured row as ``bench step`` produces it (the fields derive() reads)."""
    return {"contender": contender, "step_ms": step_ms, "forward_ms": 1.0, "backward_ms": 2.0,
            "optimizer_ms": 0.5, "exposed_ms": exposed_ms, "compress_ms": None, "comm_ms": None,
            "sent_mb": sent_mb, "cable_mb": None, "compressed_buckets": "", "steps": 2}  # fmt: skip


def test_train_benchmark_summary_without_local():
    """``--contenders ddp,auto``: every figure that needs ``local`` is null in JSON and "n/a" in
    the table and the headline; the others are still computed. Hand-made rows, no run."""
    rows = [_row("ddp", 100.0, 20.0, {}), _row("auto", 80.0, 5.0, {"inter": 1.5})]
    # 2 workers x 4 samples; one worker alone takes 100 ms per step of 4 samples = 40 samples/s
    bench_train.derive(rows, world=2, per_node=1, batch=4, single_s=0.1)
    ddp, auto = rows
    assert ddp["samples_per_s"] == pytest.approx(80.0) and auto["samples_per_s"] == pytest.approx(100.0)
    assert auto["speedup_vs_ddp"] == pytest.approx(1.25)
    assert auto["scaling_factor"] == pytest.approx(100.0 / (2 * 40.0))
    assert ddp["scaling_vs_local"] is None and auto["scaling_vs_local"] is None
    summary = bench_train.summarize(rows)
    assert summary["best"] == "auto" and summary["best_over_ddp"] == pytest.approx(1.25)
    result = {"rows": rows, "summary": summary}
    again = json.loads(json.dumps(result))
    assert again["summary"]["best_scaling_vs_local"] is None
    assert [r["scaling_vs_local"] for r in again["rows"]] == [None, None]
    assert bench_train.headline(summary) == (
        "best gradsync contender auto: 1.25x DDP's samples/s, scaling factor 1.25 (vs local n/a)\n"
        "auto: 1.25x DDP"
    )
    lines = bench_train.markdown(result).splitlines()
    assert len(lines) == 4
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    split = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    cells = {row[0]: row for row in split}
    assert cells["auto"][header.index("vs local")] == "n/a"
    assert cells["auto"][header.index("scaling factor")] == "1.25"
    assert cells["ddp"][header.index("MB/worker/step across nodes")] == "n/a"  # DDP off the testbed
    assert cells["auto"][header.index("MB/worker/step across nodes")] == "1.50"
    # without DDP and without local, the headline keeps what it has
    alone = [_row("auto", 80.0, 5.0, {})]
    bench_train.derive(alone, world=2, per_node=1, batch=4, single_s=0.0)
    assert bench_train.headline(bench_train.summarize(alone)) == (
        "best gradsync contender auto: scaling factor n/a (vs local n/a)"
    )
    assert bench_train.headline(bench_train.summarize([_row("ddp", 1.0, 0.0, {})])) is None


def test_train_benchmark_against_ddp_hooks_on_two_ranks(tmp_path):
    run_world(2, train_bench, str(tmp_path))


def test_collectives_and_step_benchmarks_on_two_ranks(tmp_path):
    run_world(2, benches, str(tmp_path))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "step", "--contenders", "local,warp9"], "unknown codec 'warp9'"),
        (
            ["bench", "step", "--sync-option", "plan=always"],
            "sync: plan must be one of auto, compress, dense",
        ),
        (["bench", "step", "--sync-option", "plan"], "--sync-option takes KEY=VALUE"),
        (["bench", "step", "--warmup", "0"], "--warmup must be at least 1"),
        (["bench", "step", "--batch-size", "0"], "--batch-size must be at least 1"),
        (["bench", "step", "--nodes", "2"], "--nodes and --per-node go together"),
        (["bench", "collectives", "--schemes", "ring/"], "a compressed scheme needs /CODEC"),
        (
            ["bench", "train", "--contenders", "ddp-powersgd:rank=0"],
            "expected ddp-powersgd or ddp-powersgd:rank=R",
        ),
        (["bench", "train", "--warmup", "1"], "--warmup must be at least 2"),
        (["bench", "train", "--contenders", "outer@every=0"], "needs every >= 1"),
        (["bench", "train", "--contenders", "zeroone-adam@spin=1"], "unknown option(s) spin; allowed: lr"),
        (["bench", "train", "--contenders", "onebit-adam@freeze_step=x"], "freeze_step takes a int, got 'x'"),
        (["bench", "train", "--model", "transformer", "--dim", "30"], "--dim must be a multiple of 4"),
        (["bench", "train", "--model", "vgg", "--layers", "2"], "--layers sizes --model transformer only"),
        (["bench", "train", "--model", "transformer", "--seq-len", "0"], "--seq-len must be at least 1"),
        (["bench", "train", "--contenders", "outer@spin=1"], "unknown option(s) spin; allowed: every, codec"),
        (["bench", "train", "--emulate", "2by2"], "--emulate takes NODESxPER_NODE"),
        (
            ["bench", "train", "--emulate", "2x2", "--link", "fast"],
            "--link must be a positive rate like 100mbit",
        ),
        (["bench", "collectives", "--sizes-mb", "0"], "--sizes-mb must be positive"),
        (["bench", "train", "--contenders", ","], "--contenders must name at least one contender"),
        (["bench", "train", "--contenders", "ddp,auto,ddp"], "--contenders names 'ddp' more than once"),
        (["bench", "train", "--timeout", "0"], "--timeout must be a positive number of seconds"),
        (["bench", "train", "--timeout", "nan"], "--timeout must be a positive number of seconds"),
        (["bench", "train", "--nodes", "2"], "--nodes and --per-node go together"),
        (["bench", "train", "--nodes", "0", "--per-node", "2"], "--nodes must be at least 1"),
        (["bench", "train", "--steps", "0"], "--steps must be at least 1"),
        (["bench", "train", "--rounds", "0"], "--rounds must be at least 1"),
        (["bench", "train", "--contenders", "ddp,auto@replan=-1"], "replan"),
        (["bench", "train", "--contenders", "ddp,auto@oops"], "KEY=VALUE"),
        (["bench", "train", "--contenders", "ddp,fsdp/auto"], "'auto' plans DDP buckets"),
        (["bench", "whatif", "--contenders", "hsdp/powersgd:rank=2"], "low-rank codecs"),
        (["bench", "fsdp", "--contenders", "zero3"], "the kind must be one of hsdp, fsdp, replicate, ddp"),
        (["bench", "fsdp", "--contenders", "ddp/topk"], "ddp takes no scheme"),
        (["bench", "fsdp", "--contenders", "hsdp/"], "give a scheme after the slash"),
        (["bench", "fsdp", "--contenders", "hsdp/hitopk"], "hierarchical schemes"),
        (["bench", "fsdp", "--contenders", "hsdp,hsdp"], "--contenders names 'hsdp' more than once"),
        (["bench", "fsdp", "--dim", "30"], "--dim must be a multiple of 4"),
        (["bench", "fsdp", "--steps", "0"], "--steps must be at least 1"),
        (["bench", "fsdp", "--emulate", "2by2"], "--emulate takes NODESxPER_NODE"),
    ],
)
def test_benchmark_argument_errors_come_before_any_process_group(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_rounds_merge_and_ratios_by_hand():
    """Interleaved rounds: every other round reversed; a contender's rounds merged into medians;
    per-round ratios of two contenders with their spread. Hand-made rows, no run."""
    assert bench_train.round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert bench_train.round_order(["a", "b", "c"], 1) == ["c", "b", "a"]
    rounds = [
        bench_step.StepRow("x", step_ms=s, forward_ms=1.0, backward_ms=b, optimizer_ms=0.5, exposed_ms=e,
                           sent_mb={"inter": m}, cable_mb=None, compressed_buckets=f"{i}/4", steps=3)
        for i, (s, b, e, m) in enumerate([(10.0, 5.0, 1.0, 2.0), (30.0, 7.0, None, 4.0),
                                          (20.0, 6.0, 3.0, 3.0)])
    ]  # fmt: skip
    merged = bench_train.merge_rounds(rounds)
    assert merged.step_ms == 20.0 and merged.backward_ms == 6.0 and merged.exposed_ms == 2.0
    assert merged.sent_mb == {"inter": 3.0} and merged.cable_mb is None
    assert merged.round_step_ms == [10.0, 30.0, 20.0] and merged.steps == 9
    assert merged.mean_step_ms is None  # the rounds recorded no ranks' mean
    assert merged.compressed_buckets == "2/4"  # the last round's plan
    fast = {"round_step_ms": [10.0, 20.0, 40.0]}
    slow = {"round_step_ms": [11.0, 30.0, 40.0]}
    r = bench_train.round_ratios(fast, slow)
    assert r == {"median": pytest.approx(1.1), "min": 1.0, "max": 1.5,
                 "rounds": pytest.approx([1.1, 1.5, 1.0])}  # fmt: skip
    assert bench_train.round_ratios(fast, {"round_step_ms": [1.0]}) is None
    rows = [
        {"contender": c, "samples_per_s": 100.0 / s[1], "scaling_factor": None, "scaling_vs_local": None,
         "round_step_ms": s}
        for c, s in (("ddp", [20.0, 22.0]), ("ddp-fp16", [12.0, 10.0]), ("hitopk:density=0.01", [9.0, 11.0]),
                     ("auto", [10.0, 10.0]), ("auto:candidates=topk|powersgd", [8.0, 8.0]),
                     ("auto@replan=0", [11.0, 11.0]))
    ]  # fmt: skip
    summary = bench_train.summarize(rows)
    assert summary["best_fixed"] == "hitopk:density=0.01" and summary["best_hook"] == "ddp-fp16"
    # every automatic contender is measured against the fixed ones, never against another
    others = summary["others"]
    assert set(others) == {"auto:candidates=topk|powersgd", "auto@replan=0"}
    assert others["auto:candidates=topk|powersgd"]["auto_over_best_fixed_rounds"]["rounds"] == pytest.approx(
        [9.0 / 8.0, 11.0 / 8.0]
    )
    assert "\nauto@replan=0: " in bench_train.headline(summary)
    assert summary["auto_over_ddp_rounds"]["rounds"] == pytest.approx([2.0, 2.2])
    assert summary["auto_over_best_hook_rounds"]["rounds"] == pytest.approx([1.2, 1.0])
    assert summary["auto_over_best_fixed_rounds"]["rounds"] == pytest.approx([0.9, 1.1])
    line = bench_train.headline(summary)
    assert "auto: 2.20x DDP (per round: median 2.10, 2.00-2.20)" in line
    fixed = "1.10x the best fixed gradsync contender (hitopk:density=0.01)"
    assert f"{fixed} (per round: median 1.00, 0.90-1.10)" in line


def test_a_contender_carries_its_own_sync_options():
    """``scheme@key=value``: validated before any process group; a bad one names what is wrong."""
    assert (
        bench_step.check_contender("hierarchical@grad_as_bucket_view=true")
        == "hierarchical@grad_as_bucket_view=true"
    )
    assert bench_step.contender_options("auto@replan=0@replan_gain=0.1") == (
        "auto",
        {"replan": "0", "replan_gain": "0.1"},
    )
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bench_step.check_contender("hierarchical@oops")
    with pytest.raises(ValueError, match="no_such_option"):
        bench_step.check_contender("hierarchical@no_such_option=1")
    with pytest.raises(ValueError, match="replan"):
        bench_step.check_contender("auto@replan=-1")


def test_a_contender_list_keeps_a_codec_with_several_options_whole():
    """``--contenders`` is a comma list, and a codec's own options are comma-separated too: a
    piece ``key=value`` continues the contender before it (as ``auto:candidates=...`` does)."""
    import argparse

    from gradsync.apps.commands.bench import train as bench_train

    listed = (
        "local,ddp,topk:density=0.01,compile=false,"
        "outer@every=10@codec=sparseloco:density=0.2,bits=4+ef@fragments=4@delay=2"
    )
    parser = argparse.ArgumentParser()
    bench_train.add_arguments(parser)
    full = parser.parse_args(["--contenders", listed, "--model", "transformer"])
    bench_train.check(full)  # every contender whole, checked before any process group
    want = [
        "local",
        "ddp",
        "topk:density=0.01,compile=false",
        "outer@every=10@codec=sparseloco:density=0.2,bits=4+ef@fragments=4@delay=2",
    ]
    from gradsync.codecs.config import split_spec_list

    assert split_spec_list(listed) == want
    assert bench_step.outer_options(want[-1])["codec"] == "sparseloco:density=0.2,bits=4+ef"


def test_self_syncing_optimizers_and_outer_loops_warm_up_afresh_every_round():
    """Round after round the engine's state is carried (one unmeasured step), but a self-syncing
    optimizer is made afresh: every round skips its dense warm-up and its first compressed step
    (which allocates its buffers), so the measured steps are its steady state in every round. So
    is an outer loop: every round skips a whole period and the delay, so every fragment's first
    meeting (its outer optimizer's buffers made) and landing are unmeasured."""
    from gradsync.apps.commands.bench.step import ROUND_WARMUP, unmeasured_steps

    assert unmeasured_steps("hitopk:density=0.01", 2, later=False) == 2
    assert unmeasured_steps("hitopk:density=0.01", 2, later=True) == ROUND_WARMUP == 1
    assert unmeasured_steps("zeroone-adam", 2, later=True) == 2  # steps 1 (dense) and 2
    assert unmeasured_steps("onebit-adam@freeze_step=5", 2, later=False) == 6
    assert unmeasured_steps("zeroone-adam@var_freeze_step=8", 2, later=True) == 9
    assert unmeasured_steps("onebit-lamb", 4, later=True) == 4
    assert unmeasured_steps("outer@every=10", 2, later=False) == 10
    assert unmeasured_steps("outer@every=10@fragments=4@delay=2", 1, later=True) == 12
    assert unmeasured_steps("outer@every=2", 5, later=True) == 5
