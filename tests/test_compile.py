"""Codecs with compile=true: the common operators go through torch.compile (Inductor) and give the
same payloads as their eager torch definitions. Compiling takes a few seconds per operator."""

import pytest
import torch

import gradsync
from gradsync.codecs.ops import backend

pytestmark = pytest.mark.timeout(600)


def _compiled_and_eager(spec, x):
    compiled = gradsync.build_codec(spec + (",compile=true" if ":" in spec else ":compile=true"))
    eager = gradsync.build_codec(spec)
    pc = compiled.encode(x)
    with backend("torch"):
        pe = eager.encode(x)
    return compiled, eager, pc, pe


@pytest.mark.parametrize("spec", ["fp16", "terngrad:bits=4", "tbq:threshold=0.5"])
def test_compiled_codec_matches_the_eager_definition(spec):
    x = torch.randn(300, 257)
    compiled, eager, pc, pe = _compiled_and_eager(spec, x)
    assert torch.equal(pc.data, pe.data)
    with backend("torch"):
        want = eager.decode(pe)
    assert torch.equal(compiled.decode(pc), want)
    # a second call with another size and new random words does not recompile into a wrong result
    y = torch.randn(1000)
    _compiled2, _eager2, pc2, pe2 = _compiled_and_eager(spec, y)
    assert torch.equal(pc2.data, pe2.data)


def test_compiled_onebit_matches_up_to_summation_order():
    x = torch.randn(4096)
    _compiled, _, pc, pe = _compiled_and_eager("onebit", x)
    codes = slice(24, None)
    assert torch.equal(pc.data[codes], pe.data[codes])
    assert pc.header.s0 == pytest.approx(pe.header.s0, rel=1e-5)
    assert pc.header.s1 == pytest.approx(pe.header.s1, rel=1e-5)


def test_versions_of_one_operator_keep_their_constants_static():
    """Versions of one compiled operator that differ in a constant (here the bit width of a lookup
    decode) compile one graph each with the constant baked in: no version recompiles when another
    runs first (torch 2.11 failed on the symbolic bit width a shared compile cache produced). The
    decoded codes equal a plain unpacking written out here."""
    from gradsync.codecs.ops.bits import lut_decode

    torch._dynamo.reset()
    packed = torch.arange(64, dtype=torch.uint8)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True), backend("compiled"):
        for bits in (2, 4, 8):
            table = torch.arange(1 << bits, dtype=torch.float32)
            numel = 64 * 8 // bits
            got = lut_decode(packed, bits, table, torch.empty(numel))
            per = 8 // bits
            want = [float((int(packed[i // per]) >> ((i % per) * bits)) & ((1 << bits) - 1)) for i in range(numel)]
            assert got.tolist() == want, bits
