"""PyTorch Lightning: ``Trainer(strategy=gradsync.lightning.Strategy("hitopk:density=0.01"))``.

:class:`Strategy` is Lightning's ``DDPStrategy`` with gradsync's communication hook registered
once the process group and the DDP model exist, on every device: Lightning's own strategy
registers a comm hook only on CUDA, so on CPU (gloo) a hook handed to ``DDPStrategy`` is ignored
without a word. Everything else (launching, samplers, ``find_unused_parameters``,
``static_graph`` and other DDP options passed as keywords, gradient accumulation through
``no_sync``) is Lightning's.

Checkpoints: gradsync's compression state (error-feedback residuals, PowerSGD factors) differs
between ranks, while Lightning writes one checkpoint file from rank 0. So every rank writes its
own part next to it, ``<checkpoint>.gradsync-rank<R>.pt``, and reads it back on resume; if it is
missing, or was saved by another scheme or world size, the compression state starts afresh with
a warning (a dense first step), never silently misapplied.

Needs Lightning: ``pip install 'gradsync[lightning]'``.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # checked against the `lightning` package; at run time either package serves
    from lightning.pytorch.strategies import DDPStrategy
else:
    try:
        from lightning.pytorch.strategies import DDPStrategy
    except ImportError:  # pragma: no cover - depends on what is installed
        try:
            from pytorch_lightning.strategies import DDPStrategy
        except ImportError as e:
            raise ImportError(
                "gradsync.lightning needs PyTorch Lightning: pip install 'gradsync[lightning]'"
            ) from e
from torch.nn.parallel import DistributedDataParallel

from gradsync.collectives.topology import Topology
from gradsync.integrate.ddp_hook import HookState, register_comm_hook
from gradsync.integrate.wrap import build_config
from gradsync.sync.config import SyncConfig

STATE_FORMAT = "gradsync.lightning/1"


class Strategy(DDPStrategy):
    """Lightning's DDP strategy, synchronizing gradients with a gradsync scheme.

    ``scheme`` as for :func:`gradsync.wrap` (a spec string or a :class:`SyncConfig`);
    ``sync_options`` are further :class:`SyncConfig` fields (``min_compress_bytes``...);
    ``topology`` an explicit :class:`~gradsync.Topology` (default: torchrun's layout); every
    other keyword goes to Lightning's ``DDPStrategy`` (and from there to DDP). Options are
    checked here, before any process starts."""

    strategy_name = "gradsync"

    def __init__(
        self,
        scheme: str | SyncConfig = "auto",
        *,
        sync_options: dict[str, Any] | None = None,
        topology: Topology | None = None,
        **kwargs: Any,
    ) -> None:
        taken = sorted({"ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"} & set(kwargs))
        if taken:
            raise ValueError(
                f"gradsync.lightning.Strategy registers its own DDP comm hook; do not pass {taken}"
            )
        self.sync_config = build_config(scheme, None, dict(sync_options or {}))
        self._topology = topology
        self.hook_state: HookState | None = None
        self._pending: dict[str, Any] | None = None  # compression state read before the hook exists
        super().__init__(**kwargs)

    def _register_ddp_hooks(self) -> None:
        assert isinstance(self.model, DistributedDataParallel)
        # under a GradScaler (precision="16-mixed") the hook reads the scale the gradients carry
        # (error feedback keeps its residuals unscaled) and skips overflowing steps on every rank
        scaler = getattr(self.precision_plugin, "scaler", None)
        self.hook_state = register_comm_hook(self.model, self.sync_config, self._topology, grad_scaler=scaler)
        if self._pending is not None:
            self._restore(self._pending)
            self._pending = None

    # ------------------------------------------------------------------ checkpoints
    def _signature(self) -> dict[str, Any]:
        world = dist.get_world_size() if dist.is_initialized() else 1
        return {"scheme": self.sync_config.spec(), "world": world}

    def _part(self, filepath: str | os.PathLike[str]) -> str:
        return f"{os.fspath(filepath)}.gradsync-rank{self.global_rank}.pt"

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        if self.hook_state is None:
            return
        import fsspec

        part = self._part(filepath)
        tmp = f"{part}.tmp-{os.getpid()}"
        state = {"format": STATE_FORMAT, "signature": self._signature(), "hook": self.hook_state.state_dict()}
        with fsspec.open(tmp, "wb") as fh:
            torch.save(state, fh)
        fs = fsspec.core.url_to_fs(part)[0]
        fs.mv(tmp, part)  # a reader never sees half a file under the real name

    def remove_checkpoint(self, filepath: str | Path) -> None:
        """Lightning removes the checkpoint on rank 0 (``ModelCheckpoint``'s pruning calls this on
        every rank); each rank removes its own compression-state part with it."""
        super().remove_checkpoint(filepath)
        import fsspec

        part = self._part(filepath)
        fs = fsspec.core.url_to_fs(part)[0]
        if fs.exists(part):
            fs.rm(part)

    def load_checkpoint(self, checkpoint_path: str | Path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(
            checkpoint_path, *args, **kwargs
        )  # weights_only in newer versions
        import fsspec

        part = self._part(checkpoint_path)
        fs = fsspec.core.url_to_fs(part)[0]
        if not fs.exists(part):
            warnings.warn(
                f"gradsync: {part} is missing, so this rank's compression state (error-feedback residuals, "
                "factors) starts afresh, with a dense first step",
                RuntimeWarning,
                stacklevel=2,
            )
            return checkpoint
        with fsspec.open(part, "rb") as fh:
            state = torch.load(fh, map_location="cpu", weights_only=True)
        if self.hook_state is None:
            self._pending = state
        else:
            self._restore(state)
        return checkpoint

    def _restore(self, state: dict[str, Any]) -> None:
        assert self.hook_state is not None
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("gradsync: the compression-state file is not one gradsync.lightning wrote")
        mine, theirs = self._signature(), state.get("signature")
        if theirs != mine:
            warnings.warn(
                f"gradsync: the compression state was saved with {theirs}, this run has {mine}; it starts "
                "afresh, with a dense first step",
                RuntimeWarning,
                stacklevel=2,
            )
            return
        self.hook_state.load_state_dict(state["hook"])

    def teardown(self) -> None:
        if self.hook_state is not None:
            self.hook_state.close()  # its threads; the state stays, for a checkpoint after fit()
        super().teardown()
