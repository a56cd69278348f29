"""A world of one that still runs the synchronization path (``SyncConfig.rehearse``), checked
against the codec called directly, and ``gradsync bench gpu-step`` end to end on the CPU (the GPU
figures come from a GPU machine; here: that every contender runs and is reported)."""

import copy
import json
import math

import pytest
import torch
from torch import nn

import gradsync
from gradsync.apps.commands import main
from gradsync.codecs import build_codec
from gradsync.collectives.cost import CostModel
from gradsync.sync import SyncConfig
from gradsync.whatif.network import from_rates

pytestmark = pytest.mark.timeout(300)

QUIET = {"calibrate": False, "log_plan": False, "min_compress_bytes": 0}


def two_layers(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40, bias=False), nn.Tanh(), nn.Linear(40, 6, bias=False))


def backward(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 24, generator=g)
    y = torch.randint(0, 6, (16,), generator=g)
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()


def bucket_gradients(model, reference):
    """Per compressed bucket of ``model``'s plan: its gradient after the step, and the local
    gradient of the same parameters (``reference`` is an unwrapped copy), both flat in the
    bucket's order."""
    params = dict(reference.named_parameters())
    out = []
    for bucket in model.engine.layout.buckets:
        if not bucket.compress:
            continue
        got = torch.cat([s.param.grad.reshape(-1) for s in bucket.slots])
        local = torch.cat([params[s.name].grad.reshape(-1) for s in bucket.slots])
        out.append((got, local, [s.name for s in bucket.slots]))
    return out


@pytest.mark.parametrize("spec", ["topk:density=0.1", "chunktopk:density=0.1", "onebit"])
def test_rehearsal_gives_the_codec_applied_to_the_gradient(spec):
    """A world of one with rehearse: the first step is dense (the gradient as it is); the next
    ones write decode(encode(g + residual)) into the gradient, with the residual what error
    feedback kept (g == sent + residual), computed here with the codec alone."""
    base = two_layers()
    model = gradsync.wrap(copy.deepcopy(base), f"allgather/{spec}", rehearse=True, plan="compress", **QUIET)
    reference = copy.deepcopy(base)
    codec = build_codec(spec)  # a fresh one: its random state starts where the engine's did
    residuals: dict[tuple[str, ...], torch.Tensor] = {}
    try:
        for step in range(3):
            backward(model, step)
            backward(reference, step)
            if step == 0:  # dense: nothing compressed yet, the gradients are the local ones
                assert model.last_stats.dense
                for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                    assert torch.equal(a.grad, b.grad)
                continue
            pairs = bucket_gradients(model, reference)
            assert model.last_stats.compressed_buckets == len(pairs) >= 1
            owed = model.owed_gradients()
            for got, local, names in pairs:
                sent = local + residuals.get(tuple(names), 0)
                expected = codec.decode(codec.encode(sent))
                assert torch.equal(got, expected), (step, names)
                assert not torch.equal(got, sent)  # it did compress
                residuals[tuple(names)] = sent - expected
                torch.testing.assert_close(torch.cat([owed[n].reshape(-1) for n in names]), sent - expected)
    finally:
        model.close()


def test_rehearsal_runs_the_strategy_of_the_scheme():
    """Under ``ps`` (onebit's default) the owner encodes its aggregate again: with one rank the
    gradient becomes the codec applied twice, which for onebit is applied once."""
    base = two_layers(1)
    model = gradsync.wrap(
        copy.deepcopy(base), "onebit", rehearse=True, plan="compress", error_feedback=False, **QUIET
    )
    reference = copy.deepcopy(base)
    codec = build_codec("onebit")
    try:
        for step in range(2):
            backward(model, step)
            backward(reference, step)
        pairs = bucket_gradients(model, reference)
        assert pairs and model.engine.schemes[0].strategy == "ps"
        for got, local, _ in pairs:
            torch.testing.assert_close(got, codec.decode(codec.encode(local)))
            assert not torch.equal(got, local)
    finally:
        model.close()


@pytest.mark.parametrize("scheme", ["allgather/none", "flat"])
def test_rehearsing_a_lossless_scheme_leaves_the_gradients_unchanged(scheme):
    base = two_layers(2)
    model = gradsync.wrap(copy.deepcopy(base), scheme, rehearse=True, plan="compress", **QUIET)
    reference = copy.deepcopy(base)
    try:
        for step in range(3):
            backward(model, step)
            backward(reference, step)
            for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad)
            assert model.last_stats is not None and model.last_stats.buckets >= 1  # it ran
        compressed = model.last_stats.compressed_buckets  # (the first step's timing cuts the buckets)
        assert compressed >= 1 if scheme == "allgather/none" else compressed == 0
    finally:
        model.close()


def test_without_rehearse_a_world_of_one_is_untouched():
    base = two_layers(3)
    model = gradsync.wrap(copy.deepcopy(base), "allgather/topk:density=0.1", plan="compress", **QUIET)
    reference = copy.deepcopy(base)
    try:
        assert not model.engine.config.rehearse and not model.engine.active
        for step in range(2):
            backward(model, step)
            backward(reference, step)
            for a, b in zip(model.parameters(), reference.parameters(), strict=True):
                assert torch.equal(a.grad, b.grad)
        assert model.last_stats is None
    finally:
        model.close()


def test_rehearse_is_validated_and_refused_by_the_hook():
    with pytest.raises(ValueError, match="rehearse must be True or False"):
        SyncConfig(rehearse=1)
    with pytest.raises(ValueError, match="rehearse must be true or false"):
        SyncConfig.from_options({"rehearse": "maybe"})
    assert SyncConfig.from_options({"rehearse": "true"}).rehearse
    with pytest.raises(ValueError, match=r"rehearse: .*use wrap"):
        gradsync.ddp_comm_hook("topk:density=0.1", rehearse=True)


def wide(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def test_auto_takes_the_plan_it_makes_for_another_cluster():
    """``auto`` rehearsing alone plans for a world of one (free links: nothing compressed);
    ``plan_for`` on a slow cable of four nodes compresses the large weight, and ``use_plan``
    runs that plan from the next step on. A cluster with several ranks per node would run other
    strategies (local aggregation) than this engine has: refused."""
    model = gradsync.wrap(wide(), "auto", rehearse=True, replan=0, replan_trials=0, log_plan=False)
    try:
        with pytest.warns(RuntimeWarning, match="compresses nothing"):
            backward_wide(model, 0)
        assert not any(b.compress for b in model.engine.plan.buckets)
        slow = from_rates("100mbit").params
        plan = model.engine.replanner.plan_for(CostModel(slow, 4, 1))
        assert any(b.compress for b in plan.buckets)
        model.engine.use_plan(plan)
        backward_wide(model, 1)
        assert model.last_stats.compressed_buckets >= 1
        with pytest.raises(ValueError, match="a cluster of 2 x 2 would run"):
            model.engine.replanner.plan_for(CostModel(slow, 2, 2))
    finally:
        model.close()


def backward_wide(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(8, 256, generator=g)
    model.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), torch.randint(0, 4, (8,), generator=g)).backward()


def test_gpu_step_bench_on_the_cpu(tmp_path, capsys):
    """The command end to end on a small model: every contender reported with finite, positive
    times, overheads against ``local`` of the same rounds, the engine's figures for gradsync's
    rows, and auto's plan for 2 x 1 at 100 Mbit/s compressing the large tensors."""
    out = tmp_path / "g.json"
    schemes = ["topk:density=0.05", "fp16"]
    argv = ["bench", "gpu-step", "--device", "cpu", "--model", "resnet", "--image-size", "16",
            "--classes", "10", "--batch-size", "2", "--rounds", "2", "--steps", "2", "--warmup", "2",
            "--schemes", ",".join(schemes), "--baselines", "ddp,ddp-powersgd:rank=1",
            "--auto-link", "100mbit", "--auto-nodes", "2", "--json", str(out),
            "--markdown", str(tmp_path / "g.md")]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(out.read_text())
    rows = {r["contender"]: r for r in result["rows"]}
    assert list(rows) == ["local", "ddp", "ddp-powersgd:rank=1", *schemes, "auto"]
    assert result["timer"] == "perf_counter" and result["autocast"] == "none"
    assert result["auto"] == {"scheme": "auto", "nodes": 2, "per_node": 1, "link": "100mbit"}
    for name, r in rows.items():
        assert len(r["round_step_ms"]) == 2
        for v in (*r["round_step_ms"], *r["step_ms"].values()):
            assert math.isfinite(v) and v > 0, (name, r)
        s = r["step_ms"]
        assert s["min"] <= s["median"] <= s["max"]
        for key in ("overhead_ms", "overhead_pct"):
            assert all(math.isfinite(v) for v in r[key].values()), (name, key)
    local = rows["local"]["round_step_ms"]
    for r in rows.values():
        over = sorted(a - b for a, b in zip(r["round_step_ms"], local, strict=True))
        assert r["overhead_ms"]["min"] == pytest.approx(over[0])
        assert r["overhead_ms"]["max"] == pytest.approx(over[-1])
    for name in (*schemes, "auto"):
        r = rows[name]
        assert r["kind"] == "gradsync"
        assert r["engine_busy_ms"]["median"] > 0 and r["exposed_ms"]["median"] >= 0
    assert rows["topk:density=0.05"]["plan"]["compressed_buckets"] >= 1
    assert rows["auto"]["plan"]["compressed_buckets"] >= 1
    assert "auto_overhead_pct" in result["summary"]
    assert result["summary"]["powersgd_hook"] == "ddp-powersgd:rank=1"
    assert "gloo's all-reduce at world 1" in result["note"]
    assert (tmp_path / "g.md").read_text().count("\n") == len(rows) + 2
    assert "auto spends" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--warmup", "1"], "--warmup must be at least 2"),
        (["--device", "tpu"], "--device takes auto, cpu, cuda or cuda:N"),
        (["--auto-link", "fast"], "--auto-link must be a positive rate"),
        (["--auto-nodes", "1"], "--auto-nodes must be at least 2"),
        (["--baselines", "hitopk"], "--baselines takes ddp"),
        (["--schemes", "zip"], "unknown codec"),
        (["--auto-scheme", "topk"], "--auto-scheme takes auto"),
        (["--schemes", "", "--baselines", "", "--auto-link", "none"], "nothing to measure"),
    ],
)
def test_gpu_step_bench_refuses_bad_options(argv, message, capsys):
    assert main(["bench", "gpu-step", "--device", "cpu", *argv]) == 2
    assert message in capsys.readouterr().err
