"""The codec contract, checked for every registered codec."""

import math

import pytest
import torch

import gradsync
from gradsync.codecs import HEADER_BYTES, EncodeContext

SPECS = {
    "none": "none",
    "fp16": "fp16",
    "bf16": "bf16",
    "topk": "topk:density=0.05",
    "chunktopk": "chunktopk:density=0.05,chunk=64",
    "sparseloco": "sparseloco:density=0.05,chunk=64",
    "mstopk": "mstopk:density=0.05",
    "trimmed_topk": "trimmed_topk:density=0.05",
    "bsearch": "bsearch:density=0.05",
    "dgc": "dgc:density=0.05",
    "graddrop": "graddrop:density=0.05",
    "randomk": "randomk:density=0.05",
    "qrgc": "qrgc:density=0.05",
    "onebit": "onebit",
    "tbq": "tbq:threshold=0.5",
    "terngrad": "terngrad",
    "powersgd": "powersgd:rank=2",
}
FIXED_SIZE = {
    "none",
    "chunktopk",
    "sparseloco",
    "fp16",
    "bf16",
    "topk",
    "mstopk",
    "trimmed_topk",
    "randomk",
    "qrgc",
    "onebit",
    "tbq",
    "terngrad",
    "powersgd",
}


def test_every_codec_is_covered():
    assert sorted(SPECS) == gradsync.codec_names()


@pytest.fixture(params=sorted(SPECS))
def spec(request):
    return SPECS[request.param]


@pytest.mark.parametrize("shape", [(1000,), (64, 33), (8, 4, 5, 5), (1,), (0,), (3, 0)])
def test_payload_is_one_uint8_tensor_of_the_estimated_size(backend, spec, shape):
    codec = gradsync.build_codec(spec)
    x = torch.randn(shape)
    p = codec.encode(x)
    assert isinstance(p.data, torch.Tensor) and p.data.dtype == torch.uint8 and p.data.dim() == 1
    assert p.nbytes >= HEADER_BYTES
    n = x.numel()
    if codec.name in FIXED_SIZE:
        assert p.nbytes == codec.estimate_nbytes(n, shape)
    assert p.nbytes == codec.payload_nbytes(p) <= codec.max_nbytes(n, shape)
    y = codec.decode(p)
    assert y.shape == x.shape and y.dtype == x.dtype and not y.isnan().any()


def test_encode_into_a_reused_buffer(backend, spec):
    codec = gradsync.build_codec(spec)
    x = torch.randn(50, 40)
    buf = torch.empty(codec.max_nbytes(x.numel(), x.shape) + 100, dtype=torch.uint8)
    p = codec.encode(x, out=buf)
    assert p.data.data_ptr() == buf.data_ptr()
    ref = gradsync.build_codec(spec)
    assert torch.equal(p.data, ref.encode(x).data)
    with pytest.raises(ValueError, match="needs"):
        gradsync.build_codec(spec).encode(x, out=torch.empty(HEADER_BYTES, dtype=torch.uint8))


def test_decode_into_and_accumulate(backend, spec):
    codec = gradsync.build_codec(spec)
    x = torch.randn(30, 30)
    p = codec.encode(x)
    y = codec.decode(p)
    out = torch.full((30, 30), 7.0)
    assert codec.decode(p, out=out) is out
    assert torch.equal(out, y)
    base = torch.randn(30, 30)
    acc = base.clone()
    codec.decode(p, out=acc, accumulate=True)
    torch.testing.assert_close(acc, base + y)
    with pytest.raises(ValueError, match="out must be a contiguous tensor of shape"):
        codec.decode(p, out=torch.empty(900))


def test_peer_bytes_round_trip_and_corrupt_headers_are_rejected(backend, spec):
    codec = gradsync.build_codec(spec)
    x = torch.randn(2000)
    p = codec.encode(x)
    q = codec.payload_from_bytes(p.data.clone(), p.shape, p.dtype)
    assert torch.equal(codec.decode(q), codec.decode(p))
    with pytest.raises(ValueError):
        codec.payload_from_bytes(p.data[:-8].clone(), p.shape, p.dtype)
    with pytest.raises(ValueError, match="cannot decode a payload made by"):
        gradsync.build_codec("none" if codec.name != "none" else "fp16").decode(p)


def test_sparse_payload_with_corrupt_indices_is_caught(backend):
    codec = gradsync.build_codec("topk:k=5")
    p = codec.encode(torch.randn(100))
    data = p.data.clone()
    idx = codec.sparse_view(codec.payload_from_bytes(data, p.shape, p.dtype))[0]
    idx[2] = 100  # one past the end
    bad = codec.payload_from_bytes(data, p.shape, p.dtype)
    with pytest.raises(IndexError, match="sparse index 100 is outside a tensor of 100 elements"):
        codec.decode(bad)


def test_numel_one_and_constant_tensors(backend, spec):
    codec = gradsync.build_codec(spec)
    for x in (torch.tensor([2.5]), torch.full((5000,), 0.75), torch.full((5000,), -3.0)):
        y = codec.decode(codec.encode(x))
        assert not y.isnan().any() and not y.isinf().any()
        assert float(y.abs().max()) <= float(x.abs().max()) * 1.01 + 1e-6 or codec.name == "randomk"


def test_all_zero_gradient(backend, spec):
    codec = gradsync.build_codec(spec)
    y = codec.decode(codec.encode(torch.zeros(64, 65)))
    assert not y.isnan().any() and y.abs().sum() == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nonfinite_input_is_reported_not_hidden(backend, spec, bad):
    codec = gradsync.build_codec(spec)
    x = torch.randn(64, 65)
    x[3, 7] = bad
    p = codec.encode(x)
    assert p.nonfinite
    y = codec.decode(p)
    assert not torch.isfinite(y).all()  # a GradScaler checking the gradient will skip the step


def test_non_contiguous_and_channels_last_inputs(backend, spec):
    x = torch.randn(6, 8, 5, 7)
    variants = [
        x.to(memory_format=torch.channels_last),
        x.transpose(1, 3).contiguous().transpose(1, 3),
        x[:, :, :, :],
    ]
    want = gradsync.build_codec(spec).decode(gradsync.build_codec(spec).encode(x))
    for v in variants:
        assert torch.equal(v, x)
        codec = gradsync.build_codec(spec)
        y = codec.decode(codec.encode(v))
        assert y.is_contiguous() and torch.equal(y, want)
    strided = torch.randn(100, 2)[:, 0]
    codec = gradsync.build_codec(spec)
    assert torch.equal(
        codec.decode(codec.encode(strided)),
        gradsync.build_codec(spec).decode(gradsync.build_codec(spec).encode(strided.contiguous())),
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes(backend, spec, dtype):
    codec = gradsync.build_codec(spec)
    x = torch.randn(40, 50).to(dtype)
    p = codec.encode(x)
    y = codec.decode(p)
    assert y.dtype == dtype and y.shape == x.shape
    ref_codec = gradsync.build_codec(spec)
    ref = ref_codec.decode(ref_codec.encode(x.float()))
    tol = {torch.float16: 5e-2, torch.bfloat16: 5e-2, torch.float64: 1e-5}[dtype]
    if codec.name not in (
        "terngrad",
        "randomk",
        "mstopk",
        "dgc",
        "graddrop",
        "bsearch",
    ):  # data-dependent choices
        torch.testing.assert_close(y.float(), ref, rtol=tol, atol=tol * float(x.abs().max()))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.complex64])
def test_integer_bool_and_complex_tensors_get_a_clear_error(spec, dtype):
    codec = gradsync.build_codec(spec)
    x = torch.ones(10, dtype=dtype)
    if codec.name == "none" and dtype != torch.complex64:
        assert torch.equal(codec.decode(codec.encode(x)), x)
        return
    if codec.name == "none":
        return
    with pytest.raises(TypeError, match=f"cannot compress a {dtype} tensor"):
        codec.encode(x)


def test_two_instances_with_the_same_spec_produce_identical_bytes(backend, spec):
    a, b = gradsync.build_codec(spec), gradsync.build_codec(spec)
    for step in range(3):
        x = torch.randn(70, 80)
        ctx = EncodeContext(key=f"t{step % 2}")
        assert torch.equal(a.encode(x, ctx).data, b.encode(x.clone(), ctx).data)


def test_state_dict_is_weights_only_loadable(backend, spec, tmp_path):
    a = gradsync.build_codec(spec)
    for _ in range(2):
        a.encode(torch.randn(20, 30), EncodeContext(key="k"))
    torch.save(a.state_dict(), tmp_path / "s.pt")
    b = gradsync.build_codec(spec)
    b.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    x = torch.randn(20, 30)
    assert torch.equal(a.encode(x, EncodeContext(key="k")).data, b.encode(x, EncodeContext(key="k")).data)


def test_powersgd_rejects_a_payload_of_another_rank(backend):
    a, b = gradsync.build_codec("powersgd:rank=2"), gradsync.build_codec("powersgd:rank=3")
    p = a.encode(torch.randn(40, 50))
    with pytest.raises(ValueError, match="does not fit rank 3"):
        b.payload_from_bytes(p.data.clone(), p.shape, p.dtype)


def test_decode_with_a_scale(backend, spec):
    codec = gradsync.build_codec(spec)
    x = torch.randn(40, 30)
    p = codec.encode(x)
    plain = codec.decode(p)
    torch.testing.assert_close(codec.decode(p, scale=0.25), plain * 0.25, rtol=1e-6, atol=1e-7)
    base = torch.randn(40, 30)
    acc = base.clone()
    codec.decode(p, out=acc, accumulate=True, scale=-2.0)
    torch.testing.assert_close(acc, base - 2.0 * plain, rtol=1e-5, atol=1e-6)
