"""Spec strings and typed configs: every bad input gets a ValueError naming the field and range."""

import math

import pytest
import torch

import gradsync
from gradsync.codecs import codec_class
from gradsync.codecs.config import split_spec


def test_spec_parsing_and_round_trip():
    c = gradsync.build_codec(" TopK : density = 0.02 , compile=false ")
    assert c.name == "topk" and c.config.density == 0.02 and c.config.compile is False
    assert gradsync.build_codec(c.config.spec()).config == c.config
    t = gradsync.build_codec("terngrad:bits=4,seed=3,clip=2.5")
    assert (t.config.bits, t.config.seed, t.config.clip) == (4, 3, 2.5)
    assert gradsync.build_codec(t.config.spec()).config == t.config
    assert gradsync.build_codec("graddrop:threshold=none").config.threshold is None
    assert split_spec("a:x=1+ef:momentum=0.9") == [("a", {"x": "1"}), ("ef", {"momentum": "0.9"})]
    ef = gradsync.build_codec("dgc:density=0.001+ef:momentum=0.9,nesterov=yes")
    assert ef.config.momentum == 0.9 and ef.config.nesterov is True
    assert gradsync.build_codec(ef.spec()).spec() == ef.spec()
    assert gradsync.build_codec(c.config) is not c


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("topk:density=0", r"topk: density must be in \(0, 1\], got 0.0"),
        ("topk:density=-0.1", r"topk: density must be in \(0, 1\], got -0.1"),
        ("topk:density=1.5", r"topk: density must be in \(0, 1\], got 1.5"),
        ("topk:density=nan", r"topk: density must be in \(0, 1\], got nan"),
        ("mstopk:density=abc", "mstopk: density must be a number, got 'abc'"),
        ("topk:k=0", r"topk: k must be in \[1, inf\), got 0"),
        ("topk:k=2.5", "topk: k must be an integer"),
        ("topk:k=5,density=0.1", "give density or k, not both"),
        ("powersgd:rank=0", r"powersgd: rank must be in \[1, 1024\], got 0"),
        ("powersgd:rank=5000", r"powersgd: rank must be in \[1, 1024\], got 5000"),
        ("terngrad:bits=0", "terngrad: bits must be one of 2, 4, 8; got 0"),
        ("terngrad:bits=3", "terngrad: bits must be one of 2, 4, 8; got 3"),
        ("terngrad:bits=16", "terngrad: bits must be one of 2, 4, 8; got 16"),
        ("onebit:scales=3", "onebit: scales must be one of 1, 2; got 3"),
        ("tbq:threshold=0", r"tbq: threshold must be in \(0, inf\), got 0.0"),
        ("fp16:scaling=dynamic", "fp16: scaling must be one of auto, none; got 'dynamic'"),
        ("mstopk:iters=0", r"mstopk: iters must be in \[1, 64\], got 0"),
        ("bsearch:reuse=0", r"bsearch: reuse must be in \[1, inf\), got 0"),
        ("dgc:tolerance=1", r"dgc: tolerance must be in \[0, 1\), got 1.0"),
        ("trimmed_topk:step=0", r"trimmed_topk: step must be in \(0, 1\], got 0.0"),
        ("graddrop:threshold=0.1,density=0.1", "give threshold or density/k, not both"),
        ("topk:compile=maybe", "topk: compile must be true or false, got 'maybe'"),
        ("topk:desnity=0.1", "topk: unknown option 'desnity'; allowed options: compile, density, k"),
        ("quantum", "unknown codec 'quantum'; available codecs: bf16, bsearch, chunktopk, dgc"),
        ("topk:density", "bad option 'density' in spec 'topk:density': write key=value"),
        ("topk:k=1,k=2", "option 'k' given twice"),
        ("", "a codec spec must be a non-empty string"),
        ("topk+ef:momentum=1.5", r"ef: momentum must be in \[0, 1\), got 1.5"),
        ("topk+ef:speed=1", "ef: unknown option 'speed'; allowed options: momentum, nesterov, masking, clip"),
    ],
)
def test_bad_specs_name_the_field_and_the_allowed_values(spec, message):
    with pytest.raises(ValueError, match=message):
        gradsync.build_codec(spec)


def test_configs_reject_bad_values_when_built_directly():
    cfg_cls = codec_class("topk").Config
    with pytest.raises(ValueError, match="density must be"):
        cfg_cls(density=math.nan)
    with pytest.raises(ValueError, match="k must be int"):
        cfg_cls.from_options({"k": True})
    with pytest.raises(TypeError, match="topk needs a TopkConfig"):
        codec_class("topk")(codec_class("mstopk").Config())


@pytest.mark.parametrize("spec", ["topk:k=100", "mstopk:k=11", "qrgc:k=50", "randomk:k=1000", "dgc:k=11"])
def test_k_larger_than_the_tensor_is_rejected_before_encoding(spec):
    codec = gradsync.build_codec(spec)
    with pytest.raises(ValueError, match="exceeds the tensor's 10 elements"):
        codec.encode(torch.randn(10))
    with pytest.raises(ValueError, match="exceeds the tensor's 10 elements"):
        codec.check_numel(10)
    codec.check_numel(1000)


def test_estimate_rejects_a_shape_that_does_not_match():
    with pytest.raises(ValueError, match=r"shape \(3, 3\) does not hold 10 elements"):
        gradsync.build_codec("onebit").estimate_nbytes(10, (3, 3))
