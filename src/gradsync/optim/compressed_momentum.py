"""What 1-bit Adam, 0/1 Adam and 1-bit LAMB share: the optimizer owns the communication.

These optimizers synchronize the ranks themselves, so the model must NOT also be synchronized by
DDP, :func:`gradsync.wrap` (use its ``no_sync()`` for the whole run) or any other hook: each rank
calls ``backward()`` on its own batch and hands ``step()`` its LOCAL gradient.

- A dense warm-up: the gradients are averaged with a plain all-reduce (float32) and the optimizer
  is ordinary Adam/AdamW (LAMB for 1-bit LAMB), so that the second moment ``v`` gets estimated.
- Then ``v`` stops changing (it is "frozen"; 0/1 Adam still refreshes it at growing intervals),
  which makes Adam's update linear in the momentum. Each rank then updates its momentum with its
  own gradient and the ranks average the momentum (or, 0/1 Adam, the update accumulated over
  local steps) through a compressed all-reduce with error feedback: by default CaSync-PS
  (:mod:`gradsync.collectives.strategies`) with ``onebit`` (a sign bit per element and one mean
  value per sign), whose two stages -- every rank compresses each partition for its owner, the
  owner sums and compresses the aggregate for everyone -- each keep their own residual
  (:class:`~gradsync.codecs.ErrorFeedback`: the worker side and the "server" side). Every rank
  decodes the same payloads, so the ranks end every synchronized step with bit-identical momentum
  and parameters.

:class:`FlatState` keeps the moments as flat float32 buffers whatever the parameters' dtype
(bf16/fp16 parameters are updated in float32 and rounded back), on the parameters' device.
:class:`MomentumExchange` owns the codec, its error-feedback state, the topology and the byte
count (:attr:`MomentumExchange.traffic`, a :class:`~gradsync.collectives.Traffic`: what this rank
put into collectives, per level, since it was made; also passed on to an enclosing
:func:`~gradsync.collectives.record_traffic` block).

``precondition=True`` exchanges the momentum divided by Adam's frozen denominator
``sqrt(v) + eps`` (the same on every rank, so the mean is the same), so that onebit's one
magnitude per sign and partition meets elements of comparable size. It is off by default: on the
Transformer LM of docs/benchmarks.md, 1-bit Adam ended further from dense AdamW with it (6.23
against 5.31 perplexity after 6 of 12 epochs), and a lossless exchange was no better than
onebit there (5.42): the frozen variance, not the compression, made the gap.

Elements and parameters that get no gradient (torch's AdamW as the reference):

- **A parameter whose** ``.grad`` **is None on every rank** (a frozen layer, ``requires_grad=False``;
  a branch no rank used) is skipped on that step, as :class:`torch.optim.AdamW` skips it: no
  weight decay, no moment update, no move. Where some ranks have a gradient and others not, the
  missing ones count as zeros (what DDP does with unused parameters). The ranks learn which
  parameters somebody had a gradient for from a flag per parameter: in the dense steps it rides in
  the gradient's all-reduce, in the compressed steps it is one more small all-reduce
  (4 bytes per parameter tensor), and 0/1 Adam's local steps send it with the next exchange.
- **An element whose second moment** ``v`` **is exactly zero** has never had a nonzero averaged
  gradient (an embedding row no batch used, a dead unit). ``v`` comes from all-reduced gradients
  only (the dense steps), so it is the same on every rank, and so is the mask ``v > 0`` taken
  from it. Masked elements travel as zeros and what arrives for them is dropped (a sign codec
  cannot send a zero: before this rule their momentum came back as +-scale and, divided by
  ``eps``, moved them by hundreds in a few steps), and their momentum is held at zero, so they
  take no Adam step; they are still decayed when their parameter has a gradient, as AdamW
  decays them. The exchange keeps its layout (the residuals always fit); the residual of an
  element that only ever sends zeros alternates within one scale. An element that first gets a
  gradient after ``v`` froze stays masked (1-bit Adam, 1-bit LAMB) or until 0/1 Adam's next
  variance refresh sees it: its frozen denominator would be ``eps``. (A first version sent the
  gather of the unmasked elements instead; each refresh that unmasked elements then changed the
  layout and dropped the residuals, and 0/1 Adam ended 6 points further from AdamW on the
  benchmark: docs/optimizers.md.)

Limits: no GradScaler (a rank that skips a step for an overflow would leave the others waiting in
a collective; bf16 autocast needs none); all parameters on one device; every param group added
before the first step (the moments are one flat buffer with one step count, see
:meth:`CompressedMomentumOptimizer.add_param_group`). The bias corrections use the optimizer's
step count, not a count per parameter: a parameter skipped on some steps is corrected as if it
had been stepped on all of them (torch keeps a count per parameter).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from gradsync.codecs import Compressor, ErrorFeedback, build_codec, codec_names
from gradsync.codecs.feedback import FeedbackConfig
from gradsync.collectives import Topology, Traffic, compressed_allreduce
from gradsync.collectives import primitives as P
from gradsync.collectives.strategies import compressed_strategy
from gradsync.collectives.topology import default_topology

DEFAULT_CODEC = "onebit"


def check_number(
    name: str, value: object, low: float, high: float | None = None, *, high_open: bool = True
) -> float:
    """``value`` as a float, or ``ValueError`` naming ``name`` and the allowed range."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    bad_high = high is not None and (value >= high if high_open else value > high)
    if value < low or bad_high:
        top = "" if high is None else f" and {'<' if high_open else '<='} {high}"
        raise ValueError(f"{name} must be >= {low}{top}, got {value!r}")
    return float(value)


def check_steps(name: str, value: object, low: int) -> int:
    """``value`` as an int >= ``low``, or ``ValueError`` naming ``name``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


def check_betas(betas: object) -> tuple[float, float]:
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"betas must be a pair (beta1, beta2), each in [0, 1), got {betas!r}")
    return check_number("betas[0]", betas[0], 0.0, 1.0), check_number("betas[1]", betas[1], 0.0, 1.0)


def build_exchange_codec(spec: object) -> Compressor:
    """The codec of the momentum exchange with error feedback around it (``spec``: a codec spec
    string such as ``"onebit"`` or ``"onebit:scales=1"``; ``+ef`` is implied)."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"codec must be a codec spec string such as 'onebit', got {spec!r}")
    try:
        codec = build_codec(spec)
    except ValueError as e:
        raise ValueError(f"codec: {e} (allowed: {', '.join(codec_names())}, optionally +ef)") from None
    if codec.per_tensor:
        raise ValueError(
            f"codec {spec!r} is low-rank; the momentum exchange takes element-wise codecs "
            f"(e.g. onebit, terngrad, topk:density=0.01, none)"
        )
    if isinstance(codec, ErrorFeedback) and codec.config != FeedbackConfig():
        # the optimizer owns the momentum: a second one (ef:momentum) would apply it twice, and
        # clipping the momentum (ef:clip) would bias what every rank agrees on
        raise ValueError(
            f"codec {spec!r}: the momentum exchange takes plain error feedback ('+ef' with no "
            f"options, or no '+ef' at all), got '+{codec.config.spec()}'; allowed: a codec spec "
            f"such as 'onebit' or 'onebit+ef'"
        )
    return codec if isinstance(codec, ErrorFeedback) else ErrorFeedback(codec.plain)


class MomentumExchange:
    """Averages flat float32 tensors over the ranks: densely (a plain all-reduce) or through the
    codec with error feedback; counts every byte this rank sends.

    Args:
        codec: codec spec (see :func:`build_exchange_codec`).
        strategy: ``ps`` (two-stage: reduce-scatter to owners, all-gather; the default),
            ``ring`` or ``allgather`` (:mod:`gradsync.collectives.strategies`).
        topology: the ranks (default: torchrun's layout of the current process group); its
            ``world_group`` carries the exchange, never the default group.
    """

    def __init__(self, codec: str, strategy: str, topology: Topology | None) -> None:
        compressed_strategy(strategy)  # ValueError naming the registered ones
        self.spec = codec
        self.codec = build_exchange_codec(codec)
        self.strategy = strategy
        self._topology = topology
        self.traffic = Traffic()
        """Bytes this rank sent through the exchange (per level) since it was made; ``take()``
        gives those since the last take."""

    # the topology is bound lazily: optimizers are often made before init_process_group in tests
    @property
    def topology(self) -> Topology:
        if self._topology is None:
            self._topology = default_topology()
        return self._topology.bind()

    @property
    def world(self) -> int:
        return self.topology.world if dist.is_available() and dist.is_initialized() else 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        """Count the collectives of the block into :attr:`traffic` (and the enclosing count)."""
        outer = P.current_traffic()
        with P.record_traffic() as t:
            yield
        for level, n in t.take().items():
            self._count(level, n, outer)

    def _count(self, level: str, nbytes: int, outer: Traffic | None) -> None:
        self.traffic.add(level, nbytes, "optimizer")
        if outer is not None:
            outer.add(level, nbytes, "optimizer")

    def agree(self, what: str, **fields: int | str) -> None:
        """Raise on every rank unless every rank has the same optimizer configuration."""
        topo = self.topology
        if topo.world > 1:
            P.check_same(topo.control_group, what, None, **fields)
            # check_same does not count its all-gather: count it here, every byte is the run's
            self._count("world", (topo.world - 1) * 8 * P.AGREEMENT_WORDS, P.current_traffic())

    def dense_mean(self, flat: torch.Tensor) -> None:
        """``flat`` becomes the mean over the ranks (a float32 all-reduce)."""
        topo = self.topology
        if topo.world == 1:
            return
        with self.counting():
            P.all_reduce(flat, topo.world_group, topo.level_of(topo.world_group))
        flat.div_(topo.world)

    def flags_mean(self, flags: torch.Tensor) -> None:
        """``flags`` (a small float tensor) becomes its mean over the ranks (a plain all-reduce)."""
        self.dense_mean(flags)

    def compressed_mean(self, flat: torch.Tensor, key: str) -> None:
        """``flat`` becomes the compressed mean over the ranks, the same on every rank; ``key``
        names the error-feedback streams (one per stage and partition)."""
        topo = self.topology
        if topo.world == 1:
            return
        with self.counting():
            compressed_allreduce(flat, topo, self.codec, self.strategy, op="mean", key=key, check=False)

    def state_dict(self) -> dict[str, Any]:
        return {"codec": self.spec, "strategy": self.strategy, "feedback": self.codec.state_dict()}

    def load_state_dict(self, state: dict[str, Any], device: torch.device) -> None:
        for name in ("codec", "strategy"):
            if state[name] != getattr(self, "spec" if name == "codec" else name):
                raise ValueError(
                    f"the checkpoint's momentum exchange has {name} {state[name]!r}, this optimizer "
                    f"{getattr(self, 'spec' if name == 'codec' else name)!r}: its residuals do not apply"
                )
        self.codec.load_state_dict(_to(state["feedback"], device))


def _to(value: Any, device: torch.device) -> Any:
    """A state's tensors on ``device`` (nested dicts and lists)."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_to(v, device) for v in value]
    return value


class FlatState:
    """The parameters of an optimizer laid end to end: per parameter a slice of flat float32
    buffers, param groups contiguous (``segments[i]``: group ``i``'s slice)."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.params: list[torch.Tensor] = [p for g in groups for p in g["params"]]
        if not self.params:
            raise ValueError("params: the optimizer got no parameters")
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"params: all parameters must be on one device, got {sorted(map(str, devices))}")
        self.device = self.params[0].device
        for p in self.params:
            if not p.is_floating_point():
                raise ValueError(f"params: floating-point parameters only, got {p.dtype}")
        self.slices: list[slice] = []
        self.segments: list[slice] = []
        self.group_of: list[int] = []
        """The param group of each parameter."""
        at = 0
        for i, g in enumerate(groups):
            start = at
            for p in g["params"]:
                self.slices.append(slice(at, at + p.numel()))
                self.group_of.append(i)
                at += p.numel()
            self.segments.append(slice(start, at))
        self.numel = at
        self._sizes = torch.tensor([p.numel() for p in self.params], device=self.device)

    def zeros(self) -> torch.Tensor:
        return torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    def read_grads(self, out: torch.Tensor) -> None:
        """The parameters' gradients into ``out`` (float32; a missing gradient is zero)."""
        for p, s in zip(self.params, self.slices, strict=True):
            if p.grad is None:
                out[s].zero_()
            else:
                out[s].copy_(p.grad.reshape(-1))

    def present(self) -> torch.Tensor:
        """1.0 for each parameter with a gradient on this rank, 0.0 where ``.grad`` is None."""
        return torch.tensor(
            [p.grad is not None for p in self.params], dtype=torch.float32, device=self.device
        )

    def expand(self, per_param: torch.Tensor) -> torch.Tensor:
        """A value per parameter repeated over that parameter's elements (flat)."""
        return per_param.repeat_interleave(self._sizes, output_size=self.numel)

    def read_params(self, out: torch.Tensor) -> None:
        for p, s in zip(self.params, self.slices, strict=True):
            out[s].copy_(p.detach().reshape(-1))

    def write_params(self, x: torch.Tensor) -> None:
        """The flat float32 ``x`` back into the parameters (rounded to their dtype)."""
        for p, s in zip(self.params, self.slices, strict=True):
            p.detach().copy_(x[s].view(p.shape))

    def norms(self, x: torch.Tensor) -> torch.Tensor:
        """The L2 norm of each parameter's slice of ``x`` (float32, one per parameter)."""
        return torch.stack(torch._foreach_norm([x[s] for s in self.slices]))


class CompressedMomentumOptimizer(torch.optim.Optimizer):
    """Base of the optimizers that own their synchronization (see the module).

    Subclasses implement :meth:`_update` (one step on the flat buffers), may add state with
    :meth:`_extra_state` / :meth:`_load_extra_state` and buffers sized by the parameters in
    :meth:`_build_state`. ``betas`` and ``eps`` are the same for every param group (the moments
    are one flat buffer); ``lr`` and ``weight_decay`` may differ.
    """

    kind = "compressed-momentum"

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        freeze_step: int,
        codec: str,
        strategy: str,
        topology: Topology | None,
        precondition: bool = False,
    ) -> None:
        # every check is local: each rank raises the same error before anything is communicated
        check_number("lr", lr, 0.0)
        b1, b2 = check_betas(betas)
        check_number("eps", eps, 0.0)
        check_number("weight_decay", weight_decay, 0.0)
        self.freeze_step = check_steps("freeze_step", freeze_step, 1)
        if not isinstance(precondition, bool):
            raise ValueError(f"precondition must be True or False, got {precondition!r}")
        self.precondition = precondition
        self.exchange = MomentumExchange(codec, strategy, topology)
        self.step_count = 0
        defaults = dict(lr=float(lr), betas=(b1, b2), eps=float(eps), weight_decay=float(weight_decay))
        super().__init__(params, defaults)  # calls add_param_group for each group
        self._build_state()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a param group; only before the first step.

        The moments are flat buffers over every group with one step count: a group added later
        would start with the others' step count (a wrong bias correction), with ``v = 0`` past
        the warm-up (masked out for good, see the module), and would change the layout the
        exchange's residuals and the ranks' agreement were made for. So it is refused after the
        first step, on every rank alike (nothing is communicated)."""
        if self.step_count > 0:
            raise ValueError(
                f"{self.kind}: add_param_group after the first step is not supported (the moments "
                f"are one flat buffer with one step count, and the ranks agreed on its layout); pass "
                f"every param group to the constructor, or add it before the first step()"
            )
        super().add_param_group(param_group)
        try:
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])
        except ValueError:
            self.param_groups.pop()
            raise
        if hasattr(self, "flat"):  # after the constructor: the flat state follows the new parameters
            self._build_state()

    def _check_group(self, i: int, g: dict[str, Any]) -> None:
        b1, b2 = self.defaults["betas"]
        check_number(f"param_groups[{i}]['lr']", g["lr"], 0.0)
        check_number(f"param_groups[{i}]['weight_decay']", g["weight_decay"], 0.0)
        if tuple(g["betas"]) != (b1, b2) or g["eps"] != self.defaults["eps"]:
            raise ValueError(
                f"param_groups[{i}]: betas and eps must be the same in every group "
                f"(the moments are one flat buffer), got {g['betas']} and {g['eps']}"
            )

    def _build_state(self) -> None:
        """The flat state and work buffers for the current param groups (all zero: no step yet)."""
        self.flat = FlatState(self.param_groups)
        n = self.flat.numel
        self.exp_avg = self.flat.zeros()
        self.exp_avg_sq = self.flat.zeros()
        # work buffers, not state. The gradient buffer has one more slot per parameter: the
        # "has a gradient" flags travel in the dense all-reduce with it
        self._gradbuf = torch.zeros(n + len(self.flat.params), dtype=torch.float32, device=self.flat.device)
        self._grad = self._gradbuf[:n]
        self._x = self.flat.zeros()
        self._denom = self.flat.zeros()
        self._frozen: torch.Tensor | None = None
        self._mask: torch.Tensor | None = None
        self._held = self.flat.zeros()
        self._agreed = False

    # ------------------------------------------------------------------ the step
    @property
    def traffic(self) -> Traffic:
        """Bytes this rank put into collectives (:class:`~gradsync.collectives.Traffic`)."""
        return self.exchange.traffic

    @property
    def compressing(self) -> bool:
        """Whether the last step was past the dense warm-up."""
        return self.step_count > self.freeze_step

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._agreed:
            self.exchange.agree(
                self.kind, numel=self.flat.numel, codec=self.exchange.spec, strategy=self.exchange.strategy,
                config=repr(self._config()),
            )  # fmt: skip
            self._agreed = True
        self.step_count += 1
        self.flat.read_grads(self._grad)
        self.flat.read_params(self._x)
        self._update(self.step_count, self._grad, self._x, self.flat.present())
        self.flat.write_params(self._x)
        return loss

    def _config(self) -> dict[str, Any]:
        b1, b2 = self.defaults["betas"]
        return {
            "betas": (b1, b2), "eps": self.defaults["eps"], "freeze_step": self.freeze_step,
            "precondition": self.precondition,
        }  # fmt: skip

    def _update(self, t: int, g: torch.Tensor, x: torch.Tensor, here: torch.Tensor) -> None:
        """One step on the flat buffers: ``g`` this rank's gradient, ``x`` the parameters,
        ``here`` this rank's flags (1.0 per parameter with a gradient)."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """Bring the ranks' parameters into agreement now (before an evaluation or a checkpoint);
        a no-op for the optimizers that keep them in agreement after every step."""

    # ------------------------------------------------------------------ who has a gradient
    def _agreed_present(self, flags: torch.Tensor) -> torch.Tensor | None:
        """The parameters some rank had a gradient for, from the flags' mean over the ranks
        (bool per parameter), or None when that is every parameter (the common case)."""
        present = flags > 0
        return None if bool(present.all()) else present

    def _present_now(self, here: torch.Tensor) -> torch.Tensor | None:
        """The agreed flags of a compressed step: one small all-reduce."""
        flags = here.clone()
        self.exchange.flags_mean(flags)
        return self._agreed_present(flags)

    def _slices_of(self, present: torch.Tensor | None) -> list[tuple[int, slice]]:
        """(parameter index, slice) of the parameters in ``present`` (all when None)."""
        keep = [True] * len(self.flat.slices) if present is None else present.tolist()
        return [(i, s) for i, (s, ok) in enumerate(zip(self.flat.slices, keep, strict=True)) if ok]

    def _element_mask(self, present: torch.Tensor | None, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The elements to exchange: of a present parameter, and unmasked (None: all)."""
        if present is None:
            return mask
        elements = self.flat.expand(present)
        return elements if mask is None else elements & mask

    # ------------------------------------------------------------------ shared pieces
    def _dense_moments(
        self, t: int, g: torch.Tensor, here: torch.Tensor, span: int = 1
    ) -> torch.Tensor | None:
        """Dense step: average ``g`` (and the has-a-gradient flags, in the same all-reduce), then
        Adam's moment updates for the parameters some rank had a gradient for; ``v`` as if
        ``g * g`` had been seen on each of the last ``span`` steps (0/1 Adam's refreshes after a
        gap). Returns the agreed parameters (None: all)."""
        b1, b2 = self.defaults["betas"]
        flags = self._gradbuf[self.flat.numel :]
        flags.copy_(here)
        self.exchange.dense_mean(self._gradbuf)
        present = self._agreed_present(flags)
        keep = b2**span
        if present is None:
            self.exp_avg.lerp_(g, 1.0 - b1)
            self.exp_avg_sq.mul_(keep).addcmul_(g, g, value=1.0 - keep)
        else:
            for _, s in self._slices_of(present):
                self.exp_avg[s].lerp_(g[s], 1.0 - b1)
                self.exp_avg_sq[s].mul_(keep).addcmul_(g[s], g[s], value=1.0 - keep)
        return present

    def _local_momentum(
        self, g: torch.Tensor, present: torch.Tensor | None, mask: torch.Tensor | None
    ) -> None:
        """``m = b1 m + (1 - b1) g`` for the ``present`` parameters; held at zero where masked."""
        b1 = self.defaults["betas"][0]
        if present is None:
            self.exp_avg.lerp_(g, 1.0 - b1)
        else:
            for _, s in self._slices_of(present):
                self.exp_avg[s].lerp_(g[s], 1.0 - b1)
        if mask is not None:
            self.exp_avg.mul_(mask)

    def _compressed_momentum(
        self, g: torch.Tensor, denom: torch.Tensor, present: torch.Tensor | None, mask: torch.Tensor | None
    ) -> None:
        """Compressed stage: local momentum, then its compressed mean on every rank."""
        self._local_momentum(g, present, mask)
        self._compressed_mean(self.exp_avg, denom, "momentum", self._element_mask(present, mask))

    def _compressed_mean(
        self,
        t: torch.Tensor,
        denom: torch.Tensor,
        key: str,
        elements: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> None:
        """``t`` becomes its compressed mean over the ranks on ``elements`` (a bool mask the same
        on every rank; None: all); the others keep their values. They travel as zeros and what
        arrives for them is dropped: the layout of the exchange never changes, so its residuals
        always fit (a sign codec sends a zero as +-scale; the residual of an element that only
        ever gets zeros alternates within one scale, it cannot grow).

        With ``precondition`` ``t`` travels divided by the frozen denominator (the same on every
        rank, so the mean is unchanged): Adam's per-element normalization makes the elements of
        all layers comparable, which a codec with one scale per partition (onebit) needs; the
        residuals are in those units. ``scale`` (flat, the same on every rank): a factor it
        travels multiplied by (1-bit LAMB's momentum scales)."""
        if elements is not None:
            self._held.copy_(t)
            t.mul_(elements)
        if scale is not None:
            t.mul_(scale)
        if self.precondition:
            t.div_(denom)
        self.exchange.compressed_mean(t, key)
        if self.precondition:
            t.mul_(denom)
        if scale is not None:
            t.div_(scale)
        if elements is not None:
            torch.where(elements, t, self._held, out=t)

    def _denominator(self, v_steps: int) -> torch.Tensor:
        """``sqrt(v / (1 - b2^v_steps)) + eps`` (into a work buffer); also sets the mask of the
        elements whose ``v`` is zero (see the module)."""
        b2 = self.defaults["betas"][1]
        c2 = 1.0 - b2**v_steps
        mask = self.exp_avg_sq > 0
        self._mask = None if bool(mask.all()) else mask
        out = torch.sqrt(self.exp_avg_sq, out=self._denom)
        return out.div_(math.sqrt(c2)).add_(self.defaults["eps"])

    def _frozen_denominator(self) -> torch.Tensor:
        """``v``'s denominator at the freeze step, computed once (not state: rebuilt after a load)."""
        if self._frozen is None:
            self._frozen = self._denominator(self.freeze_step).clone()
        return self._frozen

    def _adamw_update(
        self, t: int, x: torch.Tensor, m: torch.Tensor, denom: torch.Tensor, present: torch.Tensor | None
    ) -> None:
        """``x = x (1 - lr wd) - lr / (1 - b1^t) * m / denom`` (torch's AdamW order) for the
        ``present`` parameters (None: all), each with its group's ``lr`` and ``weight_decay``."""
        c1 = 1.0 - self.defaults["betas"][0] ** t
        if present is None:
            parts = [(g, seg) for g, seg in zip(self.param_groups, self.flat.segments, strict=True)]
        else:
            parts = [(self.param_groups[self.flat.group_of[i]], s) for i, s in self._slices_of(present)]
        for group, seg in parts:
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                x[seg].mul_(1.0 - lr * wd)
            x[seg].addcdiv_(m[seg], denom[seg], value=-lr / c1)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["gradsync"] = {
            "kind": self.kind,
            "world": self.exchange.world,
            "numel": self.flat.numel,
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in self._config().items()},
            "step": self.step_count,
            "exp_avg": self.exp_avg.clone(),
            "exp_avg_sq": self.exp_avg_sq.clone(),
            "exchange": self.exchange.state_dict(),
            **self._extra_state(),
        }
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        ours = state.pop("gradsync", None)
        if ours is None:
            raise ValueError(f"{self.kind}: the state has no 'gradsync' section (another optimizer's?)")
        mine = {k: list(v) if isinstance(v, tuple) else v for k, v in self._config().items()}
        checks = {"kind": self.kind, "world": self.exchange.world, "numel": self.flat.numel, "config": mine}
        for name, want in checks.items():
            if ours[name] != want:
                raise ValueError(
                    f"{self.kind}: the state was saved with {name} {ours[name]!r}, this optimizer has "
                    f"{want!r}; refusing to apply it"
                )
        super().load_state_dict(state)
        dev = self.flat.device
        self.step_count = int(ours["step"])
        self.exp_avg.copy_(ours["exp_avg"].to(dev))
        self.exp_avg_sq.copy_(ours["exp_avg_sq"].to(dev))
        self.exchange.load_state_dict(ours["exchange"], dev)
        self._frozen = None
        self._mask = None
        self._load_extra_state(ours)

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass
