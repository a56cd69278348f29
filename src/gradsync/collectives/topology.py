"""The node hierarchy: which ranks share a node (fast links) and which talk across nodes.

A :class:`Topology` is ``nodes`` x ``per_node`` ranks, numbered contiguously per node (rank
``r`` is local rank ``r % per_node`` of node ``r // per_node``), which is how torchrun numbers
them. It owns every process group gradsync communicates on:

- ``world_group``: all ranks. gradsync's own group, not the default one: DDP (its bucket
  all-reduces, the unused-parameter bitmap of ``find_unused_parameters``, buffer broadcasts)
  and the user's code issue their collectives on the default group, and a collective on one
  group can never pair with one on another. gradsync's communication thread uses it;
- ``control_group``: all ranks, for the few collectives gradsync issues from the training
  thread (start-up agreement, the plan broadcast, calibration, ``Join``), so they never
  interleave with what the communication thread has in flight;
- ``intra``: the ranks of this rank's node (one group per node);
- ``inter``: the ranks with this rank's local index on every node (one group per local index).

Every rank creates every group in the same order (torch.distributed requires it), with the
default group's timeout (``new_group`` would otherwise give them 30 minutes), and the layout is
checked on every rank from a gathered tensor, so a bad layout fails everywhere with the same
message instead of hanging some ranks.

A topology made before ``init_process_group`` is the trivial one-rank layout; code that is
handed one later calls :meth:`Topology.bind`, which builds it for the process group that now
exists, so nothing made before the process group freezes a world size.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable

import torch
import torch.distributed as dist

from gradsync.codecs.ops import Workspace


class TopologyError(ValueError):
    """The ranks do not form ``nodes`` equal, contiguous groups."""


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def default_timeout() -> datetime.timedelta | None:
    """The default process group's timeout (None when it cannot be read)."""
    try:
        world = dist.group.WORLD
        assert world is not None
        backend = world._get_backend(backend_device(dist.get_backend()))
        timeout = backend.options._timeout
    except Exception:  # private API: fall back to torch's own default
        return None
    return timeout if isinstance(timeout, datetime.timedelta) else None


def default_device() -> torch.device:
    """The current CUDA device of the calling thread, or the CPU without CUDA."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _parse_device(device: object) -> torch.device | None:
    if device is None:
        return None
    try:
        if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
            parsed = torch.device("cuda", device)
        elif isinstance(device, (str, torch.device)):
            parsed = torch.device(device)
        else:
            raise TypeError
    except (RuntimeError, TypeError):
        parsed = None
    if (
        parsed is None
        or parsed.type not in ("cpu", "cuda")
        or (parsed.type == "cuda" and parsed.index is None)
    ):
        raise TopologyError(
            f"device must be 'cpu', a CUDA device with its index ('cuda:1', torch.device('cuda', 1)) or "
            f"a GPU index, got {device!r}"
        )
    return parsed


def use_device(device: torch.device | None) -> None:
    """Make ``device`` the calling thread's current CUDA device (nothing for the CPU)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def backend_device(backend: str) -> torch.device:
    """The device a backend's tensors must be on: the current GPU for NCCL, else the CPU."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class Topology:
    """Nodes x ranks-per-node over the default process group.

    ``Topology()`` reads the layout from torchrun's environment (``LOCAL_WORLD_SIZE`` and
    ``GROUP_RANK`` or ``NODE_RANK``); ``Topology(nodes=2, per_node=2)`` imposes one, for example
    to emulate two nodes on one machine. Without a process group (or with one rank) it is the
    trivial topology and creates no groups. ``timeout`` bounds gradsync's collectives (default:
    the default process group's timeout).

    ``device`` is the accelerator this rank computes on (a ``torch.device``, ``"cuda:1"`` or a
    GPU index): gradsync's own threads make it their current device, so that what they allocate
    and stage lands there and not on ``cuda:0`` (a new thread's current device). By default it
    is the current CUDA device of the thread that builds the topology (torchrun scripts call
    ``torch.cuda.set_device(LOCAL_RANK)`` first), or the CPU without CUDA.

    ``process_group`` limits the topology to that group's ranks (DDP's ``process_group``): its
    ``world`` is the group's size and its ``rank`` this rank's place in it, by default one node
    of all of them (an outer loop's node: :attr:`gradsync.OuterLoop.inner_group`). Only the
    group's ranks build it (its groups are made with local synchronization), and they must all
    build it. :meth:`global_rank` turns a rank of the topology into the process's global rank.
    """

    def __init__(
        self,
        nodes: int | None = None,
        per_node: int | None = None,
        timeout: datetime.timedelta | None = None,
        device: torch.device | str | int | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if (nodes is None) != (per_node is None):
            raise TopologyError("give both nodes and per_node, or neither (to read torchrun's environment)")
        for name, v in (("nodes", nodes), ("per_node", per_node)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise TopologyError(f"{name} must be a positive integer, got {v!r}")
        if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
            raise TopologyError(
                f"process_group must be a torch.distributed ProcessGroup, got {type(process_group).__name__}"
            )
        self._device = _parse_device(device)
        self._asked = (nodes, per_node, timeout)
        self._group = process_group
        # scratch buffers of the algorithms run on this topology (large CPU allocations page-fault)
        self.workspace = Workspace()
        self._build()

    def _build(self) -> None:
        nodes, per_node, timeout = self._asked
        initialized = _initialized()
        self._pg = dist.group.WORLD if initialized else None  # the process group this was built for
        group = self._group
        if group is not None and not initialized:
            raise TopologyError("a Topology over a process_group needs torch.distributed initialized")
        self.members = dist.get_process_group_ranks(group) if group is not None else None
        """The global ranks of the topology in its order (None: every rank, rank r being r)."""
        if self.members is not None and dist.get_rank() not in self.members:
            raise TopologyError(
                f"rank {dist.get_rank()} builds a Topology over a process group it is not in "
                f"(ranks {self.members})"
            )
        self.world = (
            len(self.members) if self.members is not None else dist.get_world_size() if initialized else 1
        )
        self.rank = (
            self.members.index(dist.get_rank())
            if self.members is not None
            else dist.get_rank()
            if initialized
            else 0
        )
        self.backend = dist.get_backend(group) if initialized else "gloo"
        self.device = self._device if self._device is not None else default_device()
        """The device this rank computes on; gradsync's threads make it their current device."""
        comm = backend_device(self.backend) if initialized else torch.device("cpu")
        if comm.type == "cuda" and self.device.type == "cuda":
            comm = self.device  # Topology(device=...) wins over the building thread's current GPU
        self.comm_device = comm
        """Where the tensors of gradsync's collectives live: this rank's GPU under NCCL, else the CPU."""
        if nodes is None and self.members is not None:  # a group of its own: one node of it
            nodes, per_node, node_rank, local_rank = 1, self.world, 0, self.rank
        elif nodes is None:
            nodes, per_node, node_rank, local_rank = self._from_env()
        else:
            assert per_node is not None
            node_rank, local_rank = self.rank // per_node, self.rank % per_node
        self.nodes, self.per_node = nodes, per_node
        self.world_group: dist.ProcessGroup | None = None
        self.control_group: dist.ProcessGroup | None = None
        self.intra_group: dist.ProcessGroup | None = None
        self.inter_group: dist.ProcessGroup | None = None
        limit: datetime.timedelta | None = None  # None: torch.distributed's default
        if initialized and self.world > 1:
            limit = timeout if timeout is not None else default_timeout()
            # every rank creates every group, in the same order (over a process group, only its
            # ranks take part: local synchronization)
            self.world_group = self._new_group(self.global_ranks(), limit)
            self.control_group = self._new_group(self.global_ranks(), limit)
        self._check_layout(node_rank, local_rank, initialized)
        self.node = self.rank // per_node
        self.local_rank = self.rank % per_node
        if initialized and self.world > 1:
            for i in range(nodes):
                g = self._new_group(self.node_ranks(i), limit, mine=i == self.node)
                if i == self.node:
                    self.intra_group = g
            for j in range(per_node):
                g = self._new_group(self.local_index_ranks(j), limit, mine=j == self.local_rank)
                if j == self.local_rank:
                    self.inter_group = g

    def _new_group(
        self, ranks: list[int], timeout: datetime.timedelta | None, mine: bool = True
    ) -> dist.ProcessGroup | None:
        """A group of global ``ranks``. Over the whole world every rank makes every group; over a
        process group of some ranks only the members of each group make it (the other ranks
        may be building topologies of their own at the same time)."""
        if self.members is None:
            return dist.new_group(ranks, timeout=timeout)
        if not mine:
            return None
        return dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)

    def bind(self) -> Topology:
        """Make sure this topology describes the process group that exists now.

        A topology made before ``init_process_group`` is rebuilt for the current group (every
        rank must call this at the same point, as it creates groups); one made for a process
        group that has since been destroyed raises :class:`TopologyError`. Returns ``self``."""
        current = dist.group.WORLD if _initialized() else None
        if current is self._pg:
            return self
        if self._pg is not None:
            raise TopologyError(
                "this Topology was made for a process group that has been destroyed since; "
                "make a new Topology (and wrap or hook) after init_process_group"
            )
        self._build()
        return self

    def check_devices(self, devices: Iterable[torch.device], what: str = "the model's parameters") -> None:
        """Refuse CUDA tensors none of which is on this rank's device (``ValueError``): the rank
        would stage and communicate on another GPU than its data (typically ``cuda:0`` on every
        rank of a node, because ``torch.cuda.set_device`` was not called)."""
        cuda = sorted({d for d in devices if d.type == "cuda"}, key=str)
        if not cuda or self.device in cuda:
            return
        where = ", ".join(str(d) for d in cuda)
        raise ValueError(
            f"gradsync: {what} are on {where} but this rank's device is {self.device} (the current CUDA "
            "device when its Topology was built): call torch.cuda.set_device(LOCAL_RANK) before "
            "init_process_group, or pass Topology(device=...)"
        )

    @property
    def is_bound(self) -> bool:
        """Whether this topology was made for the process group that exists now."""
        return (dist.group.WORLD if _initialized() else None) is self._pg

    # ------------------------------------------------------------------ layout
    def _from_env(self) -> tuple[int, int, int, int]:
        env = os.environ
        if self.world == 1:
            return 1, 1, 0, 0
        per_node = int(env.get("LOCAL_WORLD_SIZE", self.world))
        node_rank = int(env.get("GROUP_RANK", env.get("NODE_RANK", self.rank // max(per_node, 1))))
        local_rank = int(env.get("LOCAL_RANK", self.rank % max(per_node, 1)))
        nodes = self.world // per_node if per_node and self.world % per_node == 0 else 0
        return nodes, per_node, node_rank, local_rank

    def _check_layout(self, node_rank: int, local_rank: int, initialized: bool) -> None:
        # gather (node_rank, local_rank, nodes, per_node) from everybody, so that every rank
        # reaches the same verdict and raises together
        mine = [node_rank, local_rank, self.nodes, self.per_node]
        if initialized and self.world > 1:
            t = torch.tensor(mine, dtype=torch.int64, device=self.comm_device)
            out = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(out, t, group=self.control_group)
            table = [o.cpu().tolist() for o in out]
        else:
            table = [mine]
        problems = []
        for r, (nr, lr, m, n) in enumerate(table):
            if (m, n) != (table[0][2], table[0][3]):
                problems.append(
                    f"rank {r} sees {m} nodes x {n} per node, rank 0 sees {table[0][2]} x {table[0][3]}"
                )
            elif m * n != len(table):
                problems.append(
                    f"{m} nodes x {n} per node is {m * n} ranks, "
                    f"but the world has {len(table)} (unequal nodes?)"
                )
            elif (nr, lr) != (r // n, r % n):
                problems.append(
                    f"rank {r} is local rank {lr} of node {nr}; ranks must be contiguous per node"
                )
        if problems:
            raise TopologyError(
                "bad topology: " + "; ".join(problems[:4]) + ("; ..." if len(problems) > 4 else "")
            )

    def global_rank(self, rank: int) -> int:
        """The global rank (the default process group's) of the topology's rank ``rank``."""
        return self.members[rank] if self.members is not None else rank

    def global_ranks(self) -> list[int]:
        """The global ranks of the topology, in its order."""
        return list(self.members) if self.members is not None else list(range(self.world))

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of a node."""
        return [self.global_rank(r) for r in range(node * self.per_node, (node + 1) * self.per_node)]

    def local_index_ranks(self, local_rank: int) -> list[int]:
        """Global ranks with a given local index, one per node."""
        return [self.global_rank(r) for r in range(local_rank, self.world, self.per_node)]

    def level_of(self, group: dist.ProcessGroup | None) -> str:
        """The traffic level of a collective on ``group`` (``intra``, ``inter`` or ``world``): a
        world group counts as intra-node on one node and as inter-node with one rank per node."""
        if group is self.intra_group or self.nodes == 1:
            return "intra"
        if group is self.inter_group or self.per_node == 1:
            return "inter"
        return "world"

    @property
    def leader(self) -> int:
        """Global rank of this node's first rank."""
        return self.global_rank(self.node * self.per_node)

    def __repr__(self) -> str:
        return f"Topology(nodes={self.nodes}, per_node={self.per_node}, rank={self.rank})"


_default: tuple[object, Topology] | None = None  # a cache, not state: one topology per process group


def default_topology() -> Topology:
    """The torchrun-layout topology of the current process group, made once per group (for the
    functional collectives called without a topology: making groups on every call would leak)."""
    global _default
    current = dist.group.WORLD if _initialized() else None
    if _default is None or _default[0] is not current:
        _default = (current, Topology())
    return _default[1]
