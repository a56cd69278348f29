"""The payload: one packed ``uint8`` tensor that a single collective can move.

Layout of ``Payload.data``::

    offset 0   int64    count   codec-defined (selected elements, non-zero codes, numel ...)
    offset 8   int32    flags   bit 0: input was non-finite; bit 1: a value overflowed the format;
                                bit 2: sent dense (a codec's fallback for shapes it cannot compress)
    offset 12  int32    aux     codec-defined small integer (an exponent, a sign, a rank ...)
    offset 16  float32  s0      codec-defined scalars (scales, a mean, a threshold)
    offset 20  float32  s1
    offset 24  sections, each starting at a multiple of 8 bytes

The in-band header carries everything that can change from call to call, so a peer can decode a
buffer it received knowing only the static facts (codec, shape, dtype) that every rank already
agrees on. :class:`Payload` pairs the bytes with those static facts.

A codec in *resident* mode (on a GPU: nothing waits for the host) writes the header from 0-dim
device tensors (:func:`write_device_header`) and its receivers never read it on the host: the
payload's size follows from the static facts alone, and the flags are used as a device tensor
(:meth:`Payload.flag_word`).
"""

from __future__ import annotations

import ctypes
import enum
import struct
from dataclasses import dataclass

import torch

HEADER_BYTES = 24
_HEADER = struct.Struct("<qiiff")
_FIELDS = {
    "count": (0, 8, torch.int64),
    "flags": (8, 12, torch.int32),
    "aux": (12, 16, torch.int32),
    "s0": (16, 20, torch.float32),
    "s1": (20, 24, torch.float32),
}
_ALIGN = 8


class Flag(enum.IntFlag):
    """Bits of the header's ``flags`` word."""

    NONE = 0
    NONFINITE = 1
    OVERFLOW = 2
    DENSE = 4


@dataclass(frozen=True)
class Header:
    """The in-band header of a payload."""

    count: int = 0
    flags: Flag = Flag.NONE
    aux: int = 0
    s0: float = 0.0
    s1: float = 0.0

    def pack(self) -> bytes:
        return _HEADER.pack(self.count, int(self.flags), self.aux, self.s0, self.s1)

    @classmethod
    def unpack(cls, raw: bytes) -> Header:
        count, flags, aux, s0, s1 = _HEADER.unpack(raw)
        return cls(count, Flag(flags), aux, s0, s1)


def align(nbytes: int) -> int:
    """Round up to the section alignment."""
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


class Layout:
    """Offsets of a payload's sections, computed from their element counts and dtypes.

    >>> lay = Layout([("idx", 10, torch.int32), ("val", 10, torch.float32)])
    >>> lay.nbytes
    104
    """

    def __init__(self, sections: list[tuple[str, int, torch.dtype]]) -> None:
        self.sections: dict[str, tuple[int, int, torch.dtype]] = {}
        self.padding: list[tuple[int, int]] = []  # (start, end) byte ranges between sections
        offset = HEADER_BYTES
        for name, numel, dtype in sections:
            itemsize = dtype.itemsize
            self.sections[name] = (offset, numel, dtype)
            end = offset + numel * itemsize
            offset = align(end)
            if offset > end:
                self.padding.append((end, offset))
        self.nbytes = offset

    def zero_padding(self, data: torch.Tensor) -> None:
        """Zero the alignment gaps so that a payload's bytes are fully determined by its content."""
        for start, end in self.padding:
            data[start:end].zero_()

    def view(self, data: torch.Tensor, name: str) -> torch.Tensor:
        """A typed view of one section of ``data``."""
        offset, numel, dtype = self.sections[name]
        return data[offset : offset + numel * dtype.itemsize].view(dtype)


class Payload:
    """Encoded bytes plus the static facts needed to decode them."""

    __slots__ = ("_header", "codec", "data", "dtype", "shape")

    def __init__(self, data: torch.Tensor, codec: str, shape: torch.Size, dtype: torch.dtype) -> None:
        if data.dtype != torch.uint8 or data.dim() != 1:
            raise TypeError(
                f"payload data must be a 1-D uint8 tensor, got {data.dtype} with {data.dim()} dims"
            )
        if data.numel() < HEADER_BYTES:
            raise ValueError(
                f"payload of {data.numel()} bytes is shorter than its {HEADER_BYTES}-byte header"
            )
        self.data = data
        self.codec = codec
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._header: Header | None = None

    @property
    def header(self) -> Header:
        if self._header is None:
            if self.data.device.type == "cpu":
                raw = ctypes.string_at(self.data.data_ptr(), HEADER_BYTES)
            else:
                raw = bytes(self.data[:HEADER_BYTES].cpu().tolist())  # (no numpy: torch alone)
            self._header = Header.unpack(raw)
        return self._header

    def field(self, name: str) -> torch.Tensor:
        """One header field (``count``, ``flags``, ``aux``, ``s0``, ``s1``) as a 0-dim tensor on
        the payload's device: what a resident decoder reads instead of :attr:`header`."""
        lo, hi, dtype = _FIELDS[name]
        return self.data[lo:hi].view(dtype)[0]

    def flag_word(self) -> torch.Tensor:
        """A 0-dim bool tensor on the payload's device: whether the encoded tensor held inf or
        NaN (or overflowed the format). Read on the device, so it never waits for the host."""
        word = self.field("flags")
        return (word & int(Flag.NONFINITE | Flag.OVERFLOW)) != 0

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def count(self) -> int:
        return self.header.count

    @property
    def nonfinite(self) -> bool:
        """True when the encoded tensor held inf or NaN (or a value overflowed the format)."""
        return bool(self.header.flags & (Flag.NONFINITE | Flag.OVERFLOW))

    def __repr__(self) -> str:
        h = self.header
        return (
            f"Payload(codec={self.codec!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"nbytes={self.nbytes}, count={h.count}, flags={h.flags!r})"
        )


def write_header(data: torch.Tensor, header: Header) -> None:
    """Write ``header`` into the first bytes of ``data``."""
    raw = header.pack()
    if data.device.type == "cpu" and data.is_contiguous():
        ctypes.memmove(data.data_ptr(), raw, HEADER_BYTES)
    else:
        data[:HEADER_BYTES].copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))


def write_device_header(
    data: torch.Tensor,
    count: torch.Tensor | int,
    flags: torch.Tensor | int = 0,
    aux: torch.Tensor | int = 0,
    s0: torch.Tensor | float = 0.0,
    s1: torch.Tensor | float = 0.0,
) -> None:
    """Write a header whose fields may be 0-dim tensors on ``data``'s device, without reading any
    of them on the host (a handful of tiny copies on the device's stream)."""

    def put(lo: int, hi: int, dtype: torch.dtype, value: torch.Tensor | float | int) -> None:
        view = data[lo:hi].view(dtype)
        if isinstance(value, torch.Tensor):
            view.copy_(value.reshape(1))
        else:
            view.fill_(value)

    for name, value in (("count", count), ("flags", flags), ("aux", aux), ("s0", s0), ("s1", s1)):
        put(*_FIELDS[name], value)


def device_flags(nonfinite: torch.Tensor, overflow: torch.Tensor | None = None) -> torch.Tensor:
    """The header's flags word as an int32 device tensor from boolean (or count) device tensors."""
    word = (nonfinite != 0).to(torch.int32) * int(Flag.NONFINITE)
    if overflow is not None:
        word = word + (overflow != 0).to(torch.int32) * int(Flag.OVERFLOW)
    return word


def allocate(nbytes: int, device: torch.device, out: torch.Tensor | None = None) -> torch.Tensor:
    """A ``uint8`` buffer of ``nbytes``: a prefix of ``out`` when given (it must be large enough)."""
    if out is None:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous():
        raise TypeError("out must be a contiguous 1-D uint8 tensor")
    if out.numel() < nbytes:
        raise ValueError(
            f"out holds {out.numel()} bytes but this payload needs {nbytes} (see Codec.max_nbytes)"
        )
    if out.device != device:
        raise ValueError(f"out is on {out.device} but the tensor is on {device}")
    return out[:nbytes]
