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
    """Versions of one compiled operator that differ in a constant (the bit width and the count of
    a lookup decode) compile one graph each with the constants baked in: no version recompiles when
    another ran first, and no constant becomes a symbolic integer (torch 2.11 fails on
    ``1 << bits`` when the bit width is symbolic). The decoded codes equal a plain unpacking
    written out here."""
    import logging

    from gradsync.codecs.ops.bits import lut_decode

    symbols: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "create_symbol" in record.getMessage():
                symbols.append(record.getMessage())

    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    handler = Collect()
    log.addHandler(handler)
    torch._logging.set_logs(dynamic=logging.INFO)
    torch._dynamo.reset()
    try:
        limit = torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True)
        with limit, backend("compiled"):
            for bits in (2, 4, 8, 2, 4):
                for nbytes in (64, 96):
                    packed = torch.arange(nbytes, dtype=torch.uint8)
                    table = torch.arange(1 << bits, dtype=torch.float32)
                    numel = nbytes * 8 // bits
                    got = lut_decode(packed, bits, table, torch.empty(numel))
                    per = 8 // bits
                    mask = (1 << bits) - 1
                    want = [float((int(packed[i // per]) >> ((i % per) * bits)) & mask) for i in range(numel)]
                    assert got.tolist() == want, bits
    finally:
        torch._logging.set_logs()
        log.removeHandler(handler)
    constants = [m for m in symbols if ".size()" not in m]
    assert not constants, constants
