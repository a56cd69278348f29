"""The embedded models: shapes, gradients, causality of the language models, the constructor
contract used by ``gradsync train`` and parameter counting."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsync.apps.models import (
    TASKS,
    LSTMLanguageModel,
    TransformerLanguageModel,
    build_model,
    build_model_for,
    model_names,
    models_for,
    parameter_count,
)

VISION_SHAPES = [(1, 8, 8), (3, 32, 32)]


def _check_grads(model: nn.Module, loss: torch.Tensor) -> None:
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None, f"{name} got no gradient"
            assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"


def test_every_model_has_one_task() -> None:
    names = [n for task in TASKS for n in models_for(task)]
    assert sorted(names) == model_names()
    assert {"vgg", "vgg-small", "resnet"} <= set(models_for("classify"))
    assert models_for("lm") == ["bert-base", "lstm", "transformer"]


@pytest.mark.parametrize("shape", VISION_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", models_for("classify"))
def test_vision_forward_backward(name: str, shape: tuple[int, int, int]) -> None:
    torch.manual_seed(0)
    model = build_model_for(name, "classify", shape, num_classes=7)
    x = torch.randn(3, *shape)
    logits = model(x)
    assert logits.shape == (3, 7)
    _check_grads(model, nn.functional.cross_entropy(logits, torch.tensor([0, 3, 6])))


@pytest.mark.parametrize("name", models_for("lm"))
def test_lm_forward_backward(name: str) -> None:
    torch.manual_seed(0)
    model = build_model_for(name, "lm", (16,), num_classes=50)
    x = torch.randint(0, 50, (2, 16))
    logits = model(x)
    assert logits.shape == (2, 16, 50)
    loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), x[:, 1:].reshape(-1))
    _check_grads(model, loss)


def test_vision_non_square_input() -> None:
    model = build_model_for("vgg-small", "classify", (1, 8, 12), num_classes=3).eval()
    assert model(torch.randn(2, 1, 8, 12)).shape == (2, 3)


@pytest.mark.parametrize(
    "model",
    [
        TransformerLanguageModel(vocab_size=40, seq_len=12, dim=32, heads=4, layers=2, ff=64),
        LSTMLanguageModel(vocab_size=40, embed=16, hidden=24, layers=2),
        LSTMLanguageModel(vocab_size=40, embed=16, hidden=24, layers=1, tie_weights=True),
    ],
    ids=["transformer", "lstm", "lstm-tied"],
)
def test_lm_is_causal(model: nn.Module) -> None:
    torch.manual_seed(1)
    model.eval()
    x = torch.randint(0, 40, (2, 12))
    with torch.no_grad():
        ref = model(x)
        for t in range(11):
            y = x.clone()
            y[:, t + 1 :] = torch.randint(0, 40, (2, 11 - t))
            y[:, t + 1] = (x[:, t + 1] + 1) % 40  # make sure the first later token really changes
            out = model(y)
            torch.testing.assert_close(out[:, : t + 1], ref[:, : t + 1], rtol=0, atol=1e-5)
            assert not torch.allclose(out[:, t + 1], ref[:, t + 1]), "later logits should see the change"


def test_transformer_rejects_long_input_and_accepts_short() -> None:
    model = TransformerLanguageModel(vocab_size=10, seq_len=8, dim=16, heads=2, layers=1, ff=32).eval()
    assert model(torch.randint(0, 10, (1, 5))).shape == (1, 5, 10)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.randint(0, 10, (1, 9)))


def test_lm_rejects_non_token_input() -> None:
    with pytest.raises(ValueError, match="integer"):
        LSTMLanguageModel(vocab_size=10, embed=8, hidden=8)(torch.zeros(1, 4))
    with pytest.raises(ValueError, match="batch, time"):
        TransformerLanguageModel(vocab_size=10, seq_len=8, dim=16, heads=2, layers=1, ff=32)(
            torch.zeros(4, dtype=torch.long)
        )


def test_lstm_tied_weights_share_the_embedding() -> None:
    model = LSTMLanguageModel(vocab_size=30, embed=8, hidden=12, layers=1, tie_weights=True)
    assert model.decoder.weight is model.embedding.weight
    untied = LSTMLanguageModel(vocab_size=30, embed=8, hidden=12, layers=1)
    # tying drops the 12 x 30 decoder matrix and adds a 12 -> 8 projection; the embedding counts once
    assert parameter_count(untied) - parameter_count(model) == 12 * 30 - 12 * 8


@pytest.mark.parametrize(
    ("name", "task", "allowed"),
    [
        ("lstm", "classify", ["resnet", "vgg", "vgg-small"]),
        ("vgg", "lm", ["lstm", "transformer"]),
        ("no-such-model", "lm", ["lstm", "transformer"]),
    ],
)
def test_build_model_for_wrong_task(name: str, task: str, allowed: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        build_model_for(name, task, (1, 8, 8) if task == "classify" else (16,), 10)
    msg = str(err.value)
    assert "--model" in msg and name in msg and task in msg
    for ok in allowed:
        assert ok in msg


def test_build_model_for_bad_task_or_shape() -> None:
    with pytest.raises(ValueError, match="classify"):
        build_model_for("vgg", "segment", (3, 32, 32), 10)
    with pytest.raises(ValueError, match="task"):
        models_for("segment")
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        build_model_for("resnet", "classify", (64,), 10)
    with pytest.raises(ValueError, match="seq_len"):
        build_model_for("lstm", "lm", (1, 8, 8), 10)


def test_build_model_keeps_working() -> None:
    assert isinstance(build_model("resnet", num_classes=4, in_channels=1), nn.Module)
    assert isinstance(build_model("lstm", vocab_size=20, embed=8, hidden=8, layers=1), LSTMLanguageModel)
    with pytest.raises(ValueError, match="available models"):
        build_model("nope")


def test_parameter_count_closed_form() -> None:
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2, bias=False))
    assert parameter_count(model) == 5 * 3 + 3 + 3 * 2
    model[0].bias.requires_grad_(False)
    assert parameter_count(model) == 5 * 3 + 3 * 2


def test_default_vgg_is_communication_heavy() -> None:
    vgg = build_model("vgg", num_classes=10)
    assert parameter_count(vgg) >= 20_000_000
    # same model through the dataset contract for CIFAR-shaped data
    assert parameter_count(build_model_for("vgg", "classify", (3, 32, 32), 10)) == parameter_count(vgg)
    head = sum(p.numel() for p in vgg.classifier.parameters())
    assert head > 0.9 * parameter_count(vgg)
