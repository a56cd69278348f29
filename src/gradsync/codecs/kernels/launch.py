"""Whether the fused kernels can run for a device, and what every kernel wrapper shares.

Triton is optional. Its kernels run on CUDA tensors when triton imports and a probe kernel
launches; on the CPU only under triton's interpreter (``TRITON_INTERPRET=1``, which the tests
set), slow but bit-faithful, so that the same kernels are checked on a machine without a GPU.
Everywhere else each public function of this package runs its plain-torch version, with the
same signature and the same outputs.

Triton chooses between compiling and interpreting when a function is decorated: its own
library (``tl.max``, ``tl.sum`` ...) when ``triton.language`` is first imported, by anyone (a
``torch.compile`` call imports it too), and this package's kernels when their module is first
imported. A kernel runs only when both were made in the mode ``TRITON_INTERPRET`` asks for now;
:func:`available` answers no otherwise (the torch versions run), instead of letting a compiled
library function be called from an interpreted kernel.

A kernel compiles and loads on its first launch (a few hundred milliseconds, on the host), which
a stream that is capturing a CUDA graph does not allow: run each variant once before capture.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType

import torch

KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""Input dtypes the kernels take (others run the torch version)."""

_TRUE = ("1", "true", "on", "yes")

ENV = "GRADSYNC_KERNELS"
"""Set to ``0`` to run the torch versions everywhere (the fused kernels never run)."""


def interpreting() -> bool:
    """Whether ``TRITON_INTERPRET`` asks triton to interpret kernels (on the CPU)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in _TRUE


@functools.cache
def _triton_imports() -> bool:
    try:
        importlib.import_module("triton")
        importlib.import_module("triton.language")
    except Exception:  # missing, or broken against this torch / driver
        return False
    return True


@functools.cache
def _mode_at_load() -> bool:
    """The interpreter setting when the first kernel module was imported (cached then)."""
    return interpreting()


_language_mode: list[bool] = []  # triton's library mode, once triton.language is imported (fixed then)


def _language_interprets() -> bool | None:
    """Whether triton's own library functions were made for the interpreter (None: not imported)."""
    if _language_mode:
        return _language_mode[0]
    language = sys.modules.get("triton.language")
    if language is None:
        return None
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:  # an interpreter this version does not have: treat the library as compiled
        _language_mode.append(False)
    else:
        _language_mode.append(isinstance(getattr(language, "max", None), InterpretedFunction))
    return _language_mode[0]


def _loaded_modes() -> set[bool]:
    """The modes triton's library and this package's kernels were made in, where made yet."""
    modes = {_mode_at_load()} if _mode_at_load.cache_info().currsize else set()
    language = _language_interprets()
    return modes if language is None else modes | {language}


def module(name: str) -> ModuleType:
    """The triton kernel module ``jit.<name>`` of this package (imported on first use)."""
    _mode_at_load()
    return importlib.import_module(f"gradsync.codecs.kernels.jit.{name}")


@functools.cache
def _probe(index: int) -> bool:
    """Launch a one-thread kernel on CUDA device ``index``: compiles and launches, or not.
    Nothing is read back (a compile or launch failure raises on the host)."""
    try:
        out = torch.zeros(1, dtype=torch.int32, device=torch.device("cuda", index))
        module("common").probe_kernel[(1,)](out, enable_fp_fusion=False)
    except Exception:
        return False
    return True


def available(device: torch.device | str) -> bool:
    """Whether the triton kernels run for tensors on ``device``: on CUDA when triton imports and
    a probe kernel launches there (and the interpreter is off); on the CPU only under the
    interpreter; nowhere with ``GRADSYNC_KERNELS=0``. The CUDA probe runs once per device and
    process."""
    dev = torch.device(device)
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no") or not _triton_imports():
        return False
    loaded = _loaded_modes()
    if dev.type == "cuda":
        if interpreting() or True in loaded or not torch.cuda.is_available():
            return False
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return _probe(index)
    if dev.type == "cpu":
        return interpreting() and False not in loaded
    return False


def use_kernels(x: torch.Tensor) -> bool:
    """Whether a wrapper runs its triton kernel for input ``x``: a supported dtype on a device
    where triton runs (the wrappers check that their other tensors are on x's device)."""
    return x.dtype in KERNEL_DTYPES and available(x.device)


def check_flat(name: str, x: torch.Tensor) -> None:
    """A kernel input or output must be one contiguous run of elements."""
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def check_out(
    name: str, out: torch.Tensor, numel: int, dtypes: Iterable[torch.dtype], device: torch.device
) -> None:
    """An output buffer: at least ``numel`` elements, one of ``dtypes``, on ``device``, contiguous."""
    allowed = tuple(dtypes)
    if out.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ValueError(f"{name} must be {names}, got {out.dtype}")
    if out.numel() < numel:
        raise ValueError(f"{name} holds {out.numel()} elements, needs {numel}")
    if out.device != device:
        raise ValueError(f"{name} is on {out.device}, the input on {device}")
    check_flat(name, out)


def check_addend(a: torch.Tensor, b: torch.Tensor | None) -> None:
    """The second addend of error feedback's ``v = a + b``: same size, dtype and device as ``a``."""
    check_flat("a", a)
    if b is None:
        return
    check_flat("b", b)
    if b.numel() != a.numel() or b.dtype != a.dtype or b.device != a.device:
        raise ValueError(
            f"b must match a (numel {a.numel()}, {a.dtype}, {a.device}); got numel {b.numel()}, "
            f"{b.dtype}, {b.device}"
        )


def check_words(words: torch.Tensor, device: torch.device) -> None:
    """Check a key-word tensor: int64 with at least two entries on ``device``."""
    if words.dtype != torch.int64 or words.numel() < 2 or words.device != device:
        raise ValueError(
            f"words must be an int64 tensor of 2 entries on {device}, got {words.dtype} "
            f"numel {words.numel()} on {words.device}"
        )


_ALIGN = 16


@dataclass(frozen=True)
class ScratchLayout:
    """Typed buffers carved from one ``uint8`` scratch tensor, each aligned to 16 bytes.

    A caller that wants no allocation per call keeps a tensor of :attr:`nbytes` (made once by
    :meth:`allocate`) and passes it in; the layout depends on sizes only, never on data."""

    parts: tuple[tuple[str, int, torch.dtype], ...]

    def _offsets(self) -> list[tuple[str, int, int, torch.dtype]]:
        out, at = [], 0
        for name, count, dtype in self.parts:
            size = max(count, 0) * dtype.itemsize
            out.append((name, at, count, dtype))
            at += (size + _ALIGN - 1) // _ALIGN * _ALIGN
        return out

    @property
    def nbytes(self) -> int:
        last = self._offsets()
        if not last:
            return 0
        _, at, count, dtype = last[-1]
        return at + max(count, 0) * dtype.itemsize

    def allocate(self, device: torch.device | str) -> torch.Tensor:
        return torch.empty(max(self.nbytes, 1), dtype=torch.uint8, device=device)

    def carve(self, scratch: torch.Tensor | None, device: torch.device) -> dict[str, torch.Tensor]:
        """The typed views; a fresh buffer when ``scratch`` is None."""
        if scratch is None:
            scratch = self.allocate(device)
        if scratch.dtype != torch.uint8 or not scratch.is_contiguous() or scratch.numel() < self.nbytes:
            raise ValueError(f"scratch must be a contiguous uint8 tensor of at least {self.nbytes} bytes")
        if scratch.device != device:
            raise ValueError(f"scratch is on {scratch.device}, the input on {device}")
        return {
            name: scratch[at : at + count * dtype.itemsize].view(dtype)
            for name, at, count, dtype in self._offsets()
        }


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()
