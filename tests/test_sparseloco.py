"""The ``sparseloco`` codec (chunked top-k, 16-bit chunk-local indices, values of a few bits)
against its definition written out here in float64, its payload's size against the formula,
and error feedback's decay against its invariant."""

from __future__ import annotations

import math

import pytest
import torch

import gradsync
from gradsync.codecs import EncodeContext


def reference(x: torch.Tensor, chunk: int, density: float, bits: int) -> torch.Tensor:
    """Each chunk's ceil(density * size) largest magnitudes, their magnitudes rounded to the
    nearest of 2^(bits-1) levels evenly spaced from the chunk's smallest to its largest kept
    magnitude, signs kept: the decoded tensor, in float64."""
    x = x.double().reshape(-1)
    out = torch.zeros_like(x)
    levels = 2 ** (bits - 1)
    for start in range(0, x.numel(), chunk):
        part = x[start : start + chunk]
        k = min(part.numel(), max(1, math.ceil(density * part.numel())))
        idx = part.abs().topk(k).indices
        mag = part[idx].abs()
        lo, hi = mag.min(), mag.max()
        step = (hi - lo) / (levels - 1) if hi > lo else torch.tensor(1.0, dtype=torch.float64)
        level = torch.round((mag - lo) / step).clamp(0, levels - 1)
        out[start + idx] = torch.sign(part[idx]) * (lo + level * step) * (hi > lo) + torch.sign(
            part[idx]
        ) * lo * (hi <= lo)
    return out


CASES = [(10_000, 4096, 1 / 64, 2), (5_000, 512, 0.05, 4), (777, 64, 0.1, 8), (40, 64, 0.5, 2)]


@pytest.mark.parametrize("resident", [False, True])
@pytest.mark.parametrize(("n", "chunk", "density", "bits"), CASES)
def test_decode_is_the_definition_written_out(n, chunk, density, bits, resident):
    codec = gradsync.build_codec(f"sparseloco:density={density},chunk={chunk},bits={bits}")
    codec.set_resident(resident)
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    got = codec.decode(codec.encode(x)).double()
    torch.testing.assert_close(got, reference(x, chunk, density, bits), atol=1e-6, rtol=1e-6)


def test_the_payload_is_the_formula_and_108_times_smaller_than_float32():
    n, chunk = 1 << 20, 4096
    codec = gradsync.build_codec("sparseloco:density=0.015625,chunk=4096,bits=2")  # 64 of every 4096
    p = codec.encode(torch.randn(n))
    count, chunks = 64 * (n // chunk), n // chunk

    def align(b: int) -> int:
        return (b + 7) // 8 * 8

    want = align(align(align(24 + 2 * count) + (2 * count + 7) // 8) + 4 * chunks) + 4 * chunks
    assert p.nbytes == codec.estimate_nbytes(n) == align(want)
    assert 4 * n / p.nbytes > 100, 4 * n / p.nbytes


def test_a_received_index_outside_its_chunk_is_refused():
    codec = gradsync.build_codec("sparseloco:density=0.1,chunk=64")
    p = codec.encode(torch.randn(100))  # a full chunk and a tail of 36
    data = p.data.clone()
    data[24:26] = torch.tensor([70, 0], dtype=torch.uint8)  # slot 0: position 70 in a chunk of 64
    bad = codec.payload_from_bytes(data, (100,), torch.float32)
    with pytest.raises(ValueError, match="outside its chunk"):
        codec.decode(bad)


@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_error_feedback_with_decay_keeps_its_invariant(decay):
    """g + decay * r_old == sent + r_new, every step, in float64 (decay 1: nothing is lost)."""
    codec = gradsync.build_codec(f"sparseloco:density=0.05,chunk=256,bits=2+ef:decay={decay}")
    residual = torch.zeros(3000, dtype=torch.float64)
    for step in range(5):
        g = torch.randn(3000, generator=torch.Generator().manual_seed(step))
        sent = codec.decode(codec.encode(g, EncodeContext(key="p"))).double()
        new = codec.residual("p").double()
        torch.testing.assert_close(g.double() + decay * residual, sent + new, atol=1e-5, rtol=0)
        residual = new


def test_bad_options_name_the_option():
    for spec, match in [("sparseloco:bits=3", "bits must be one of 2, 4, 8"),
                        ("sparseloco:chunk=70000", "chunk must be in"),
                        ("sparseloco:k=5", "give density"),
                        ("sparseloco+ef:decay=0", "decay must be in"),
                        ("sparseloco+ef:decay=1.5", "decay must be in")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            gradsync.build_codec(spec)
