"""PyTorch's ``replicate()`` data parallelism on FSDP2 with gradsync's compressed all-reduce
(:func:`replicate`): fully_shard on shard groups of one rank, the world's all-reduce in the hook
(:func:`gradsync.integrate.fsdp.compress_fsdp` with ``where="replicate"``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from gradsync.integrate.fsdp import FsdpCompression, agree, compress_fsdp, describe_options


def replicate(
    module: nn.Module,
    scheme: str = "topk:density=0.01",
    *,
    blocks: Sequence[nn.Module] = (),
    mp_policy: MixedPrecisionPolicy | None = None,
    **options: Any,
) -> FsdpCompression:
    """Data parallelism on FSDP2 with a compressed all-reduce: what PyTorch's ``replicate()``
    does (every rank keeps whole parameters), built as ``fully_shard`` on shard groups of one
    rank so that the all-reduce across the world runs in the hook, through gradsync.

    ``blocks`` are submodules to give their own FSDP module (and so their own all-reduce, which
    overlaps nothing on CPU but bounds the flat buffers), as one calls ``replicate`` or
    ``fully_shard`` on a Transformer's blocks. ``options`` go to :func:`compress_fsdp`. Needs the
    default process group; every rank must hold the same parameters."""
    from torch.distributed.device_mesh import init_device_mesh

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("gradsync.fsdp.replicate needs an initialized process group")

    def check() -> None:
        if "replicate_group" in options or "where" in options:
            raise ValueError(
                "gradsync.fsdp.replicate: replicate_group and where are its own (the world, 'replicate')"
            )
        describe_options(scheme, options)  # raises for a bad scheme or option

    # every rank checks its arguments and that all ranks got the same ones before building the
    # mesh (a collective), so that a bad or differing argument fails on every rank alike
    agree(check, lambda: describe_options(scheme, options), module)
    params = list(module.parameters())
    device_type = params[0].device.type if params else "cpu"
    mesh = init_device_mesh(device_type, (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    kw: dict[str, Any] = {"mesh": mesh["shard"]}
    if mp_policy is not None:
        kw["mp_policy"] = mp_policy
    for block in blocks:
        fully_shard(block, **kw)
    fully_shard(module, **kw)
    return compress_fsdp(
        module, scheme, replicate_group=mesh["replicate"].get_group(), where="replicate", **options
    )


__all__ = ["replicate"]
