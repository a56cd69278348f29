"""gradsync.apps.models.paper: the papers' models at their real sizes. Parameter counts (built on the
``meta`` device: no memory, no time) against the reference implementations' published counts,
torchvision's parameter order, output shapes and gradients on small inputs, and the registry."""

import pytest
import torch
import torch.nn.functional as F

from gradsync.apps.models import build_model, build_model_for, models_for, parameter_count
from gradsync.apps.models.paper import BertLM, bert_base, resnet50, resnet101, vgg16


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _on_meta(factory, **kwargs):
    with torch.device("meta"):
        return factory(**kwargs)


@pytest.mark.parametrize(
    ("factory", "count", "tensors"),
    [
        (resnet50, 25_557_032, 161),  # torchvision.models.resnet50()
        (resnet101, 44_549_160, 314),  # torchvision.models.resnet101()
        (vgg16, 138_357_544, 32),  # torchvision.models.vgg16()
        (bert_base, 109_514_298, 202),  # transformers BertForMaskedLM, bert-base-uncased
    ],
)
def test_parameter_counts_of_the_reference_models(factory, count, tensors):
    model = _on_meta(factory)
    assert parameter_count(model) == count
    assert len(list(model.parameters())) == tensors


def test_counts_follow_classes_channels_and_vocabulary():
    # the fc layer: 2048 x classes + classes; the stem: 64 x 7 x 7 per input channel
    assert parameter_count(_on_meta(resnet50, num_classes=10)) == 25_557_032 - 990 * 2049
    assert parameter_count(_on_meta(resnet50, in_channels=1)) == 25_557_032 - 2 * 64 * 49
    # VGG-16's classifier does not depend on the image size (adaptive pooling to 7 x 7)
    assert parameter_count(_on_meta(vgg16, image_size=8)) == 138_357_544
    assert parameter_count(_on_meta(vgg16, num_classes=10)) == 138_357_544 - 990 * 4097
    # the word embedding is tied to the output layer: 768 + 1 (output bias) per word
    assert parameter_count(_on_meta(bert_base, vocab_size=256)) == 109_514_298 - (30522 - 256) * 769
    assert parameter_count(_on_meta(bert_base, seq_len=128)) == 109_514_298 - (512 - 128) * 768


def test_torchvision_parameter_order():
    names = [n for n, _ in _on_meta(resnet50).named_parameters()]
    assert names[:3] == ["conv1.weight", "bn1.weight", "bn1.bias"]
    assert names[3:6] == ["layer1.0.conv1.weight", "layer1.0.bn1.weight", "layer1.0.bn1.bias"]
    assert "layer1.0.downsample.0.weight" in names and "layer2.0.downsample.1.bias" in names
    assert names[-2:] == ["fc.weight", "fc.bias"]
    stages = [n.split(".")[0] for n in names if n.startswith("layer")]
    assert stages == sorted(stages)  # layer1 .. layer4 in turn
    # v1.5: the stride is on the 3 x 3 convolution of a stage's first block
    r = _on_meta(resnet50)
    assert r.layer2[0].conv1.stride == (1, 1) and r.layer2[0].conv2.stride == (2, 2)
    names = [n for n, _ in _on_meta(vgg16).named_parameters()]
    assert names[0] == "features.0.weight" and names[-4:] == [
        "classifier.3.weight", "classifier.3.bias", "classifier.6.weight", "classifier.6.bias",
    ]  # fmt: skip
    assert _on_meta(vgg16).classifier[0].weight.shape == (4096, 512 * 7 * 7)


def _backward_all(model, out, target):
    F.cross_entropy(out.flatten(0, -2), target.flatten()).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing


def test_resnet50_forward_backward_small_images():
    torch.manual_seed(0)
    model = resnet50(num_classes=10)
    x = torch.randn(2, 3, 64, 64)
    out = model(x)
    assert out.shape == (2, 10)
    _backward_all(model, out, torch.tensor([1, 2]))


def test_resnet101_forward_shape_one_channel():
    model = resnet101(num_classes=5, in_channels=1).eval()
    with torch.no_grad():
        assert model(torch.randn(1, 1, 32, 32)).shape == (1, 5)


def test_vgg16_forward_backward_small_images():
    torch.manual_seed(0)
    model = vgg16(num_classes=10, image_size=32)
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    _backward_all(model, out, torch.tensor([3, 4]))
    # fewer max-poolings for images too small for five (shapes only, on the meta device)
    with torch.device("meta"):
        tiny = vgg16(num_classes=10, image_size=8)
        assert sum(isinstance(m, torch.nn.MaxPool2d) for m in tiny.features) == 3
        assert tiny(torch.randn(1, 3, 8, 8)).shape == (1, 10)


def test_bert_base_forward_backward_and_tied_head():
    torch.manual_seed(0)
    model = bert_base(vocab_size=1000, seq_len=16)
    tokens = torch.randint(0, 1000, (2, 9))
    out = model(tokens[:, :-1])
    assert out.shape == (2, 8, 1000)
    _backward_all(model, out, tokens[:, 1:])
    # the output projection is the word embedding: no separate decoder weight
    assert not any("decoder" in n for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_bert_causal_mask():
    torch.manual_seed(0)
    model = BertLM(vocab_size=50, seq_len=8, dim=16, layers=2, heads=2, ff=32, causal=True).eval()
    a = torch.randint(0, 50, (1, 8))
    b = a.clone()
    b[0, -1] = (a[0, -1] + 1) % 50  # change the last token only
    with torch.no_grad():
        torch.testing.assert_close(model(a)[:, :-1], model(b)[:, :-1])
        model.causal = False  # BERT's bidirectional attention: earlier positions see it
        assert not torch.allclose(model(a)[:, :-1], model(b)[:, :-1])


def test_registry():
    assert {"resnet50", "resnet101", "vgg16"} <= set(models_for("classify"))
    assert "bert-base" in models_for("lm")
    with torch.device("meta"):
        r = build_model_for("resnet50", "classify", (3, 224, 224), 1000)
        v = build_model_for("vgg16", "classify", (3, 224, 224), 1000)
        b = build_model_for("bert-base", "lm", (512,), 30522)
        assert parameter_count(build_model("resnet101")) == 44_549_160
    assert parameter_count(r) == 25_557_032
    assert parameter_count(v) == 138_357_544
    assert parameter_count(b) == 109_514_298
    assert isinstance(b, BertLM) and b.causal  # next-token training needs the mask
    with pytest.raises(ValueError, match="it is a 'lm' model"):
        build_model_for("bert-base", "classify", (3, 32, 32), 10)
    with torch.device("meta"):  # shapes only: the meta device computes no values
        small = build_model_for("vgg16", "classify", (1, 8, 8), 4)
        assert small(torch.randn(1, 1, 8, 8)).shape == (1, 4)


def test_profile_command_line(tmp_path, capsys):
    from gradsync.apps.commands import main
    from gradsync.observe.profile_format import Profile

    out = tmp_path / "p.json"
    argv = ["profile", "--model", "resnet50", "--batch-size", "2", "--image-size", "32"]
    argv += ["--classes", "1000", "--steps", "1", "--warmup", "0", "--threads", "1", "--no-overhead"]
    argv += ["--out", str(out)]
    assert main(argv) == 0
    profile = Profile.load(str(out))
    assert len(profile.parameters) == 161 and all(p.ready is not None for p in profile.parameters)
    assert sum(p.bytes for p in profile.parameters) == 4 * 25_557_032
    assert profile.meta["classes"] == 1000
    # the vocabulary is a language-model option, the classes an image-model one, both at least 1
    assert main(["profile", "--model", "bert-base", "--classes", "1000"]) == 2
    assert "--classes applies to image models" in capsys.readouterr().err
    assert main(["profile", "--model", "vgg16", "--vocab-size", "30522"]) == 2
    assert "--vocab-size applies to language models" in capsys.readouterr().err
    assert main(["profile", "--model", "bert-base", "--vocab-size", "0"]) == 2
    assert "--vocab-size must be at least 1" in capsys.readouterr().err
