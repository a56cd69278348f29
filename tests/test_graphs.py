"""Resident work replayed as CUDA graphs (gradsync.codecs.graphs), checked on the CPU.

A graph replays what it recorded: a codec whose replayed work baked in a Python-side value (a
random word drawn on the host, a branch decided by a counter) or changed Python state inside
would send other bytes than its eager path. Under ``emulate_on_cpu`` a replayer keeps the
function of each capture and calls that one again on later calls, as a graph would; every
capturable codec, alone and with error feedback, must then give the eager path's payloads,
decodes and residuals bit for bit, step after step (a non-finite step and a loss-scale change
among them). The real capture runs in the GPU tier (tests/test_gpu.py)."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from gradsync.codecs import EncodeContext, build_codec
from gradsync.codecs.graphs import ADDRESS_SETS, Replayer, emulate_on_cpu

N = 4000
CODECS = [
    "topk:density=0.01",
    "chunktopk:density=0.01,chunk=512",
    "sparseloco:density=0.02,chunk=512",
    "mstopk:density=0.01",
    "trimmed_topk:density=0.01",
    "bsearch:density=0.01,reuse=3",
    "dgc:density=0.01",
    "graddrop:density=0.01",
    "randomk:density=0.01",
    "randomk:density=0.01,unbiased=true",
    "onebit",
    "onebit:scales=1",
    "tbq:threshold=0.5",
    "terngrad",
    "terngrad:bits=4,clip=2.5",
    "fp16",
    "bf16",
    "none",
]
WITH_FEEDBACK = [
    "topk:density=0.01+ef",
    "chunktopk:density=0.01,chunk=512+ef:momentum=0.9",
    "sparseloco:density=0.02,chunk=512,bits=4+ef:decay=0.9",
    "mstopk:density=0.01+ef:momentum=0.9,nesterov=true,masking=false",
    "bsearch:density=0.01,reuse=3+ef",
    "dgc:density=0.01+ef:momentum=0.9",
    "randomk:density=0.01+ef",
    "onebit+ef",
    "tbq:threshold=0.5+ef",
    "terngrad+ef",
    "fp16+ef",
    "none+ef",
]


def resident(spec: str):
    codec = build_codec(spec)
    codec.set_resident(True)
    return codec


def gradient(step: int, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(N, generator=torch.Generator().manual_seed(step)).to(dtype)
    if step == 3:
        x[5] = math.nan  # a skipped step: flagged, nothing of it kept
    return x


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0))


CASES = [(spec, torch.float32) for spec in CODECS + WITH_FEEDBACK]
CASES += [(spec, torch.bfloat16) for spec in ("topk:density=0.01", "terngrad", "fp16", *WITH_FEEDBACK[:4])]


@pytest.mark.parametrize(("spec", "dtype"), CASES)
def test_replayed_work_equals_the_eager_path_bit_for_bit(spec, dtype):
    eager, replayed = resident(spec), resident(spec)
    bucket = torch.empty(N, dtype=dtype)  # the replayed side's input stays at one address
    out = torch.empty(N, dtype=dtype)
    ef = "+ef" in spec
    for step in range(8):
        scale = 1.0 if step < 5 else 8.0  # a loss scale that changes (error feedback rescales)
        g = gradient(step, dtype) * scale
        want = eager.encode(g, EncodeContext(key="b"), loss_scale=scale)
        want_decoded = eager.decode(want)
        bucket.copy_(g)
        with emulate_on_cpu():
            got = replayed.encode(bucket, EncodeContext(key="b"), loss_scale=scale)
            replayed.decode(got, out=out)
        assert torch.equal(got.data, want.data), (spec, step)
        assert same(out, want_decoded), (spec, step)
        if ef:
            assert torch.equal(replayed.residual("b"), eager.residual("b")), (spec, step)
    plain = replayed.plain
    assert plain.replays
    # an encode and a decode site, each with its two payload buffers (bsearch: two encode
    # sites, a search and a reuse of its threshold): the rest are replays
    assert plain.replayer.captured <= (6 if spec.startswith("bsearch") else 4), plain.replayer.captured
    assert plain.replayer.replayed >= 2 * 8 - 2 - plain.replayer.captured, plain.replayer.replayed


def test_a_replayed_stream_resumes_from_its_state_as_the_uninterrupted_one():
    """The random words of a resident stream come from its device counter, saved with its state:
    a codec loaded from a state saved after three calls sends what the uninterrupted one sends."""
    spec = "dgc:density=0.01+ef"
    whole, first = resident(spec), resident(spec)
    bucket = torch.empty(N)
    with emulate_on_cpu():
        sent = []
        for step in range(6):
            bucket.copy_(gradient(10 + step, torch.float32))
            sent.append(whole.encode(bucket, EncodeContext(key="b")).data.clone())
        for step in range(3):
            bucket.copy_(gradient(10 + step, torch.float32))
            first.encode(bucket, EncodeContext(key="b"))
        state = first.state_dict()
        assert isinstance(state["codec"]["streams"]["b"]["counter"], torch.Tensor)
        resumed = resident(spec)
        resumed.load_state_dict(state)
        for step in range(3, 6):
            bucket.copy_(gradient(10 + step, torch.float32))
            assert torch.equal(resumed.encode(bucket, EncodeContext(key="b")).data, sent[step]), step


def test_the_emulation_catches_a_value_baked_in_on_the_host():
    """What the emulation is for: a function that reads a Python counter at capture time keeps
    that value in its replays, as a CUDA graph would; the results then differ from the eager
    path's, which a test comparing the two sees."""
    replayer, calls = Replayer("test"), [0]
    out = torch.zeros(1)

    def work(o: torch.Tensor) -> None:
        calls[0] += 1
        o.fill_(float(calls[0]))  # a host value: a graph records the one of its capture

    seen = []
    with emulate_on_cpu():
        for _ in range(4):
            replayer.run("site", work, inputs=[], static=[out])
            seen.append(float(out))
    assert seen == [1.0, 2.0, 2.0, 2.0]  # eager, capture then replay, replays of the capture


def test_inputs_at_new_addresses_are_copied_in_and_moving_outputs_fall_back_to_eager(caplog):
    replayer = Replayer("test")

    def double(x: torch.Tensor, o: torch.Tensor) -> None:
        torch.mul(x, 2, out=o)

    out = torch.zeros(8)
    with emulate_on_cpu():
        for i in range(3 * ADDRESS_SETS):  # a fresh input every call: copied in, one graph kept
            x = torch.full((8,), float(i))
            replayer.run("double", double, inputs=[x], static=[out], consts=())
            assert torch.equal(out, torch.full((8,), 2.0 * i)), i
        captured = replayer.captured
        assert captured <= ADDRESS_SETS + 1
        with caplog.at_level(logging.INFO, logger="gradsync"):
            for _ in range(3 * ADDRESS_SETS):  # the output moves every call too: no graph fits
                o = torch.zeros(8)
                replayer.run("double", double, inputs=[torch.full((8,), 1.0)], static=[o], consts=())
                assert torch.equal(o, torch.full((8,), 2.0))
    said = [r.getMessage() for r in caplog.records if "no CUDA graph fits" in r.getMessage()]
    assert len(said) == 1, said  # once, not per call


def test_on_a_cpu_the_eager_path_runs_and_says_so_once(caplog):
    codec = resident("topk:density=0.01")
    codec.replayer.owner = "topk (a test's own)"  # a name no other test logged
    with caplog.at_level(logging.INFO, logger="gradsync"):
        for step in range(3):
            codec.decode(codec.encode(gradient(step, torch.float32)))
    said = [r.getMessage() for r in caplog.records if "topk (a test's own)" in r.getMessage()]
    assert len(said) == 1 and "CUDA graphs need its tensors on a CUDA device" in said[0], said
    assert codec.replayer.captured == 0 and codec.replayer.replayed == 0
