"""The outer loop of the DiLoCo family: synchronize every H inner steps instead of every step.

Each node is one *worker*: its ranks keep their copies identical by synchronizing densely every
inner step (DDP, ``gradsync.wrap`` or FSDP2 over :attr:`OuterLoop.inner_group`), and the nodes
only meet every ``every`` inner steps. There each node's *pseudo-gradient* (where the parameters
were at the last meeting minus where its inner optimizer took them) is averaged across nodes and
an *outer optimizer* (SGD with Nesterov momentum, DiLoCo's choice) moves the shared parameters
by it; every worker then carries on from them.

The average travels through gradsync's machinery: a codec with error feedback (chunked top-k as
SparseLoCo sends, onebit, fp16/bf16, PowerSGD, ...; or none) and the hierarchical path
(:func:`~gradsync.collectives.compressed.compressed_program` with local aggregation): inside a
node the ranks split the tensor, each carries its share across nodes, and an all-gather inside
the node completes it, so one copy per node crosses the slow link.

Streaming (Streaming DiLoCo): ``fragments`` splits the parameters into groups of whole tensors
that meet on a staggered schedule (fragment ``f`` at steps ``(f + 1) * every / fragments`` and
every ``every`` steps after), so the link carries a fragment at a time. With ``delay`` > 0 an
exchange runs on gradsync's task threads while the next ``delay`` inner steps compute, and is
applied when it has landed: the fragment becomes ``mix * local + (1 - mix) * shared`` (local:
what its inner steps made of it meanwhile).

Checkpoints: :meth:`OuterLoop.state_dict` holds the shared parameters, the outer optimizer, the
codec's residuals and any exchange still in flight (waited for, kept unapplied), so a run resumed
from it continues bit for bit. :meth:`OuterLoop.load_resized` resumes on another number of nodes
from every old rank's state: the shared state from any copy, and what error feedback owed summed
over the old ranks and split evenly over the new ones.

References:

- DiLoCo: Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models",
  arXiv:2311.08105.
- Streaming DiLoCo: Douillard et al., "Streaming DiLoCo with overlapping communication",
  arXiv:2501.18512.
- SparseLoCo: Templar's sparse outer-gradient DiLoCo variant, arXiv:2508.15706.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, TypeGuard

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

from gradsync.codecs import Compressor
from gradsync.collectives import primitives as P
from gradsync.collectives.compressed import compressed_program
from gradsync.collectives.dense import allreduce_program
from gradsync.collectives.pieces import apply_pieces
from gradsync.collectives.program import Program, run
from gradsync.collectives.strategies import Coder, run_strategy
from gradsync.collectives.topology import Topology
from gradsync.integrate.checks import OUTER_NODE
from gradsync.integrate.wrap import GradSync
from gradsync.observe.trace import TraceRecorder
from gradsync.optim import CompressedMomentumOptimizer
from gradsync.outer.schedule import check_outer_options, fragment_offset, split_fragments
from gradsync.sync.carry import Layouts, Piece, whole
from gradsync.sync.ledger import Ledger
from gradsync.sync.round import Round, RoundFlags
from gradsync.sync.scheme import Scheme
from gradsync.sync.tasks import Task, TaskManager

FORMAT = "gradsync.outer/1"


@dataclass
class _Exchange:
    """An exchange of one fragment's pseudo-gradient: in flight (``task``) or landed (``mean``)."""

    fragment: int
    due: int
    """The inner step after which it is applied."""
    flat: torch.Tensor
    """The pseudo-gradient, averaged in place across the nodes once the exchange has landed."""
    task: Task | None = None


class OuterLoop:
    """The DiLoCo-family outer loop for ``model`` (see the module text).

    Call :meth:`step` after every inner optimizer step (or pass the ``optimizer``: a hook then
    calls it). ``every``: inner steps between two meetings of a fragment (DiLoCo's H).
    ``codec``: a codec spec for the pseudo-gradient (error feedback is added to biased codecs,
    as ``wrap`` does), or None for a dense average. ``outer_lr``, ``outer_momentum``,
    ``nesterov``: the outer SGD. ``fragments``, ``delay``, ``mix``: streaming (``mix``: the weight
    of the local fragment when a delayed exchange lands; default 0.5 with a delay). ``topology``:
    nodes x ranks per node (default: torchrun's layout).

    Every argument is checked on every rank, then the ranks check that they agree (one small
    all-gather), before any other collective. Then every rank takes rank 0's parameters and
    buffers (as DDP does at construction; under FSDP2, node 0's shards), so the anchors, taken
    next, are the same everywhere however each rank initialized its model.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        every: int = 100,
        codec: str | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fragments: int = 1,
        delay: int = 0,
        mix: float | None = None,
        topology: Topology | None = None,
        timeout_s: float = 300.0,
    ) -> None:
        mix = check_outer_options(
            every=every,
            fragments=fragments,
            delay=delay,
            mix=mix,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
        )
        if not isinstance(model, nn.Module):
            raise TypeError(f"outer loop: model must be a torch.nn.Module, got {type(model).__name__}")
        # the pseudo-gradients' exchange as a scheme (the codec built as every front builds it:
        # error feedback added to biased codecs)
        self.scheme = Scheme.parse(f"allgather/{codec}") if codec is not None else None
        self.codec: Compressor | None = self.scheme.build() if self.scheme is not None else None
        module = bare_module(model)
        trained = list(trained_tensors(model))
        self.names = [n for n, _ in trained]
        self.params = [p for _, p in trained]
        if not self.params:
            raise ValueError("outer loop: the model has no parameter that requires a gradient")
        self.fragments = split_fragments([p.numel() for p in self.params], fragments)
        topo = (topology or Topology()).bind()
        _refuse_per_step_crossing(model, optimizer, topo.node_ranks(topo.node))
        self.every, self.fragments_n, self.delay, self.mix = every, fragments, delay, mix
        self.timeout_s = timeout_s
        self.topo = topo
        setattr(module, OUTER_NODE, topo.node_ranks(topo.node))  # wrap() refuses to span beyond it
        self.sharded = _check_sharding(self.params, self.names, self.topo, self.codec)
        """FSDP2 inside the node: each rank holds a shard, and the shards meet across nodes
        rank by rank (each rank with the same rank of every other node: the inter group)."""
        self.buffers = [b for b in module.buffers() if b.is_floating_point()]
        if self.topo.world > 1:
            P.check_same(
                self.topo.world_group, "gradsync outer loop",
                every=every, fragments=fragments, delay=delay, mix=str(mix), codec=str(codec),
                outer_lr=str(outer_lr), outer_momentum=str(outer_momentum), nesterov=int(nesterov),
                parameters=";".join(self._config()["parameters"]),
                buffers=";".join(f"{n}:{tuple(b.shape)}:{b.dtype}" for n, b in module.named_buffers()),
            )  # fmt: skip
        self._start_alike(module)
        # the shared parameters (where the workers last met; this rank's shards under FSDP2), in
        # float32, and their optimizer
        self.anchors = [local_part(p).detach().float().clone() for p in self.params]
        # (Nesterov needs momentum: with none the outer step is plain SGD, lr 1 a plain average)
        # (foreach: the fused multi-tensor step, which PyTorch takes by default on GPUs only; on
        # a CPU it took VGG's outer step from 42 to 16 ms)
        self.outer = torch.optim.SGD(
            self.anchors, lr=outer_lr, momentum=outer_momentum, nesterov=nesterov and outer_momentum > 0,
            foreach=True,
        )  # fmt: skip
        # each fragment's pseudo-gradient buffer, made once (its exchange lands before the
        # fragment's next one starts, delay < every, so the buffer is free again by then): a
        # fresh one per meeting cost page faults on every meeting on a CPU host
        self._flat = [
            torch.empty(sum(self.anchors[i].numel() for i in m), device=self.anchors[m[0]].device)
            for m in self.fragments
        ]
        self.ledger = Ledger([self.codec] if self.codec is not None else [])
        """What the codec's error feedback owes (its streams, and the carry a resize leaves:
        :meth:`load_resized`), kept by the sync core as every front's is."""
        self.rounds = [Round(self.ledger, _fragment_scope(f, [self.names[i] for i in m]))
                       for f, m in enumerate(self.fragments)]  # fmt: skip
        """Each fragment's meetings as rounds of the ledger, over its own streams (the fragments'
        exchanges overlap when streamed)."""
        self.inner_steps = 0
        self.meetings = [0] * fragments
        """How many times each fragment has been averaged (applied)."""
        self.skipped_meetings = 0
        """Meetings whose average was not finite, skipped on every rank."""
        self.traffic = P.Traffic()
        """Bytes this rank sent in the outer exchanges, per level (``inter``: across nodes)."""
        self._pending: list[_Exchange] = []
        self._manager = TaskManager("gradsync-outer", self.topo.device) if delay else None
        self.inner_group = self._make_inner_groups()
        """This rank's node as a process group of its own, for the inner synchronization
        (``DDP(model, process_group=outer.inner_group)`` or ``gradsync.wrap(model, "none",
        process_group=outer.inner_group)``; a group of one rank with one rank per node); None in a
        world of one rank."""
        self.tracer: TraceRecorder | None = None
        """Where the exchanges' slices go (set :meth:`trace`)."""
        self._hook = None
        if optimizer is not None:  # the inner optimizer's steps call step()
            self._hook = optimizer.register_step_post_hook(self._after_inner_step)

    def _start_alike(self, module: nn.Module) -> None:
        """Every rank takes rank 0's parameters and buffers before the anchors are taken, as DDP
        does at construction: ranks that initialized differently (DDP users need not seed alike)
        would otherwise keep anchors of their own and drift apart at every meeting. Under FSDP2
        each rank takes the shards of the rank with its local index on node 0 (the shards of
        one node are different parts of one model; the nodes' copies must agree)."""
        topo = self.topo
        if topo.world == 1:
            return
        with torch.no_grad():
            for p in module.parameters():
                if is_dtensor(p):
                    # the rank with this local index on node 0
                    P.broadcast(p.to_local(), topo.global_rank(topo.local_rank), topo.inter_group, "inter")
                else:
                    P.broadcast(p.data, 0, topo.control_group, "world")
            for b in module.buffers():
                P.broadcast(b.data, 0, topo.control_group, "world")

    def trace(self, tracer: TraceRecorder) -> None:
        """Record each exchange's slices on gradsync's threads (compute and communication, beside
        the inner steps they overlap) into ``tracer``."""
        self.tracer = tracer
        if self._manager is not None:
            self._manager.record = True

    def _after_inner_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step()

    # ------------------------------------------------------------------ the schedule
    def due(self, fragment: int, step: int) -> bool:
        """Whether ``fragment`` starts an exchange after inner step ``step`` (1-based)."""
        offset = fragment_offset(fragment, self.every, self.fragments_n)
        return step >= offset and (step - offset) % self.every == 0

    def step(self) -> bool:
        """After an inner optimizer step: apply the exchanges that are due and start those the
        schedule asks for. Returns whether the shared parameters changed."""
        self.inner_steps += 1
        t = self.inner_steps
        changed = False
        for ex in [e for e in self._pending if e.due <= t]:
            self._apply(ex)
            changed = True
        for f in range(self.fragments_n):
            if self.due(f, t):
                ex = self._start(f, t)
                if self.delay == 0:
                    self._apply(ex)
                    changed = True
        return changed

    # ------------------------------------------------------------------ one exchange
    def _members(self, fragment: int) -> list[int]:
        return self.fragments[fragment]

    def _pseudo_gradient(self, fragment: int) -> torch.Tensor:
        """The fragment's anchor minus its parameters, written into its buffer (plus what error
        feedback owed before a resize, :meth:`load_resized`, at the fragment's first meeting)."""
        flat, pos = self._flat[fragment], 0
        with torch.no_grad():
            for i in self._members(fragment):
                p, n = local_part(self.params[i]).detach(), self.anchors[i].numel()
                p = p if p.dtype == torch.float32 else p.float()
                torch.sub(self.anchors[i].reshape(-1), p.reshape(-1), out=flat[pos : pos + n])
                pos += n
            if self.ledger.carry.local:  # what a resize left owed, given now (take: it is spent)
                self.ledger.inject(flat, self._pieces(fragment), 1.0, take=True)
        return flat

    def _pieces(self, fragment: int) -> list[Piece]:
        """The fragment's pseudo-gradient as the ledger sees it: its tensors, whole, in order."""
        return whole([(self.names[i], self.anchors[i].numel()) for i in self._members(fragment)])

    def layouts(self) -> Layouts:
        """Where each stream's elements lie: a fragment's streams (``outer/F/...``) in its
        pseudo-gradient, a per-tensor codec's (``outer/NAME/...``) in its tensor."""
        out = Layouts()
        for f in range(self.fragments_n):
            out.add(f"outer/{f}", self._pieces(f))
        for name, a in zip(self.names, self.anchors, strict=True):
            out.add(f"outer/{name}", whole([(name, a.numel())]))
        return out

    def _start(self, fragment: int, t: int) -> _Exchange:
        self.rounds[fragment].begin()
        flat = self._pseudo_gradient(fragment)
        ex = _Exchange(fragment, t + self.delay, flat)
        program = self._program(fragment, flat)
        if self._manager is None:
            with P.record_traffic() as sent:
                run(program)
            self._count(sent)
        else:
            ex.task = self._manager.submit(program, f"outer fragment {fragment}")
            self._pending.append(ex)
        return ex

    def _program(self, fragment: int, flat: torch.Tensor) -> Program:
        topo = self.topo
        if topo.nodes == 1:  # one worker: its pseudo-gradient is the average, nothing to send
            return _nothing_to_send()
        if self.sharded:
            return self._across_nodes(fragment, flat)
        if self.codec is None:
            return allreduce_program(flat, topo, "hierarchical" if topo.per_node > 1 else "flat", "mean")
        parts = None
        if self.codec.per_tensor:  # PowerSGD: each tensor a matrix of its own
            parts, pos = [], 0
            for i in self._members(fragment):
                n = self.params[i].numel()
                parts.append((flat[pos : pos + n].view(self.params[i].shape), f"outer/{self.names[i]}"))
                pos += n
        return compressed_program(
            flat, topo, self.codec, "allgather", topo.per_node > 1 and topo.nodes > 1, "mean",
            f"outer/{fragment}", parts=parts,
        )  # fmt: skip

    def _across_nodes(self, fragment: int, flat: torch.Tensor) -> Program:
        """The mean over the nodes of this rank's shard, with the same rank of every node."""
        topo, group = self.topo, self.topo.inter_group
        if topo.nodes == 1 or group is None:
            return None
        if self.codec is None:
            yield partial(P.all_reduce, flat, group, "inter")
            return partial(flat.div_, topo.nodes)
        coder = Coder(self.codec, f"outer/{fragment}", 1.0)
        pieces = yield from run_strategy(flat, group, "inter", coder, "allgather", topo.rank, final=True)
        return partial(apply_pieces, pieces, flat, coder.plain, 1.0 / topo.nodes)

    def _apply(self, ex: _Exchange) -> None:
        if ex.task is not None:
            assert self._manager is not None
            self._manager.wait([ex.task], timeout=self.timeout_s)
            self._count_manager()
            if self.tracer is not None:
                self.tracer.task(ex.task, self.inner_steps)
            ex.task = None
        if ex in self._pending:
            self._pending.remove(ex)
        # the average is the same on every rank: a non-finite one (some node's inner steps
        # diverged) is skipped everywhere, never half applied: the fragment's parameters go back
        # to the anchors and error feedback's commits of this exchange are undone
        overflow = not bool(torch.isfinite(ex.flat).all())
        self.rounds[ex.fragment].end(RoundFlags(overflow), poison=lambda: self._reset_to_anchors(ex.fragment))
        if overflow:
            self.skipped_meetings += 1
            return
        self._outer_step(ex.fragment, ex.flat)
        if ex.fragment == 0 and self.buffers and self.topo.world > 1:
            with torch.no_grad():
                self._average_buffers()
        self.meetings[ex.fragment] += 1

    def _reset_to_anchors(self, fragment: int) -> None:
        """The fragment's parameters take the anchors (its inner steps since the last meeting are
        dropped: they led somewhere non-finite on some node)."""
        with torch.no_grad():
            for i in self._members(fragment):
                p = local_part(self.params[i])
                p.copy_(self.anchors[i].to(p.dtype))

    def _outer_step(self, fragment: int, mean: torch.Tensor) -> None:
        """The outer SGD on the fragment's anchors with the averaged pseudo-gradient ``mean``,
        then the fragment's parameters take the anchors (or mix with them)."""
        members = self._members(fragment)
        pos = 0
        for i in members:  # the averaged pseudo-gradient is the outer optimizer's gradient
            n = self.anchors[i].numel()
            self.anchors[i].grad = mean[pos : pos + n].view(self.anchors[i].shape)
            pos += n
        self.outer.step()
        with torch.no_grad():
            for i in members:
                self.anchors[i].grad = None
                p = local_part(self.params[i])
                if self.mix and p.dtype == torch.float32:  # mix p + (1 - mix) anchor, in place
                    p.lerp_(self.anchors[i], 1.0 - self.mix)
                elif self.mix:
                    p.copy_((self.mix * p.float() + (1.0 - self.mix) * self.anchors[i]).to(p.dtype))
                else:
                    p.copy_(self.anchors[i].to(p.dtype))

    def _average_buffers(self) -> None:
        """Floating buffers (BatchNorm statistics) averaged over every rank with fragment 0."""
        flat = torch.cat([b.detach().float().reshape(-1) for b in self.buffers])
        # on the control group: an exchange in flight on the task threads has the other groups
        with P.record_traffic() as sent:
            P.all_reduce(flat, self.topo.control_group, "world")
        flat.div_(self.topo.world)
        self._count(sent)
        pos = 0
        for b in self.buffers:
            b.copy_(flat[pos : pos + b.numel()].view(b.shape).to(b.dtype))
            pos += b.numel()

    def _count(self, sent: P.Traffic) -> None:
        for level, n in sent.sent.items():
            self.traffic.add(level, n)

    def _count_manager(self) -> None:
        if self._manager is not None:
            for level, n in self._manager.take_traffic().items():
                self.traffic.add(level, n)

    def _make_inner_groups(self) -> dist.ProcessGroup | None:
        topo = self.topo
        if topo.world == 1:
            return None
        mine = None  # (a node of one rank gets a group of one: the same code works for any layout)
        for node in range(topo.nodes):  # every rank creates every group, in the same order
            g = dist.new_group(topo.node_ranks(node))
            if node == topo.node:
                mine = g
        return mine

    @contextlib.contextmanager
    def shared_parameters(self) -> Iterator[None]:
        """Inside the block the model holds the shared parameters (where the workers last met,
        DiLoCo's global model: what to evaluate); its own come back after."""
        with torch.no_grad():
            own = [local_part(p).detach().clone() for p in self.params]
            for p, a in zip(self.params, self.anchors, strict=True):
                local_part(p).copy_(a.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for p, o in zip(self.params, own, strict=True):
                    local_part(p).copy_(o)

    def describe(self) -> str:
        """One line: the schedule and the codec."""
        codec = self.codec.spec() if self.codec is not None else "dense"
        streaming = f", {self.fragments_n} fragments" if self.fragments_n > 1 else ""
        delayed = f", applied {self.delay} steps later (mix {self.mix:g})" if self.delay else ""
        group = self.outer.param_groups[0]
        nesterov = " nesterov" if group["nesterov"] else ""
        return (
            f"outer loop every {self.every} inner steps{streaming}{delayed}, pseudo-gradients {codec}, "
            f"outer SGD lr {group['lr']:g} momentum {group['momentum']:g}{nesterov}"
        )

    # ------------------------------------------------------------------ state
    def finish(self) -> None:
        """Wait for and apply every exchange still in flight (at the end of training)."""
        for ex in list(self._pending):
            self._apply(ex)

    def close(self) -> None:
        """Stop the task threads and the optimizer hook (exchanges in flight are applied first)."""
        self.finish()
        if self._manager is not None:
            self._manager.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs: waits for exchanges in flight and keeps them unapplied."""
        pending = []
        for ex in self._pending:
            if ex.task is not None:
                assert self._manager is not None
                self._manager.wait([ex.task], timeout=self.timeout_s)
                self._count_manager()
                ex.task = None
            pending.append({"fragment": ex.fragment, "due": ex.due, "mean": ex.flat.clone()})
        return {
            "format": FORMAT,
            "config": self._config(),
            "inner_steps": self.inner_steps,
            "meetings": list(self.meetings),
            "anchors": [a.detach().clone() for a in self.anchors],
            "outer": self.outer.state_dict(),
            "ledger": self.ledger.state_dict(),
            "pending": pending,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same configuration and parameters are required)."""
        if state.get("format") != FORMAT:
            raise ValueError(
                f"outer loop: not an outer-loop state ({state.get('format')!r}, want {FORMAT!r})"
            )
        mine, theirs = self._config(), state["config"]
        diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
        if diff:
            detail = ", ".join(f"{k}: saved {theirs.get(k)!r} vs now {mine.get(k)!r}" for k in diff)
            raise ValueError(f"outer loop: the state was saved with another configuration ({detail})")
        self.finish()
        self.inner_steps = int(state["inner_steps"])
        self.meetings = [int(m) for m in state["meetings"]]
        with torch.no_grad():
            for a, saved in zip(self.anchors, state["anchors"], strict=True):
                a.copy_(saved)
        self.outer.load_state_dict(state["outer"])
        # (a state saved before the ledger held the codec: its "codec" entry, which the ledger reads)
        self.ledger.load_state_dict(state.get("ledger", state))
        device = self.anchors[0].device
        self._pending = [
            _Exchange(int(p["fragment"]), int(p["due"]), p["mean"].to(device)) for p in state["pending"]
        ]

    def load_resized(self, states: Sequence[dict[str, Any]]) -> None:
        """Resume from the :meth:`state_dict` of every rank of a run with another number of nodes
        (or ranks per node): each rank of the new run passes the states of all the old ranks, in
        rank order.

        What is the same on every node (the anchors, the outer optimizer's momentum, the meetings
        so far and an exchange still in flight, whose average every rank holds) is taken from
        the first state, after checking that every state agrees on the anchors. What error
        feedback owed differs per rank: the residuals of every old rank are placed at their
        elements of each fragment and summed, and each new rank takes an equal share of that
        total, ``1 / world`` of it, added to the fragment's next pseudo-gradient. Every path
        sums what the ranks send (inside a node the ranks' copies are summed before a rank of
        each node encodes its shard), so the new ranks' shares add up to the old total exactly:
        the sum over ranks of what is owed carries over. Codec state other than residuals
        (generators, reused thresholds) is the same on every rank and comes from the first state.

        The model's parameters and the inner optimizer are the caller's: a node whose own
        parameters are gone takes the shared ones (``load`` the anchors: see
        :meth:`shared_parameters`). Refused, with a ``ValueError`` before anything changes: an
        empty list, states of another configuration (apart from the topology), states that
        disagree, and outer loops over FSDP2 shards (each rank's anchors are its shards; moving
        them to another layout is a resharding this method does not do).
        """
        if not isinstance(states, Sequence) or not states or not all(isinstance(s, dict) for s in states):
            raise ValueError(
                "outer loop: load_resized needs the state_dict() of every old rank, in rank order"
            )
        if self.sharded:
            raise ValueError(
                "outer loop: load_resized does not reshard FSDP2 anchors; resume FSDP2 runs with "
                "the same topology (load_state_dict)"
            )
        for r, state in enumerate(states):
            if state.get("format") != FORMAT:
                raise ValueError(
                    f"outer loop: state {r} is not an outer-loop state ({state.get('format')!r})"
                )
            mine = {k: v for k, v in self._config().items() if k != "topology"}
            theirs = {k: v for k, v in state["config"].items() if k != "topology"}
            diff = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            if diff:
                detail = ", ".join(f"{k}: saved {theirs.get(k)!r} vs now {mine.get(k)!r}" for k in diff)
                raise ValueError(f"outer loop: state {r} was saved with another configuration ({detail})")
        first = states[0]
        nodes, per_node = (int(v) for v in first["config"]["topology"])
        if len(states) != nodes * per_node:
            raise ValueError(
                f"outer loop: load_resized needs the states of all {nodes * per_node} ranks of the saved "
                f"run ({nodes} nodes x {per_node}), got {len(states)}"
            )
        for r, state in enumerate(states[1:], start=1):
            same = state["inner_steps"] == first["inner_steps"] and list(state["meetings"]) == list(
                first["meetings"]
            )
            same = same and all(
                torch.equal(a, b) for a, b in zip(state["anchors"], first["anchors"], strict=True)
            )
            if not same:
                raise ValueError(
                    f"outer loop: the states of rank 0 and rank {r} disagree on the shared model "
                    "(anchors or meetings): they are not one run's"
                )
        for i, a in enumerate(first["anchors"]):
            if tuple(a.shape) != tuple(self.anchors[i].shape):
                raise ValueError(
                    f"outer loop: saved anchor {self.names[i]} has shape {tuple(a.shape)}, the model's "
                    f"is {tuple(self.anchors[i].shape)}"
                )
        # every old rank's residuals (and what a resize before left it), traced back to the
        # parameters by the core's books and summed
        totals: dict[str, torch.Tensor] = {}
        for state in states:
            fresh = self.scheme.build() if self.scheme is not None else None
            old = Ledger([fresh] if fresh is not None else [])
            old.load_state_dict(state.get("ledger", state))
            for name, t in old.owed_gradients(self.layouts(), 1).items():
                totals[name] = totals[name] + t.double().cpu() if name in totals else t.double().cpu()
        first_ledger = dict(first["ledger"] if "ledger" in first else {"codec": first.get("codec")})
        if self.codec is not None:  # generators and thresholds from the first state; residuals below
            codecs = first_ledger.get("codecs") or [first_ledger.get("codec")]
            kept = dict(codecs[0]) if codecs and codecs[0] is not None else None
            if kept is not None and "streams" in kept:  # error feedback: the residuals travel as shares
                kept["streams"] = {}
            first_ledger = {"codecs": [kept] if kept is not None else [], "carry": None}
        else:
            first_ledger = {"codecs": [], "carry": None}
        self.load_state_dict({**first, "config": self._config(), "ledger": first_ledger})
        for name, t in totals.items():  # this rank's share, given to the next pseudo-gradients
            anchor = self.anchors[self.names.index(name)]
            self.ledger.carry.add_local(name, (t / self.topo.world).to(anchor.device, anchor.dtype))

    def owed_gradients(self) -> dict[str, torch.Tensor]:
        """What this rank's error feedback still owes the average across nodes, per parameter
        name (the core's books: :meth:`~gradsync.sync.ledger.Ledger.owed_gradients`, the
        residuals traced back through :meth:`layouts`, and a share carried over a resize that has
        not met yet), divided by the world size: summed over the ranks, what the averages would
        still receive if nothing more were compressed away."""
        return self.ledger.owed_gradients(self.layouts(), self.topo.world)

    def owed(self) -> dict[int, torch.Tensor]:
        """What this rank's error feedback owes, per fragment, in float64, not divided by the
        world size: :meth:`owed_gradients` times the world, laid out as each fragment's
        pseudo-gradient (fragments that owe nothing left out)."""
        per = self.ledger.owed_gradients(self.layouts(), 1)
        out = {}
        for f, members in enumerate(self.fragments):
            if any(self.names[i] in per for i in members):
                out[f] = torch.cat([
                    per[self.names[i]].reshape(-1).double().cpu() if self.names[i] in per
                    else torch.zeros(self.anchors[i].numel(), dtype=torch.float64)
                    for i in members
                ])  # fmt: skip
        return out

    def _config(self) -> dict[str, Any]:
        cut = {"cut": [g[0] for g in self.fragments]} if self.fragments_n > 1 else {}  # first tensors
        return {
            **cut,
            "every": self.every,
            "fragments": self.fragments_n,
            "delay": self.delay,
            "mix": self.mix,
            "codec": self.codec.spec() if self.codec is not None else None,
            "parameters": [f"{n}:{tuple(p.shape)}" for n, p in zip(self.names, self.params, strict=True)],
            "topology": [self.topo.nodes, self.topo.per_node],
        }


def _fragment_scope(fragment: int, names: list[str]) -> Callable[[str], bool]:
    """Whether a stream key is one of ``fragment``'s: ``outer/F/...``, or a per-tensor codec's
    ``outer/NAME...`` of one of its tensors."""
    own = f"outer/{fragment}/"
    tensors = tuple(f"outer/{n}" for n in names)

    def scope(key: str) -> bool:
        return key.startswith(own) or any(key == t or key.startswith(t + "/") for t in tensors)

    return scope


def _refuse_per_step_crossing(
    model: nn.Module, optimizer: torch.optim.Optimizer | None, node: list[int]
) -> None:
    """The outer loop's slow link carries pseudo-gradients only: a per-step synchronization
    (wrap or DDP) over ranks beyond this rank's node (global ranks ``node``), or an optimizer
    that exchanges compressed momentum every step, would cross it every step as well."""
    if isinstance(model, GradSync):
        check_outer_scope_of(
            model.engine.topo.global_ranks(), node, f"wrapped ({model.engine.scheme.text!r})"
        )
    elif isinstance(model, nn.parallel.DistributedDataParallel):
        check_outer_scope_of(dist.get_process_group_ranks(model.process_group), node, "wrapped in DDP")
    if isinstance(optimizer, CompressedMomentumOptimizer):
        raise ValueError(
            f"outer loop: {type(optimizer).__name__} exchanges compressed momentum across ranks every step; "
            "inside an outer loop use a local optimizer (AdamW, SGD, LAMB...) and let the outer loop "
            "average the pseudo-gradients"
        )


def check_outer_scope_of(ranks: list[int], node: list[int], what: str) -> None:
    """Refuse a model synchronized every step over global ``ranks`` beyond the node ``node``."""
    outside = sorted(set(ranks) - set(node))
    if outside:
        raise ValueError(
            f"outer loop: the model is {what} over ranks {sorted(ranks)}, beyond this rank's node (ranks "
            f"{node}): it would average across nodes every inner step, crossing the slow link the outer "
            "loop spares. Synchronize inside the node: create the OuterLoop first, then "
            "gradsync.wrap(model, ..., process_group=outer.inner_group) or "
            "DDP(model, process_group=outer.inner_group), and give the outer loop the codec"
        )


def _nothing_to_send() -> Program:
    """A program without a step (one node: no exchange)."""
    return None
    yield  # (a generator: the task manager runs it like any program)


def is_dtensor(t: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor (FSDP2's sharded parameters), without importing DTensor's
    module for the answer: no tensor is one before that module was imported, and importing it
    costs every ``import gradsync`` about a second (it pulls sympy)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def local_part(p: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter: its shard under FSDP2 (a DTensor), else itself."""
    return p.to_local() if is_dtensor(p) else p


def _check_sharding(
    params: list[torch.Tensor], names: list[str], topo: Topology, codec: Compressor | None
) -> bool:
    """Whether the parameters are FSDP2 shards; if so, they must be sharded over this rank's
    node exactly (the meeting pairs each rank with the same rank of the other nodes), and the
    codec must not need whole matrices."""
    sharded = [is_dtensor(p) for p in params]
    if not any(sharded):
        return False
    node = topo.node_ranks(topo.node)
    for name, p in zip(names, params, strict=True):
        ranks = sorted(int(r) for r in p.device_mesh.mesh.flatten().tolist()) if is_dtensor(p) else None
        if ranks != node:
            where = "not sharded" if ranks is None else f"sharded over ranks {ranks}"
            raise ValueError(
                f"outer loop: with FSDP2 every trained parameter must be sharded over this rank's node "
                f"(ranks {node}: fully_shard(..., mesh=<the node's mesh>)); {name} is {where}"
            )
    if codec is not None and codec.per_tensor:
        raise ValueError(
            f"outer loop: {codec.spec()} needs whole matrices, and under FSDP2 each rank holds shards; "
            "use a codec that takes any tensor (chunktopk, onebit, bf16...)"
        )
    return True


def bare_module(model: nn.Module) -> nn.Module:
    """The module inside a ``wrap`` or DDP wrapper (the model itself otherwise)."""
    inner = model.module if isinstance(model, (GradSync, nn.parallel.DistributedDataParallel)) else model
    assert isinstance(inner, nn.Module)
    return inner


def trained_tensors(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The parameters the outer loop averages: those that require a gradient, in model order."""
    return ((n, p) for n, p in bare_module(model).named_parameters() if p.requires_grad)


__all__ = ["FORMAT", "OuterLoop", "bare_module", "local_part", "trained_tensors"]
