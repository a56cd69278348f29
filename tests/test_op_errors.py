"""Every input check of the operators and the payload plumbing raises a clear error."""

import pytest
import torch

from gradsync.codecs import ops
from gradsync.codecs.payload import HEADER_BYTES, Payload, allocate
from gradsync.codecs.sparse import TopK


def test_operator_argument_errors():
    with pytest.raises(ValueError, match="idx and val must have the same length, got 2 and 3"):
        ops.sparse_add_(torch.zeros(5), torch.tensor([0, 1]), torch.ones(3))
    with pytest.raises(ValueError, match="idx and val must have the same length"):
        ops.sparse_to_dense_(torch.zeros(5), torch.tensor([0, 1]), torch.ones(3))
    with pytest.raises(ValueError, match="a 2-bit lookup table needs 4 entries, got 3"):
        ops.lut_decode(torch.zeros(1, dtype=torch.uint8), 2, [0.0, 1.0, 2.0], torch.empty(4))
    with pytest.raises(ValueError, match=r"bits must be one of \(1, 2, 4, 8\), got 3"):
        ops.pack_codes(torch.zeros(4), 3)
    with pytest.raises(ValueError, match="bits must be 2, 4 or 8, got 1"):
        ops.stochastic_pack(torch.zeros(4), 1.0, 1, 1, (0, 0), torch.empty(4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"k must be in \[0, n=5\], got 6"):
        ops.random_subset(5, 6, ops.make_generator(0))
    with pytest.raises(ValueError, match="high must be positive, got 0"):
        ops.draw_index(ops.make_generator(0), 0)
    with pytest.raises(ValueError, match=r"dtype must be torch\.float16 or torch\.bfloat16"):
        ops.cast_checked(torch.zeros(4), torch.float32, 1.0, torch.empty(4, dtype=torch.int16))
    with pytest.raises(TypeError, match="orthogonalize_ works in float32"):
        ops.orthogonalize_(torch.zeros(3, 2, dtype=torch.float64))


def test_payload_plumbing_errors():
    with pytest.raises(TypeError, match="payload data must be a 1-D uint8 tensor"):
        Payload(torch.zeros(30), "topk", torch.Size([4]), torch.float32)
    with pytest.raises(ValueError, match="shorter than its 24-byte header"):
        Payload(torch.zeros(10, dtype=torch.uint8), "topk", torch.Size([4]), torch.float32)
    with pytest.raises(TypeError, match="out must be a contiguous 1-D uint8 tensor"):
        allocate(8, torch.device("cpu"), torch.zeros(8))
    codec = TopK(TopK.Config(k=2))
    p = codec.encode(torch.randn(10))
    data = p.data.clone()
    data[:8] = torch.tensor([99, 0, 0, 0, 0, 0, 0, 0], dtype=torch.uint8)  # count 99 > numel
    with pytest.raises(ValueError, match=r"header count 99 is outside \[0, 10\]"):
        codec.payload_from_bytes(data, p.shape, p.dtype)
    assert HEADER_BYTES == 24
