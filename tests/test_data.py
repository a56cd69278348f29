"""gradsync.apps.data: datasets from --data specs, the sharded sampler and the prefetching loader.

References are built independently of the code under test: raw sklearn digits, the raw pydoc text,
Pillow reading the files we wrote, bytes written with numpy, torch's DistributedSampler, and batches
collated by hand.
"""

from __future__ import annotations

import gc
import itertools
import math
import struct
import sys
import threading
import time
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DistributedSampler

from gradsync.apps.data import (
    DataBundle,
    PrefetchLoader,
    ShardedSampler,
    build_data,
    data_names,
    parse_data_spec,
)

# ---------------------------------------------------------------------------------------------- helpers


def stack(ds, indices=None):
    indices = range(len(ds)) if indices is None else indices
    items = [ds[i] for i in indices]
    return torch.stack([x for x, _ in items]), torch.stack([y for _, y in items])


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == "gradsync-prefetch" and t.is_alive()]


def wait_no_prefetch_threads(timeout=5.0):
    deadline = time.monotonic() + timeout
    while prefetch_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return prefetch_threads()


def test_data_names():
    assert data_names() == sorted(
        ["digits", "text", "synthetic-images", "synthetic-text", "imagefolder", "tokens"]
    )


# ---------------------------------------------------------------------------------------------- digits


@pytest.fixture(scope="module")
def digits():
    return build_data("digits", seed=0)


def test_digits_shapes_and_types(digits):
    assert isinstance(digits, DataBundle)
    assert digits.task == "classify" and digits.num_classes == 10 and digits.input_shape == (1, 8, 8)
    x, y = digits.train[0]
    assert x.shape == (1, 8, 8) and x.dtype == torch.float32
    assert y.shape == () and y.dtype == torch.int64
    assert len(digits.train) + len(digits.val) == 1797
    assert 0.18 < len(digits.val) / 1797 < 0.22
    assert "BSD" in digits.source and len(digits.fingerprint) >= 8
    int(digits.fingerprint, 16)


def test_digits_split_is_a_partition_of_the_raw_images(digits):
    from sklearn.datasets import load_digits

    raw = load_digits()
    xt, yt = stack(digits.train)
    xv, yv = stack(digits.val)
    # training inputs are standardized
    assert abs(float(xt.mean())) < 1e-4 and abs(float(xt.std()) - 1) < 1e-3
    # undo the affine map: the smallest value is pixel 0 and the largest pixel 16 (both occur)
    allx = torch.cat([xt, xv])
    lo, hi = float(allx.min()), float(allx.max())
    pixels = (allx - lo) / (hi - lo) * 16
    assert torch.allclose(pixels, pixels.round(), atol=1e-3)
    got = Counter(
        (bytes(p.round().to(torch.uint8).flatten().tolist()), int(y))
        for p, y in zip(pixels, torch.cat([yt, yv]), strict=True)
    )
    want = Counter(
        (bytes(img.astype(np.uint8).flatten().tolist()), int(t))
        for img, t in zip(raw.images, raw.target, strict=True)
    )
    assert got == want  # every raw image exactly once, with its label
    assert set(yt.tolist()) == set(range(10)) and set(yv.tolist()) == set(range(10))
    for c in range(10):  # stratified: each class ~20% in val
        n_c = int((raw.target == c).sum())
        assert abs(int((yv == c).sum()) - 0.2 * n_c) <= 1.5


def test_digits_deterministic_by_seed(digits):
    again = build_data("digits", seed=0)
    other = build_data("digits", seed=1)
    assert again.fingerprint == digits.fingerprint != other.fingerprint
    assert torch.equal(stack(again.val)[0], stack(digits.val)[0])
    assert not torch.equal(stack(other.val)[1], stack(digits.val)[1])


# ---------------------------------------------------------------------------------------------- text


def raw_pydoc_bytes():
    from pydoc_data.topics import topics

    return "".join(topics[k] for k in sorted(topics)).encode("utf-8")


def test_text_windows_are_the_corpus_bytes_shifted_by_one():
    seq_len = 48
    b = build_data("text", seq_len=seq_len)
    raw = raw_pydoc_bytes()
    assert b.task == "lm" and b.num_classes == 256 and b.input_shape == (seq_len,)
    assert "PSF" in b.source
    n_train, n_val = len(b.train), len(b.val)
    assert n_train > 1000 and n_val > 100
    for i in [0, 1, 17, n_train - 1]:
        x, y = b.train[i]
        assert x.dtype == torch.int64 and x.shape == (seq_len,)
        assert bytes(x.tolist()) == raw[i * seq_len : (i + 1) * seq_len]
        assert bytes(y.tolist()) == raw[i * seq_len + 1 : (i + 1) * seq_len + 1]
    # validation: the last ~10% of the stream, consecutive windows there, after all training targets
    split = len(raw) - n_val * seq_len - 1
    first_val = bytes(b.val[0][0].tolist())
    start = raw.find(first_val, int(0.85 * len(raw)))
    assert start >= (n_train * seq_len + 1) and abs(start - 0.9 * len(raw)) <= seq_len
    assert split >= start - seq_len
    for j in [0, n_val - 1]:
        x, y = b.val[j]
        assert bytes(x.tolist()) == raw[start + j * seq_len : start + (j + 1) * seq_len]
        assert bytes(y.tolist()) == raw[start + j * seq_len + 1 : start + (j + 1) * seq_len + 1]


def test_text_without_pydoc_data(monkeypatch):
    monkeypatch.setitem(sys.modules, "pydoc_data.topics", None)
    with pytest.raises(ValueError, match="pydoc_data"):
        build_data("text")


# ---------------------------------------------------------------------------------------------- synthetic

SMALL_IMAGES = "synthetic-images:n=240,size=8,channels=2,classes=4"


def test_synthetic_images_deterministic_and_seeded():
    a, b, c = (build_data(SMALL_IMAGES, seed=s) for s in (3, 3, 4))
    assert a.input_shape == (2, 8, 8) and a.num_classes == 4 and a.task == "classify"
    assert len(a.train) + len(a.val) == 240 and len(a.val) == 24
    xa, ya = stack(a.train)
    xb, yb = stack(b.train)
    xc, _ = stack(c.train)
    assert xa.dtype == torch.float32 and ya.dtype == torch.int64 and xa.shape == (216, 2, 8, 8)
    assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.allclose(xa, xc)
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert torch.equal(a.train[5][0], a.train[5][0])  # the same item every time
    assert not torch.allclose(a.train[0][0], a.val[0][0])
    global_state = torch.random.get_rng_state()
    build_data(SMALL_IMAGES, seed=9).train[0]
    assert torch.equal(global_state, torch.random.get_rng_state())  # global RNG untouched


def test_synthetic_images_are_learnable():
    b = build_data(SMALL_IMAGES, seed=0)
    x, y = stack(b.train)
    means = torch.stack([x[y == c].mean(0) for c in range(4)]).flatten(1)
    assert torch.cdist(means, means)[~torch.eye(4, dtype=torch.bool)].min() > 3.0  # classes differ
    xv, yv = stack(b.val)
    predicted = torch.cdist(xv.flatten(1), means).argmin(1)  # nearest class mean
    assert (predicted == yv).float().mean() > 0.9


def test_synthetic_images_noise_sets_the_spread_around_the_class_pattern():
    quiet, default, loud = (build_data(f"{SMALL_IMAGES},noise={n}", seed=0) for n in ("0", "1.0", "4"))
    assert default.fingerprint == build_data(SMALL_IMAGES, seed=0).fingerprint  # the default is unchanged
    assert len({quiet.fingerprint, default.fingerprint, loud.fingerprint}) == 3
    xq, yq = stack(quiet.train)
    xl, yl = stack(loud.train)
    assert torch.equal(yq, yl)
    # noise 0: every image is its class pattern; noise 4: the pattern plus noise of std 4
    for c in range(4):
        assert torch.equal(xq[yq == c], xq[yq == c][:1].expand_as(xq[yq == c]))
    spread = (xl - xq).std().item()
    assert 3.8 < spread < 4.2
    assert "noise of std 4.0" in loud.source


def test_synthetic_images_large_shape_is_lazy():
    b = build_data("synthetic-images:n=20,size=224,classes=1000")
    x, y = b.train[3]
    assert x.shape == (3, 224, 224) and 0 <= int(y) < 1000


def test_synthetic_text():
    a = build_data("synthetic-text:n=20000,vocab=1000", seq_len=16, seed=1)
    b = build_data("synthetic-text:n=20000,vocab=1000", seq_len=16, seed=1)
    c = build_data("synthetic-text:n=20000,vocab=1000", seq_len=16, seed=2)
    assert a.num_classes == 1000 and a.input_shape == (16,) and a.task == "lm"
    xa, ya = stack(a.train)
    assert torch.equal(xa, stack(b.train)[0]) and not torch.equal(xa, stack(c.train)[0])
    assert int(xa.max()) < 1000 and xa.dtype == torch.int64
    assert torch.equal(xa[:, 1:], ya[:, :-1])
    assert torch.equal(ya[:-1, -1], xa[1:, 0])  # consecutive windows of one stream
    # learnable: every token is followed by a handful of tokens only
    stream = torch.cat([xa.flatten(), ya[-1, -1:]]).tolist()
    followers: dict[int, set[int]] = {}
    for prev, nxt in itertools.pairwise(stream):
        followers.setdefault(prev, set()).add(nxt)
    assert max(len(s) for s in followers.values()) <= 8


# ---------------------------------------------------------------------------------------------- imagefolder

COLORS = {"zebra": (250, 10, 10), "ant": (10, 200, 30), "moth": (20, 40, 230)}


def write_image_folder(root, per_class=10, grey_class="moth"):
    for name, color in COLORS.items():
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(per_class):
            w, h = 6 + 3 * i, 20 - i  # assorted sizes
            if name == grey_class and i == 0:
                Image.new("L", (w, h), 77).save(folder / f"img{i}.png")
            else:
                Image.new("RGB", (w, h), color).save(folder / f"img{i}.png")
        (folder / "notes.txt").write_text("not an image")


def test_imagefolder_labels_shapes_values(tmp_path):
    write_image_folder(tmp_path)
    b = build_data(f"imagefolder:{tmp_path},size=8", seed=0)
    assert b.task == "classify" and b.num_classes == 3 and b.input_shape == (3, 8, 8)
    assert len(b.train) + len(b.val) == 30 and len(b.val) == 3
    classes = sorted(COLORS)  # ant, moth, zebra
    seen_grey = False
    for ds in (b.train, b.val):
        for i in range(len(ds)):
            x, y = ds[i]
            assert x.shape == (3, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
            pixels = (x * ds.std[:, None, None] + ds.mean[:, None, None]) * 255
            rgb = tuple(pixels.mean((1, 2)).round().int().tolist())
            assert torch.allclose(pixels, pixels.mean((1, 2), keepdim=True), atol=1e-3)
            if rgb == (77, 77, 77):
                seen_grey = True
                assert classes[int(y)] == "moth"
            else:
                assert rgb == COLORS[classes[int(y)]]
    assert seen_grey
    assert set(stack(b.val)[1].tolist()) == {0, 1, 2}  # stratified split
    assert build_data(f"imagefolder:{tmp_path},size=8", seed=0).fingerprint == b.fingerprint
    assert build_data(f"imagefolder:{tmp_path},size=9", seed=0).fingerprint != b.fingerprint


def test_imagefolder_resize_matches_pillow(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    rng = np.random.default_rng(0)
    arrays = {}
    for cls in "ab":
        for i in range(5):
            arr = rng.integers(0, 256, (13 + i, 21, 3), dtype=np.uint8)
            path = tmp_path / cls / f"{i}.png"
            Image.fromarray(arr).save(path)
            arrays[str(path)] = arr
    b = build_data(f"imagefolder:{tmp_path},size=16", seed=0)
    ds = b.train
    for i in range(len(ds)):
        x, y = ds[i]
        path = ds.files[i].path
        assert "ab"[int(y)] == path.parent.name
        want = np.asarray(Image.open(path).convert("RGB").resize((16, 16), Image.Resampling.BILINEAR))
        want = torch.from_numpy(want.copy()).permute(2, 0, 1).float() / 255
        got = x * ds.std[:, None, None] + ds.mean[:, None, None]
        assert torch.allclose(got, want, atol=1e-5)
    # the normalization makes the training pixels roughly zero-mean, unit-std per channel
    xt = stack(ds)[0]
    assert xt.mean((0, 2, 3)).abs().max() < 0.05 and (xt.std((0, 2, 3)) - 1).abs().max() < 0.05


def test_imagefolder_greyscale_and_channels_option(tmp_path):
    for cls in ("x", "y"):
        (tmp_path / cls).mkdir()
        for i in range(5):
            Image.new("L", (9, 9), 40 * i + (cls == "y") * 10).save(tmp_path / cls / f"{i}.bmp")
    grey = build_data(f"imagefolder:{tmp_path}")
    assert grey.input_shape == (1, 32, 32) and grey.train[0][0].shape == (1, 32, 32)
    rgb = build_data(f"imagefolder:{tmp_path},channels=3,size=4")
    assert rgb.input_shape == (3, 4, 4) and rgb.train[0][0].shape == (3, 4, 4)


def test_imagefolder_train_val_folders(tmp_path):
    for split, count in (("train", 4), ("val", 2)):
        for cls, color in (("cat", (255, 0, 0)), ("dog", (0, 0, 255))):
            folder = tmp_path / split / cls
            folder.mkdir(parents=True)
            for i in range(count):
                Image.new("RGB", (5 + i, 7), color).save(folder / f"{i}.jpg")
    b = build_data(f"imagefolder:{tmp_path},size=6")
    assert len(b.train) == 8 and len(b.val) == 4 and b.num_classes == 2
    assert sorted(stack(b.val)[1].tolist()) == [0, 0, 1, 1]
    assert all(f.path.parts[-3] == "val" for f in b.val.files)
    # a validation class the training folder lacks
    (tmp_path / "val" / "cow").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "val" / "cow" / "0.png")
    with pytest.raises(ValueError, match="cow"):
        build_data(f"imagefolder:{tmp_path}")


def test_imagefolder_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        build_data(f"imagefolder:{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="no class sub-folders"):
        build_data(f"imagefolder:{tmp_path}")
    write_image_folder(tmp_path / "data", per_class=3)
    (tmp_path / "data" / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty.*no images"):
        build_data(f"imagefolder:{tmp_path / 'data'}")
    (tmp_path / "data" / "empty").rmdir()
    (tmp_path / "data" / "ant" / "broken.png").write_bytes(b"\x89PNG but not really")

    def load_everything():
        b = build_data(f"imagefolder:{tmp_path / 'data'},size=4")
        for ds in (b.train, b.val):
            for i in range(len(ds)):
                ds[i]

    with pytest.raises(ValueError, match=r"broken\.png"):
        load_everything()


# ---------------------------------------------------------------------------------------------- tokens


def test_tokens_text_file(tmp_path):
    text = "Grüße, données — 数据. " * 200
    path = tmp_path / "corpus.txt"
    path.write_text(text, encoding="utf-8")
    raw = text.encode("utf-8")
    b = build_data(f"tokens:{path}", seq_len=20)
    assert b.num_classes == 256 and b.task == "lm"
    for i in [0, len(b.train) - 1]:
        x, y = b.train[i]
        assert bytes(x.tolist()) == raw[20 * i : 20 * i + 20]
        assert bytes(y.tolist()) == raw[20 * i + 1 : 20 * i + 21]
    assert len(b.val) >= 1


def test_tokens_bin_file(tmp_path):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 5000, 3000)
    ids[7] = 4999
    path = tmp_path / "train,v2.bin"  # a comma in the path too
    np.array(ids, dtype="<u2").tofile(path)
    assert struct.unpack("<H", path.read_bytes()[14:16])[0] == 4999  # little-endian on disk
    b = build_data(f"tokens:{path}", seq_len=32)
    assert b.num_classes == 5000
    xt, yt = stack(b.train)
    n = len(b.train) * 32
    assert torch.equal(xt.flatten(), torch.as_tensor(ids[:n], dtype=torch.int64))
    assert torch.equal(yt.flatten(), torch.as_tensor(ids[1 : n + 1], dtype=torch.int64))
    start = len(ids) - len(b.val) * 32 - 1
    assert start >= n + 1 - 32
    assert build_data(f"tokens:{path},vocab=6000", seq_len=32).num_classes == 6000
    with pytest.raises(ValueError, match="vocab"):
        build_data(f"tokens:{path},vocab=4999")


def test_tokens_errors(tmp_path):
    short = tmp_path / "short.bin"
    np.arange(50, dtype="<u2").tofile(short)
    with pytest.raises(ValueError, match="too few"):
        build_data(f"tokens:{short}", seq_len=64)
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        build_data(f"tokens:{empty}")
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(ValueError, match="odd"):
        build_data(f"tokens:{odd}")
    with pytest.raises(ValueError, match="does not exist"):
        build_data(f"tokens:{tmp_path / 'nope.bin'}")


# ---------------------------------------------------------------------------------------------- bad specs


@pytest.mark.parametrize(
    ("spec", "kwargs", "needle"),
    [
        ("", {}, "--data"),
        ("mnist", {}, "--data"),
        ("digits:seed=1", {}, "seed"),
        ("synthetic-images:colour=3", {}, "colour"),
        ("synthetic-images:n=abc", {}, "option n "),
        ("synthetic-images:size=0", {}, "option size"),
        ("synthetic-images:classes=1", {}, "option classes"),
        ("synthetic-images:noise=-0.5", {}, "option noise must be a finite number >= 0"),
        ("synthetic-images:noise=inf", {}, "option noise"),
        ("synthetic-images:noise=loud", {}, "option noise"),
        ("synthetic-images:channels", {}, "key=value"),
        ("synthetic-images:n=10,n=20", {}, "option n"),
        ("synthetic-text:vocab=70000", {}, "option vocab"),
        ("synthetic-text:n=-5", {}, "option n"),
        ("imagefolder:", {}, "path"),
        ("imagefolder:/tmp/x,channels=2", {}, "option channels"),
        ("imagefolder:/tmp/x,depth=2", {}, "depth"),
        ("tokens:/tmp/x.bin,vocab=0", {}, "option vocab"),
        ("text", {"seq_len": 0}, "seq_len"),
        ("digits", {"seed": "1"}, "seed"),
    ],
)
def test_bad_specs(spec, kwargs, needle):
    with pytest.raises(ValueError) as info:
        build_data(spec, **kwargs)
    assert needle in str(info.value)
    if not kwargs:
        assert "--data" in str(info.value)


def test_negative_seed_is_fine():
    assert len(build_data(SMALL_IMAGES, seed=-3).train) == 216
    sampler = ShardedSampler(10, 0, 1, seed=-3)
    assert sorted(sampler) == list(range(10))


def test_unknown_name_lists_the_forms():
    with pytest.raises(ValueError) as info:
        build_data("imagenet")
    for form in ("digits", "text", "synthetic-images[", "imagefolder:PATH", "tokens:PATH"):
        assert form in str(info.value)


def test_parse_spec_path_with_options():
    assert parse_data_spec("imagefolder:/data/a,b/c,size=64") == (
        "imagefolder",
        "/data/a,b/c",
        {"size": 64, "channels": None},
    )
    assert parse_data_spec("synthetic-text") == ("synthetic-text", None, {"n": 1 << 19, "vocab": 256})


# ---------------------------------------------------------------------------------------------- sampler


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [True, False])
def test_sharded_sampler_matches_distributed_sampler(shuffle, drop_last):
    for length in (0, 1, 7, 10):
        for world in (1, 2, 3, 4):
            for epoch in (0, 1):
                shards = []
                for rank in range(world):
                    ours = ShardedSampler(length, rank, world, shuffle=shuffle, seed=7, drop_last=drop_last)
                    ref = DistributedSampler(
                        range(length),
                        num_replicas=world,
                        rank=rank,
                        shuffle=shuffle,
                        seed=7,
                        drop_last=drop_last,
                    )
                    ours.set_epoch(epoch)
                    ref.set_epoch(epoch)
                    assert len(ours) == ref.num_samples
                    assert list(ours) == list(ref)
                    shards.append(list(ours))
                sizes = {len(s) for s in shards}
                assert len(sizes) == 1  # equal counts on every rank
                flat = [i for s in shards for i in s]
                if drop_last:
                    assert len(flat) == (length // world) * world and len(set(flat)) == len(flat)
                else:
                    assert set(flat) == set(range(length))  # every index somewhere
                    assert len(flat) == math.ceil(length / world) * world
                if length % world == 0:
                    assert len(set(flat)) == len(flat)  # disjoint


def test_sharded_sampler_epochs():
    a = [ShardedSampler(50, r, 2, seed=3) for r in range(2)]
    b = [ShardedSampler(50, r, 2, seed=3) for r in range(2)]
    assert [list(s) for s in a] == [list(s) for s in b]  # every rank agrees on the permutation
    first = [list(s) for s in a]
    for s in a:
        s.set_epoch(1)
    second = [list(s) for s in a]
    assert first != second
    assert sorted(first[0] + first[1]) == sorted(second[0] + second[1]) == list(range(50))
    assert list(ShardedSampler(5, 0, 1, shuffle=False)) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"length": 10, "rank": 2, "world": 2}, "rank"),
        ({"length": 10, "rank": -1, "world": 2}, "rank"),
        ({"length": 10, "rank": 0, "world": 0}, "world"),
        ({"length": -1, "rank": 0, "world": 1}, "length"),
    ],
)
def test_sharded_sampler_validation(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        ShardedSampler(**kwargs)


# ---------------------------------------------------------------------------------------------- loader


class Squares(torch.utils.data.Dataset):
    def __init__(self, n, fail_at=None, delay=0.0):
        self.n, self.fail_at, self.delay = n, fail_at, delay

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.fail_at:
            raise KeyError(f"item {i} is cursed")
        if self.delay:
            time.sleep(self.delay)
        return torch.tensor([float(i), float(i * i)]), torch.tensor(i % 3)


def reference_batches(dataset, order, batch_size, drop_last):
    out = []
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        if drop_last and len(chunk) < batch_size:
            break
        out.append(
            (
                torch.stack([torch.tensor([float(i), float(i * i)]) for i in chunk]),
                torch.tensor([i % 3 for i in chunk]),
            )
        )
    return out


@pytest.mark.parametrize("drop_last", [True, False])
def test_prefetch_loader_matches_plain_loop(drop_last):
    ds = Squares(23)
    sampler = ShardedSampler(len(ds), 1, 2, seed=4)
    sampler.set_epoch(2)
    loader = PrefetchLoader(ds, sampler, 5, drop_last=drop_last, depth=2)
    want = reference_batches(ds, list(sampler), 5, drop_last)
    got = list(loader)
    assert len(loader) == len(want) == (2 if drop_last else 3)
    assert len(got) == len(want)
    for (gx, gy), (wx, wy) in zip(got, want, strict=True):
        assert torch.equal(gx, wx) and torch.equal(gy, wy) and gy.dtype == torch.int64
    resumed = list(loader.iter_from(1))
    assert len(resumed) == len(want) - 1
    for (gx, _), (wx, _) in zip(resumed, want[1:], strict=True):
        assert torch.equal(gx, wx)
    assert list(loader.iter_from(10)) == []
    sampler.set_epoch(3)
    assert not torch.equal(next(iter(loader))[0], got[0][0])
    assert not wait_no_prefetch_threads()


def test_prefetch_loader_propagates_errors():
    loader = PrefetchLoader(Squares(20, fail_at=13), range(20), 4)
    batches = []
    with pytest.raises(KeyError, match="cursed"):
        for batch in loader:
            batches.append(batch)
    assert len(batches) == 3
    assert not wait_no_prefetch_threads()


def test_prefetch_loader_early_break_stops_thread():
    loader = PrefetchLoader(Squares(400, delay=0.001), range(400), 2, depth=2)
    for i, _ in enumerate(loader):
        if i == 2:
            time.sleep(0.05)  # let the producer fill the queue and block on it
            assert prefetch_threads()
            break
    assert not wait_no_prefetch_threads()
    it = iter(loader)  # an abandoned iterator
    next(it)
    del it
    gc.collect()
    assert not wait_no_prefetch_threads()


def test_prefetch_loader_validation():
    with pytest.raises(ValueError, match="batch_size"):
        PrefetchLoader(Squares(3), range(3), 0)
    with pytest.raises(ValueError, match="depth"):
        PrefetchLoader(Squares(3), range(3), 1, depth=0)
    with pytest.raises(ValueError, match="skip"):
        PrefetchLoader(Squares(3), range(3), 1).iter_from(-1)


def test_loader_over_a_real_bundle():
    b = build_data("synthetic-text:n=5000", seq_len=8)
    sampler = ShardedSampler(len(b.train), 0, 2, seed=0)
    x, y = next(iter(PrefetchLoader(b.train, sampler, 16)))
    assert x.shape == y.shape == (16, 8) and x.dtype == torch.int64
    assert not wait_no_prefetch_threads()
