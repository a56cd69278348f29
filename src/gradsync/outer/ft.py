"""The outer loop with live recovery: torchft forms the meetings, and a node that dies costs no
restart.

Under :class:`FaultTolerantOuterLoop` every node is a *replica group* of torchft: its ranks are a
``torch.distributed`` world of their own (one ``torchrun`` per node), synchronized inside the
node every inner step as usual (:attr:`OuterLoop.inner_group`). Across nodes nothing is a
fixed world. At each meeting torchft's :class:`~torchft.Manager` asks the *lighthouse* for a
quorum (the nodes alive now), reconfigures torchft's gloo process group to it, and the
pseudo-gradients travel over that group through gradsync's codec and error feedback (rank ``j``
of a node carries the ``j``-th slice of the pseudo-gradient, with rank ``j`` of every other
node; the slices are gathered back inside the node). The average is over the nodes that
contributed to this meeting, so the outer step keeps its size when a node is missing: it is the
same outer SGD on the mean of fewer pseudo-gradients, noisier but not smaller.

A meeting is applied only when torchft's ``should_commit`` says every rank of the node got the
whole exchange. Otherwise it is discarded, the codec's state (residuals, generators) goes back
to what it was before the exchange, and the meeting is tried again with a new quorum (without
the dead node, once the lighthouse has missed its heartbeats), from the same pseudo-gradient:
the anchors, the outer optimizer and what error feedback owes never hold half an exchange.

A node that (re)starts *heals*: its first quorum finds the others further on, and torchft
fetches the state of a live peer (anchors, outer optimizer, the model's parameters and buffers,
the inner optimizer, inner step and meetings, the codec's generators and thresholds, and
whatever the caller registers with ``extra_state``, such as the data position) while the
others wait in that meeting; the healed node then takes part in it without a pseudo-gradient of
its own (it holds its peer's parameters, so sending would count that peer twice). Residuals are
not copied: what error feedback owes belongs to the node that accumulated it, so a copy would
be sent twice. A restarted node owes nothing; a live node that fell behind keeps its own (and if
its peers applied the exchange it failed to finish, it takes the residuals that exchange left
it, recognised by the exchange's identity). What a dead node owed dies with it, like the inner
steps it had not sent.

Data: each node reads its own shard at the position the meetings agree on (the caller's
``extra_state`` carries it, :mod:`gradsync.apps.train` does so). The samples a dead node would
have trained on until it rejoins are skipped, not handed to the survivors: the global batch is
smaller meanwhile, and those samples come back in later epochs' orders.

torchft is an optional extra (``pip install 'gradsync[ft]'``); this module imports it only when
a fault-tolerant loop or a lighthouse is made. Its network endpoints are torchft's own: the
lighthouse (gRPC), each node's manager server and its state server (HTTP, bound to every
interface), and the node's TCPStore. State travels in torch's serialization and is read with
``weights_only=True`` here (torchft's own transport would unpickle anything). torchft, like
torch.distributed, has no authentication: run it on trusted networks only.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync.codecs import build_codec
from gradsync.collectives import primitives as P
from gradsync.collectives.pieces import Piece, apply_pieces
from gradsync.collectives.strategies import Coder
from gradsync.collectives.topology import Topology
from gradsync.outer.loop import OuterLoop, bare_module, local_part

STATE_KEY = "gradsync.outer"
FT_FORMAT = "gradsync.outer.ft/1"
_NONCE_BITS = 56


def import_torchft() -> Any:
    """The ``torchft`` module, or an ``ImportError`` that says how to install it."""
    # torchft's Rust side logs every quorum and vote at INFO level to stderr, unless RUST_LOG
    # says otherwise: warnings are enough for a training run (set RUST_LOG=info to see them)
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as e:
        raise ImportError(
            "fault tolerance needs torchft, which is not installed: pip install 'gradsync[ft]' "
            f"(or pip install torchft) ({e})"
        ) from None
    return torchft


@dataclass(frozen=True)
class FaultTolerance:
    """Where the lighthouse is and how long things may take (``ValueError`` naming the field for
    a value out of range).

    ``lighthouse``: the lighthouse's address (``http://HOST:PORT``; :func:`start_lighthouse`
    gives one). ``replica_id``: this node's name, the same for all its ranks and unique among
    the nodes (torchft adds a fresh suffix each time the node starts). ``nodes``: how many nodes
    the run starts with: the first meeting waits for them (up to ``join_timeout_s``) and takes
    the first node's parameters everywhere. ``min_nodes``: a meeting with fewer live nodes is
    not applied (it is tried again). ``host``: the address other nodes reach this node's store,
    manager and state server at. ``timeout_s``: one collective, a state transfer or a commit
    vote. ``quorum_timeout_s``: how long a meeting waits for its quorum; it must exceed the time
    between two meetings, since a node that fell behind waits there for the others' next one.
    ``max_retries``: failed tries of one meeting before giving up with an error."""

    lighthouse: str
    replica_id: str
    nodes: int = 1
    min_nodes: int = 1
    host: str = "127.0.0.1"
    timeout_s: float = 60.0
    quorum_timeout_s: float = 600.0
    join_timeout_s: float = 600.0
    max_retries: int = 10

    def __post_init__(self) -> None:
        for name in ("lighthouse", "replica_id", "host"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"fault tolerance: {name} must be a non-empty string, got {value!r}")
        for name, lo in (("nodes", 1), ("min_nodes", 1), ("max_retries", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"fault tolerance: {name} must be an integer >= {lo}, got {value!r}")
        for name in ("timeout_s", "quorum_timeout_s", "join_timeout_s"):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf")
            if not ok:
                raise ValueError(
                    f"fault tolerance: {name} must be a positive number of seconds, got {value!r}"
                )
        if self.min_nodes > self.nodes:
            raise ValueError(
                f"fault tolerance: min_nodes must be at most nodes (the run starts with {self.nodes}), "
                f"got {self.min_nodes}"
            )

    def describe(self) -> str:
        return ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self))


class Lighthouse:
    """torchft's lighthouse (the quorum server) in this process: :attr:`address` for the nodes,
    :meth:`close` to stop it. ``min_nodes``: the smallest quorum it forms. A node whose
    heartbeats stop for ``heartbeat_timeout_s`` is dropped from the next quorum; a quorum waits
    ``join_timeout_s`` at most for live nodes that have not asked for it yet."""

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        min_nodes: int = 1,
        join_timeout_s: float = 60.0,
        heartbeat_timeout_s: float = 5.0,
    ) -> None:
        if not isinstance(min_nodes, int) or isinstance(min_nodes, bool) or min_nodes < 1:
            raise ValueError(f"lighthouse: min_nodes must be an integer >= 1, got {min_nodes!r}")
        for name, value in (("join_timeout_s", join_timeout_s), ("heartbeat_timeout_s", heartbeat_timeout_s)):
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < 1e6:
                raise ValueError(f"lighthouse: {name} must be a positive number of seconds, got {value!r}")
        import_torchft()
        from torchft._torchft import LighthouseServer

        self._server = LighthouseServer(
            bind=bind,
            min_replicas=min_nodes,
            join_timeout_ms=int(join_timeout_s * 1000),
            heartbeat_timeout_ms=int(heartbeat_timeout_s * 1000),
        )
        address = self._server.address()
        # torchft names the machine; nodes on this machine reach a loopback bind by its address
        host = bind.rsplit(":", 1)[0]
        if host not in ("", "0.0.0.0", "[::]"):
            address = f"http://{host}:{address.rsplit(':', 1)[1]}"
        self.address: str = address

    def close(self) -> None:
        self._server.shutdown()


def start_lighthouse(
    min_nodes: int = 1,
    bind: str = "127.0.0.1:0",
    join_timeout_s: float = 60.0,
    heartbeat_timeout_s: float = 5.0,
) -> Lighthouse:
    """A :class:`Lighthouse` in this process (on loopback and a port the OS picks by default)."""
    return Lighthouse(bind, min_nodes, join_timeout_s, heartbeat_timeout_s)


def _weights_only_transport(timeout: datetime.timedelta, host: str) -> Any:
    """torchft's HTTP state transport, reading what arrives with ``weights_only=True`` (tensors
    and plain values; torchft's own reader unpickles anything) and naming ``host`` as its
    address (torchft names the machine, which may not resolve)."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class WeightsOnlyHTTPTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: datetime.timedelta) -> object:
            with (
                urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f,
                warnings.catch_warnings(),
            ):
                # (torch reads the tensors straight from the response's read-only bytes)
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                return _streaming_load(f, weights_only=True)

        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return WeightsOnlyHTTPTransport(timeout=timeout, num_chunks=0)


def _gather(pg: Any, t: torch.Tensor) -> list[torch.Tensor]:
    """Every replica's ``t`` (same size everywhere) over torchft's process group, in replica order."""
    from torch.distributed.distributed_c10d import AllgatherOptions

    out = [torch.empty_like(t) for _ in range(pg.size())]
    pg.allgather([out], [t], AllgatherOptions()).wait()
    return out


def _sum(pg: Any, t: torch.Tensor) -> None:
    """``t`` summed over the replicas in place, over torchft's process group."""
    from torch.distributed.distributed_c10d import AllreduceOptions

    opts = AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.SUM)
    pg.allreduce([t], opts).wait()


def _broadcast(pg: Any, t: torch.Tensor, root: int) -> None:
    from torch.distributed.distributed_c10d import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = root
    pg.broadcast([t], opts).wait()


class _ConfigMismatch(ValueError):
    """Nodes of one run with different outer-loop configurations (never retried)."""


StateFns = tuple[Callable[[Any], None], Callable[[], Any]]


class FaultTolerantOuterLoop(OuterLoop):
    """:class:`OuterLoop` whose meetings run through torchft (see the module text).

    ``fault_tolerance`` says where the lighthouse is and names this node. ``topology`` is the
    node's own world (by default every rank of the current ``torch.distributed`` world, or a
    single process without one). ``extra_state`` maps a key to ``(load, save)`` functions of
    more state a healing node takes from its peer (the data position, a scheduler...): every
    node must register the same keys. The schedule, codec and outer optimizer arguments are
    :class:`OuterLoop`'s; a delayed exchange (``delay``) is not offered (an exchange in flight
    across a change of quorum), nor codecs that need whole matrices (PowerSGD: each rank sends
    a slice).

    The constructor joins: the first nodes wait for each other (``nodes``) and start from the
    first one's parameters; a node that joins a running job heals from a peer at the peers' next
    meeting and takes part in it. Counters: :attr:`recoveries` (heals), :attr:`heal_seconds`
    (how long each heal's quorum took, transfer included), :attr:`failed_exchanges`."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        fault_tolerance: FaultTolerance,
        every: int = 100,
        codec: str | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
        fragments: int = 1,
        topology: Topology | None = None,
        timeout_s: float = 300.0,
        extra_state: Mapping[str, StateFns] | None = None,
    ) -> None:
        if not isinstance(fault_tolerance, FaultTolerance):
            raise TypeError(
                "fault tolerance: fault_tolerance must be a gradsync.outer.ft.FaultTolerance, got "
                f"{type(fault_tolerance).__name__}"
            )
        if codec is not None:
            built = build_codec(codec)  # (a bad spec is refused here, naming it)
            if built.lowrank or built.per_tensor:
                raise ValueError(
                    f"fault tolerance: codec {codec!r} needs whole matrices, and under fault tolerance each "
                    "rank of a node sends a slice; use a codec that takes any tensor (chunktopk, topk, "
                    "onebit, terngrad, bf16...)"
                )
        extra = dict(extra_state or {})
        for key, fns in extra.items():
            ok = isinstance(fns, tuple) and len(fns) == 2 and all(callable(f) for f in fns)
            if not isinstance(key, str) or key == STATE_KEY or not ok:
                raise ValueError(
                    f"fault tolerance: extra_state maps a key other than {STATE_KEY!r} to (load, save) "
                    f"functions, got {key!r}: {fns!r}"
                )
        if topology is None:
            initialized = dist.is_available() and dist.is_initialized()
            topology = Topology(1, dist.get_world_size()) if initialized else Topology()
        if topology.nodes != 1:
            raise ValueError(
                f"fault tolerance: each node is a torch.distributed world of its own (one torchrun per "
                f"node); the topology must be one node, got {topology.nodes} nodes x {topology.per_node}"
            )
        torchft = import_torchft()  # (before any collective: a missing torchft fails every rank alike)
        super().__init__(
            model, optimizer, every=every, codec=codec, outer_lr=outer_lr, outer_momentum=outer_momentum,
            nesterov=nesterov, fragments=fragments, topology=topology, timeout_s=timeout_s,
        )  # fmt: skip
        self.ft = fault_tolerance
        self._optimizer = optimizer
        self._module = bare_module(model)
        self._signature = P.stable_hash(
            json.dumps(
                {**{k: v for k, v in self._config().items() if k != "topology"},
                 "per_node": self.topo.per_node, "outer": repr(self.outer.defaults)},
                sort_keys=True,
            )
        )  # fmt: skip
        self.recoveries = 0
        self.heal_seconds: list[float] = []
        self.failed_exchanges = 0
        self._meeting: tuple[int, int] | None = None
        """The meeting (fragment, inner step) in progress: a node healing from this one joins it."""
        self._healed = False
        self._last_commit = 0
        """The identity of the last exchange this node applied (a hash of every node's nonce)."""
        self._tentative: tuple[int, dict[str, Any]] | None = None
        """After a failed exchange: its identity and the codec state it left, in case the peers
        applied it (then it is this node's)."""
        self._buffer_mean: torch.Tensor | None = None
        ft = self.ft
        timeout = datetime.timedelta(seconds=ft.timeout_s)
        self._pg = torchft.ProcessGroupGloo(timeout=timeout)
        store_port = self._replica_store()
        self.manager = torchft.Manager(
            pg=self._pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=ft.min_nodes,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=datetime.timedelta(seconds=ft.quorum_timeout_s),
            connect_timeout=timeout,
            rank=self.topo.rank,
            world_size=self.topo.world,
            store_addr=ft.host,
            store_port=store_port,
            lighthouse_addr=ft.lighthouse,
            replica_id=ft.replica_id,
            hostname=ft.host,
            checkpoint_transport=_weights_only_transport(timeout, ft.host),
            init_sync=False,
        )
        self.manager.register_state_dict_fn(STATE_KEY, self._load_healed, self._healing_state)
        for key, (load, save) in extra.items():
            self.manager.register_state_dict_fn(key, load, save)
        self._join()

    # ------------------------------------------------------------------ set-up
    def _replica_store(self) -> int:
        """The node's own TCPStore (torchft's manager and the peers' group set-up meet there),
        made by the node's first rank on a port the OS picks; the port reaches the node's other
        ranks over the node's world."""
        port = torch.zeros(1, dtype=torch.int64)
        if self.topo.rank == 0:
            self._store = dist.TCPStore(self.ft.host, 0, is_master=True, wait_for_workers=False)
            port[0] = self._store.port
        if self.topo.world > 1:
            P.broadcast(port, self.topo.global_rank(0), self.topo.control_group, "intra")
        return int(port[0])

    def _join(self) -> None:
        """Wait for the first nodes, or heal from a running job's (see the class text)."""
        deadline = time.monotonic() + self.ft.join_timeout_s
        while True:
            if self._quorum():
                if self._meeting is not None:  # the peers are in a meeting: take part in it
                    self._meet(self._meeting[0], quorum_done=True)
                return
            n = self.manager.num_participants()
            if n >= self.ft.nodes:
                if self._start_together():
                    return
            elif time.monotonic() > deadline:
                raise TimeoutError(
                    f"fault tolerance: {n} of the {self.ft.nodes} nodes the run starts with (nodes) "
                    f"joined within join_timeout_s={self.ft.join_timeout_s:g}"
                )
            else:
                time.sleep(0.05)

    def _quorum(self) -> bool:
        """A new quorum; whether this node healed in it."""
        self._healed = False
        started = time.perf_counter()
        self.manager.start_quorum()
        if self._healed:
            self.heal_seconds.append(time.perf_counter() - started)
        return self._healed

    def _meeting_quorum(self) -> bool:
        """A quorum of at least ``min_nodes`` nodes (asked again while it is smaller, up to
        ``quorum_timeout_s``); whether this node healed on the way."""
        deadline = time.monotonic() + self.ft.quorum_timeout_s
        healed = False
        while True:
            healed = self._quorum() or healed
            n = self.manager.num_participants()
            if n >= self.ft.min_nodes:
                return healed
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"fault tolerance: {n} live nodes, fewer than min_nodes={self.ft.min_nodes}, for "
                    f"quorum_timeout_s={self.ft.quorum_timeout_s:g}"
                )
            time.sleep(0.1)

    def _start_together(self) -> bool:
        """The first meeting of the first nodes: every node takes node 0's parameters and
        buffers (torchft's replica rank 0), as DDP does at construction. Whether it was applied."""
        module = self._module
        try:
            table = [row.tolist() for row in _gather(self._pg, torch.tensor([self._signature]))]
            self._check_signatures([[1, 0, r[0], 0] for r in table])
            with torch.no_grad():
                params = [local_part(p).data for p in module.parameters()]
                for t in [*params, *(b.data for b in module.buffers())]:
                    _broadcast(self._pg, t, 0)
        except _ConfigMismatch:
            raise
        except Exception as e:
            self.manager.report_error(e)
        if not self.manager.should_commit():
            self.failed_exchanges += 1
            return False
        with torch.no_grad():
            for a, p in zip(self.anchors, self.params, strict=True):
                a.copy_(local_part(p).detach())
        return True

    def _check_signatures(self, table: list[list[int]]) -> None:
        ranks = [i for i, row in enumerate(table) if row[2] != self._signature]
        if ranks:
            raise _ConfigMismatch(
                f"fault tolerance: nodes of this run have another outer-loop configuration (replica ranks "
                f"{ranks} of this quorum differ from this node's: every, fragments, codec, outer optimizer, "
                "parameters and ranks per node must agree)"
            )

    # ------------------------------------------------------------------ the meetings
    def step(self) -> bool:
        """After an inner optimizer step: meet when the schedule says so (a meeting may heal
        this node to a peer's state, :attr:`inner_steps` included). Returns whether the shared
        parameters changed."""
        self.inner_steps += 1
        due = [f for f in range(self.fragments_n) if self.due(f, self.inner_steps)]
        for f in due:
            if self._meet(f):
                break  # healed: the peer's meeting was this node's last
        return bool(due)

    def _meet(self, fragment: int, quorum_done: bool = False) -> bool:
        """One meeting, tried until a quorum applies it; whether this node healed on the way."""
        healed = quorum_done
        contributes = not quorum_done
        for attempt in range(self.ft.max_retries + 1):
            if attempt > 0 or not quorum_done:
                self._meeting = (fragment, self.inner_steps)
                if self._meeting_quorum():
                    healed, contributes = True, False
            if healed:
                assert self._meeting is not None
                fragment = self._meeting[0]
            flat = self._pseudo_gradient(fragment)
            snapshot = self.codec.state_dict() if self.codec is not None and contributes else None
            exchange = self._exchange(fragment, flat, contributes)
            if self.manager.should_commit():
                self._outer_step(fragment, flat)
                if fragment == 0 and self._buffer_mean is not None:
                    self._set_buffers(self._buffer_mean)
                self.meetings[fragment] += 1
                self._last_commit = exchange if exchange is not None else 0
                self._tentative = None
                self._meeting = None
                return healed
            self.failed_exchanges += 1
            if snapshot is not None:
                assert self.codec is not None
                if exchange is not None:
                    self._tentative = (exchange, self.codec.state_dict())
                self.codec.load_state_dict(snapshot)
        error = self.manager.errored()
        raise RuntimeError(
            f"fault tolerance: the meeting of fragment {fragment} at inner step {self.inner_steps} failed "
            f"{self.ft.max_retries + 1} times (max_retries={self.ft.max_retries}); last error: {error}"
        )

    def _exchange(self, fragment: int, flat: torch.Tensor, contributes: bool) -> int | None:
        """Average ``flat`` in place over the nodes that contribute (this node's slice over
        torchft's group, then the slices gathered inside the node); fragment 0 averages the
        floating buffers too. Errors go to torchft (the vote then discards the exchange).
        Returns the exchange's identity, once every node's header has arrived."""
        topo, pg = self.topo, self._pg
        n = flat.numel()
        slicing = not self.sharded and topo.per_node > 1
        width = -(-n // topo.per_node) if slicing else n
        lo, hi = (0, n)
        if slicing:
            lo, hi = min(topo.local_rank * width, n), min((topo.local_rank + 1) * width, n)
        part = flat[lo:hi]
        identity: int | None = None
        try:
            coder = None if self.codec is None else Coder(self.codec, f"outer/{fragment}", 1.0).shifted(lo)
            payload = coder.encode(part, "allgather") if coder is not None and contributes else None
            nbytes = payload.data.numel() if payload is not None else 0
            nonce = int.from_bytes(os.urandom(_NONCE_BITS // 8), "little")
            head = torch.tensor([int(contributes), nbytes, self._signature, nonce], dtype=torch.int64)
            table = [row.tolist() for row in _gather(pg, head)]
            sent = (len(table) - 1) * head.numel() * 8  # what a ring all-gather sends per rank
            self._check_signatures(table)
            identity = sum(row[3] for row in table) % (1 << 62)
            count = sum(row[0] for row in table)
            if count == 0:
                raise RuntimeError("no node of the quorum had a pseudo-gradient to send")
            if coder is None:
                if not contributes:
                    part.zero_()
                _sum(pg, part)
                part.div_(count)
                sent += 2 * (len(table) - 1) * part.numel() * part.element_size() // len(table)
            else:
                most = max(row[1] for row in table)
                send = torch.zeros(most, dtype=torch.uint8)
                if payload is not None:
                    send[:nbytes] = payload.data
                datas = _gather(pg, send)
                sent += (len(table) - 1) * most
                pieces = [
                    Piece(0, coder.received(d[: row[1]], part))
                    for d, row in zip(datas, table, strict=True)
                    if row[0]
                ]
                apply_pieces(pieces, part, coder.plain, 1.0 / count)
            self.traffic.add("inter", sent)
        except _ConfigMismatch:
            raise
        except Exception as e:
            self.manager.report_error(e)
        if slicing:  # every rank of the node takes part, whatever happened across nodes
            send_part = torch.zeros(width, dtype=flat.dtype)
            send_part[: hi - lo] = part
            whole = torch.empty(width * topo.per_node, dtype=flat.dtype)
            with P.record_traffic() as inside:
                P.all_gather(whole, send_part, self.inner_group, "intra")
            self._count(inside)
            flat.copy_(whole[:n])
        self._buffer_mean = None
        if fragment == 0 and self.buffers:
            self._buffer_mean = self._average_buffers_across(contributes)
        return identity

    def _average_buffers_across(self, contributes: bool) -> torch.Tensor | None:
        """The floating buffers averaged inside the node, then over the contributing nodes."""
        flat = torch.cat([b.detach().float().reshape(-1) for b in self.buffers])
        if self.topo.world > 1:
            P.all_reduce(flat, self.inner_group, "intra")
            flat.div_(self.topo.world)
        msg = torch.cat([flat * float(contributes), torch.tensor([float(contributes)])])
        try:
            _sum(self._pg, msg)
        except Exception as e:
            self.manager.report_error(e)
            return None
        return msg[:-1] / msg[-1] if msg[-1] > 0 else None

    def _set_buffers(self, flat: torch.Tensor) -> None:
        pos = 0
        with torch.no_grad():
            for b in self.buffers:
                b.copy_(flat[pos : pos + b.numel()].view(b.shape).to(b.dtype))
                pos += b.numel()

    # ------------------------------------------------------------------ healing
    def _healing_state(self) -> dict[str, Any]:
        """What a healing node takes from this one (copies: the transfer may outlast a step)."""
        return {
            "format": FT_FORMAT,
            "signature": self._signature,
            "inner_steps": self.inner_steps,
            "meetings": list(self.meetings),
            "meeting": None if self._meeting is None else list(self._meeting),
            "last_commit": self._last_commit,
            "anchors": [a.detach().clone() for a in self.anchors],
            "outer": copy.deepcopy(self.outer.state_dict()),
            "codec": self.codec.state_dict() if self.codec is not None else None,
            "params": [local_part(p).detach().clone() for p in self.params],
            "buffers": {n: b.detach().clone() for n, b in self._module.named_buffers()},
            "optimizer": copy.deepcopy(self._optimizer.state_dict()) if self._optimizer is not None else None,
        }

    def _load_healed(self, state: dict[str, Any]) -> None:
        """Take a peer's state (torchft calls this inside the quorum that heals this node)."""
        if state.get("format") != FT_FORMAT or state.get("signature") != self._signature:
            raise _ConfigMismatch(
                "fault tolerance: the peer this node heals from runs another outer-loop configuration"
            )
        with torch.no_grad():
            for a, saved in zip(self.anchors, state["anchors"], strict=True):
                a.copy_(saved)
            for p, saved in zip(self.params, state["params"], strict=True):
                local_part(p).copy_(saved)
            for name, b in self._module.named_buffers():
                b.copy_(state["buffers"][name])
        self.outer.load_state_dict(state["outer"])
        if self._optimizer is not None and state["optimizer"] is not None:
            self._optimizer.load_state_dict(state["optimizer"])
        if self.codec is not None and state["codec"] is not None:
            own = self.codec.state_dict()  # what this node owes is its own (see the module text)
            if self._tentative is not None and self._tentative[0] == state["last_commit"]:
                own = self._tentative[1]  # the peers applied the exchange this node failed to finish
            peer = dict(state["codec"])
            if "streams" in peer:
                peer["streams"] = own.get("streams", {})
            self.codec.load_state_dict(peer)
        self._tentative = None
        self.inner_steps = int(state["inner_steps"])
        self.meetings = [int(m) for m in state["meetings"]]
        meeting = state["meeting"]
        self._meeting = None if meeting is None else (int(meeting[0]), int(meeting[1]))
        self._last_commit = int(state["last_commit"])
        self._healed = True
        self.recoveries += 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """:meth:`OuterLoop.state_dict` and torchft's count of applied exchanges."""
        return {**super().state_dict(), "ft": self.manager.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "ft"})
        if "ft" in state:
            self.manager.load_state_dict(state["ft"])

    def load_resized(self, states: Any) -> None:
        raise ValueError(
            "fault tolerance: a fault-tolerant run changes its number of nodes while it runs (a node "
            "that joins heals from a peer); load_resized is for restarting a fixed-size run"
        )

    def describe(self) -> str:
        return super().describe() + f", fault-tolerant (torchft, replica {self.ft.replica_id!r})"

    def close(self) -> None:
        super().close()
        self.manager.shutdown(wait=False)


__all__ = [
    "FaultTolerance",
    "FaultTolerantOuterLoop",
    "Lighthouse",
    "import_torchft",
    "start_lighthouse",
]
