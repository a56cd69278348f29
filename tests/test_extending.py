"""Extending gradsync the way docs/architecture.md says, once each, through the public API:

- a new codec: a ``Codec`` subclass with its ``Config``, registered with ``@register``;
- a new dense algorithm and a new compressed strategy: one registration each, with a cost
  function; scheme strings, ``wrap`` and the planner take them from there;
- a new optimizer for ``gradsync train``: one ``register_optimizer``;
- a new front (integration): its own events and geometry over the sync core's ``Ledger``.

Each is checked against an independent float64 reference or plain ``torch.distributed``.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn

from worlds import named_check, run_checks, run_world

WORLD = 2


# ------------------------------------------------------------------------------------ a codec
def _register_relu_codec() -> None:
    """``relu``: sends each value's positive part (a biased, elementwise codec: its result does
    not depend on how parameters are laid out in a bucket). Built on the passthrough codec's
    payload layout; only the encoding differs."""
    from gradsync.codecs import codec_names
    from gradsync.codecs.config import CodecConfig
    from gradsync.codecs.dense import NoCompression
    from gradsync.codecs.registry import register

    if "relu" in codec_names():
        return

    @dataclass(frozen=True)
    class ReluConfig(CodecConfig):
        codec: ClassVar[str] = "relu"

    @register
    class Relu(NoCompression):
        """Positive part only."""

        name = "relu"
        Config = ReluConfig
        lossless = False
        biased = True

        def _encode(self, x, shape, ctx, stream, out):  # type: ignore[no-untyped-def]
            return super()._encode(x.clamp(min=0), shape, ctx, stream, out)


# ------------------------------------------------------------------- a collective of each kind
def _register_collectives() -> None:
    """``reducebcast``: a dense sum as a reduce onto rank 0 and a broadcast from it; ``bytes``: a
    compressed strategy that always all-gathers payloads as bytes of any size."""
    from gradsync.collectives import (
        CompressedStrategy,
        DenseAlgorithm,
        compressed_strategy_names,
        dense_algorithm_names,
        register_compressed_strategy,
        register_dense_algorithm,
    )
    from gradsync.collectives import primitives as P
    from gradsync.collectives.pieces import Piece
    from gradsync.collectives.program import last

    if "reducebcast" not in dense_algorithm_names():

        def reduce_broadcast(buf, topo, ws):  # type: ignore[no-untyped-def]
            yield partial(P.reduce, buf, 0, topo.world_group, "world")
            yield last(partial(P.broadcast, buf, 0, topo.world_group, "world"))

        def two_trees(model, nbytes):  # type: ignore[no-untyped-def]
            link = model.world_link
            return 2 * math.ceil(math.log2(model.p)) * (link.alpha + nbytes * link.beta)

        register_dense_algorithm(DenseAlgorithm("reducebcast", reduce_broadcast, two_trees))

    if "bytes" not in compressed_strategy_names():

        def gather_bytes(x, group, level, coder, rank, final):  # type: ignore[no-untyped-def]
            payload = coder.encode(x, "bytes")
            datas = yield last(partial(P.all_gather_bytes, payload.data, group, level), final)
            return [Piece(0, coder.received(d, x)) for d in datas]

        def gathered(model, nbytes, codec, ranks, link):  # type: ignore[no-untyped-def]
            return model.gathered(nbytes, codec, ranks, link)

        register_compressed_strategy(CompressedStrategy("bytes", gather_bytes, gathered))


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    return torch.randn(5, 6, generator=g, dtype=torch.float64), torch.randn(
        5, 3, generator=g, dtype=torch.float64
    )


def _local_grads(model: nn.Module, step: int) -> list[torch.Tensor]:
    x, y = _batch(step)
    model.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _check_wrap(scheme: str, per_rank: object, steps: int = 3) -> None:
    """``wrap(model, scheme)`` against a float64 reference: the mean over ranks of ``per_rank``
    (a function of one rank's gradient) from the second step on, the plain mean at the first
    (wrap's first step is dense while it measures for the plan)."""
    import gradsync
    from gradsync.collectives import Topology

    reference = _model(0)
    gs = gradsync.wrap(_model(0), scheme, Topology(WORLD, 1), plan="compress", min_compress_bytes=0,
                       error_feedback=False)  # fmt: skip
    for step in range(steps):
        raw = _local_grads(reference, step)
        x, y = _batch(step)
        gs.zero_grad()
        nn.functional.mse_loss(gs(x), y).backward()
        for g, p in zip(raw, gs.module.parameters(), strict=True):
            sent = g if step == 0 else per_rank(g)  # type: ignore[operator]
            want = torch.stack(_gathered(sent)).mean(0)
            torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-7, msg=f"{scheme} step {step}")
    gs.close()


def check_new_dense_algorithm() -> None:
    from gradsync.planner.decide import best_dense
    from gradsync.sync import Scheme, SyncConfig

    assert Scheme.parse("reducebcast").algorithm == "reducebcast"
    SyncConfig(scheme="topk:density=0.1", dense_algorithm="reducebcast").validate()
    _check_wrap("reducebcast", lambda g: g)
    # auto weighs it with the others, by its own cost function
    from gradsync.collectives.cost import CostModel, CostParams, Link

    model = CostModel(CostParams(Link(1e-5, 1e-10), Link(1e-3, 1e-6), 1e-11), 2, 1)
    name, seconds = best_dense(model, 4e6, "auto")
    costs = {n: best_dense(model, 4e6, n)[1] for n in ("flat", "hierarchical", "torus2d", "reducebcast")}
    assert (name, seconds) == min(costs.items(), key=lambda kv: kv[1])


def check_new_strategy_with_new_codec() -> None:
    _check_wrap("bytes/relu", lambda g: g.clamp(min=0))


# ------------------------------------------------------------------------------------ a front
class OneBucketFront:
    """A new front: after the backward pass, all of a model's gradients travel as one bucket
    through a compressed all-reduce; the sync core's Ledger keeps what error feedback owes, traces
    it to parameters and checkpoints it. Its events: one call per step. Its geometry: one
    layout."""

    def __init__(self, model: nn.Module, codec: str, topology: object) -> None:
        from gradsync.codecs import build_codec
        from gradsync.sync.carry import Layouts, whole
        from gradsync.sync.ledger import Ledger

        self.model, self.topology = model, topology
        self.names = [n for n, _ in model.named_parameters()]
        self.ledger = Ledger([build_codec(codec)])
        self.layouts = Layouts().add("bucket", whole((n, p.numel()) for n, p in model.named_parameters()))

    def sync(self) -> None:
        from gradsync.collectives import compressed_allreduce

        grads = [p.grad for p in self.model.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        self.ledger.begin_round()
        compressed_allreduce(flat, self.topology, self.ledger.codecs[0], "bytes", key="bucket")  # type: ignore[arg-type]
        self.ledger.settle([])
        torch.nn.utils.vector_to_parameters(flat, grads)  # copies into the .grad tensors

    def owed(self) -> dict[str, torch.Tensor]:
        return self.ledger.owed_gradients(self.layouts, dist.get_world_size())


def check_new_front() -> None:
    """Error feedback through the new front equals the float64 formula: each rank sends
    relu(g + residual) and keeps the rest; what the ranks still owe adds up to what the plain
    mean computed and the synchronized gradients did not apply."""
    from gradsync.collectives import Topology

    model = _model(1)
    front = OneBucketFront(model, "relu+ef", Topology(WORLD, 1))
    params = list(model.parameters())
    residual = [torch.zeros_like(p) for p in params]
    computed = [torch.zeros_like(p) for p in params]
    applied = [torch.zeros_like(p) for p in params]
    for step in range(3):
        raw = _local_grads(model, step)
        front.sync()
        for i, (g, p) in enumerate(zip(raw, params, strict=True)):
            sent = (g + residual[i]).clamp(min=0)
            residual[i] = g + residual[i] - sent
            want = torch.stack(_gathered(sent)).mean(0)
            torch.testing.assert_close(p.grad, want, rtol=1e-6, atol=1e-7, msg=f"front step {step}")
            computed[i] += torch.stack(_gathered(g)).mean(0)
            applied[i] += p.grad
    owed = front.owed()
    for name, c, a in zip(front.names, computed, applied, strict=True):
        total = owed[name].reshape(c.shape).clone()
        dist.all_reduce(total)
        torch.testing.assert_close(total, c - a, rtol=1e-6, atol=1e-7, msg=f"owed {name}")
    # its checkpoint: a fresh front that loads it continues exactly
    again = OneBucketFront(_model(1), "relu+ef", Topology(WORLD, 1))
    again.ledger.load_state_dict(front.ledger.state_dict())
    for model_, front_ in ((model, front), (again.model, again)):
        model_.load_state_dict(model.state_dict())
        _local_grads(model_, 7)
        front_.sync()
    for p, q in zip(model.parameters(), again.model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0)


def _world() -> None:
    _register_relu_codec()
    _register_collectives()
    run_checks(
        named_check(check_new_dense_algorithm),
        named_check(check_new_strategy_with_new_codec),
        named_check(check_new_front),
    )


def test_a_new_codec_collective_and_front_work_through_the_public_api():
    run_world(WORLD, _world)


# -------------------------------------------------------------------------------- an optimizer
def test_a_registered_optimizer_is_a_train_choice(monkeypatch):
    from gradsync.apps.train import optim as train_optim
    from gradsync.apps.train.arguments import add_arguments
    from gradsync.apps.train.optim import (
        OptimizerKind,
        OptimizerOptions,
        build_optimizer,
        optimizer_names,
        register_optimizer,
    )
    from gradsync.apps.train.options import validate

    monkeypatch.setattr(
        train_optim, "_KINDS", dict(train_optim._KINDS)
    )  # the registration ends with the test
    assert "plain-sgd" not in optimizer_names()
    register_optimizer(OptimizerKind("plain-sgd", 0.05, lambda g, lr, o: torch.optim.SGD(g, lr=lr)))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "plain-sgd" in parser.format_help()
    validate(parser.parse_args(["--optimizer", "plain-sgd"]))
    with pytest.raises(ValueError, match="--nesterov needs --optimizer sgd or lars"):
        validate(parser.parse_args(["--optimizer", "plain-sgd", "--nesterov", "--momentum", "0.9"]))
    with pytest.raises(ValueError, match=r"--optimizer must be one of .*plain-sgd"):
        validate(parser.parse_args(["--optimizer", "no-such"]))
    opt = build_optimizer(_model(0), "plain-sgd", None, 0.01, OptimizerOptions())
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["lr"] == 0.05
    # weight decay on the weights only, as for every choice
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.01]
    with pytest.raises(ValueError, match="optimizer name must be new"):
        register_optimizer(OptimizerKind("sgd", 0.1, lambda g, lr, o: torch.optim.SGD(g, lr=lr)))


def test_registering_a_taken_or_reserved_collective_name_is_refused():
    from gradsync.collectives import (
        CompressedStrategy,
        DenseAlgorithm,
        dense_algorithm,
        register_compressed_strategy,
        register_dense_algorithm,
    )

    flat = dense_algorithm("flat")
    for name in ("flat", "none", "auto", "not a name"):
        with pytest.raises(ValueError, match="dense algorithm name must be a new identifier"):
            register_dense_algorithm(DenseAlgorithm(name, flat.steps, flat.cost))
    for name in ("ring", "hitopk"):
        with pytest.raises(ValueError, match="strategy name must be a new identifier"):
            register_compressed_strategy(CompressedStrategy(name, None, None))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="algorithm must be one of flat, hierarchical, torus2d, hybrid"):
        dense_algorithm("ring")
