"""The node hierarchy: which ranks share a node (fast links) and which talk across nodes.

A :class:`Topology` is ``nodes`` x ``per_node`` ranks, numbered contiguously per node (rank
``r`` is local rank ``r % per_node`` of node ``r // per_node``), which is how torchrun numbers
them. It owns the sub-process-groups the hierarchical algorithms use:

- ``intra``: the ranks of this rank's node (one group per node);
- ``inter``: the ranks with this rank's local index on every node (one group per local index).

Every rank creates every group in the same order (torch.distributed requires it), and the layout
is checked on every rank from a gathered tensor, so a bad layout fails everywhere with the same
message instead of hanging some ranks.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from gradsync.codecs.ops import Workspace


class TopologyError(ValueError):
    """The ranks do not form ``nodes`` equal, contiguous groups."""


class Topology:
    """Nodes x ranks-per-node over the default process group.

    ``Topology()`` reads the layout from torchrun's environment (``LOCAL_WORLD_SIZE`` and
    ``GROUP_RANK`` or ``NODE_RANK``); ``Topology(nodes=2, per_node=2)`` imposes one, for example
    to emulate two nodes on one machine. Without a process group (or with one rank) it is the
    trivial topology and creates no groups.
    """

    def __init__(
        self,
        nodes: int | None = None,
        per_node: int | None = None,
        timeout: datetime.timedelta | None = None,
    ) -> None:
        initialized = dist.is_available() and dist.is_initialized()
        self.world = dist.get_world_size() if initialized else 1
        self.rank = dist.get_rank() if initialized else 0
        if (nodes is None) != (per_node is None):
            raise TopologyError("give both nodes and per_node, or neither (to read torchrun's environment)")
        for name, v in (("nodes", nodes), ("per_node", per_node)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise TopologyError(f"{name} must be a positive integer, got {v!r}")
        if nodes is None:
            nodes, per_node, node_rank, local_rank = self._from_env()
        else:
            assert per_node is not None
            node_rank, local_rank = self.rank // per_node, self.rank % per_node
        self.nodes, self.per_node = nodes, per_node
        self._check_layout(node_rank, local_rank, initialized)
        self.node = self.rank // per_node
        self.local_rank = self.rank % per_node
        # scratch buffers of the algorithms run on this topology (large CPU allocations page-fault)
        self.workspace = Workspace()
        self.world_group: dist.ProcessGroup | None = dist.group.WORLD if initialized else None
        self.intra_group: dist.ProcessGroup | None = None
        self.inter_group: dist.ProcessGroup | None = None
        if initialized and self.world > 1:
            kw = {"timeout": timeout} if timeout is not None else {}
            # every rank creates every group, in the same order
            for i in range(nodes):
                g = dist.new_group(self.node_ranks(i), **kw)
                if i == self.node:
                    self.intra_group = g
            for j in range(per_node):
                g = dist.new_group(self.local_index_ranks(j), **kw)
                if j == self.local_rank:
                    self.inter_group = g

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
            t = torch.tensor(mine, dtype=torch.int64)
            if dist.get_backend() == "nccl":
                t = t.cuda()
            out = [torch.empty_like(t) for _ in range(self.world)]
            dist.all_gather(out, t)
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

    def node_ranks(self, node: int) -> list[int]:
        """Global ranks of a node."""
        return list(range(node * self.per_node, (node + 1) * self.per_node))

    def local_index_ranks(self, local_rank: int) -> list[int]:
        """Global ranks with a given local index, one per node."""
        return list(range(local_rank, self.world, self.per_node))

    @property
    def leader(self) -> int:
        """Global rank of this node's first rank."""
        return self.node * self.per_node

    def __repr__(self) -> str:
        return f"Topology(nodes={self.nodes}, per_node={self.per_node}, rank={self.rank})"
