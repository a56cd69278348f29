"""A model sharded as a sharded contender trains it (``fsdp``, ``hsdp``, ``replicate``, each
optionally ``/SCHEME``): the units FSDP2's tutorial shards (each element of a numbered container,
:func:`gradsync.whatif.sharded.shard_units`, the same cut the simulator makes), then the root.
Shared by ``bench fsdp``, ``bench train`` and ``bench whatif``."""

from __future__ import annotations

from typing import Any

from torch import nn

from gradsync.collectives import Topology
from gradsync.collectives.topology import default_device
from gradsync.whatif.sharded import shard_units, sharded_contender


def units_of(model: nn.Module) -> list[nn.Module]:
    """The model's units (not the root), in registration order."""
    names = [n for n, _ in model.named_parameters()]
    return [model.get_submodule(u) for u in shard_units(names) if u]


def shard_model(model: nn.Module, name: str, topo: Topology) -> tuple[nn.Module, Any]:
    """``model`` (on this rank's device) as the sharded contender ``name`` trains it, and
    gradsync's compression object (None for PyTorch's own)."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gradsync.fsdp import compress_fsdp, replicate

    kind, scheme = sharded_contender(name)
    device = default_device().type
    units = units_of(model)
    if kind == "replicate":
        if scheme is not None:
            return model, replicate(model, scheme, blocks=units)
        for unit in units:
            torch_replicate(unit)
        torch_replicate(model)
        return model, None
    if kind == "fsdp":
        mesh = init_device_mesh(device, (topo.world,))
        group = None
    else:
        mesh2 = init_device_mesh(device, (topo.nodes, topo.per_node), mesh_dim_names=("replicate", "shard"))
        mesh = mesh2 if scheme is None else mesh2["shard"]
        group = mesh2["replicate"].get_group()
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if scheme is None:
        return model, None
    return model, compress_fsdp(model, scheme, replicate_group=group)
