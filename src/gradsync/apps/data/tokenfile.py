"""Language-model data from one token file.

* ``.bin``: little-endian uint16 token ids, back to back, no header (the nanoGPT convention). The
  file is memory-mapped, so only the windows a batch needs are read. The vocabulary is the largest
  id + 1 unless ``vocab=`` gives it (it must then exceed every id in the file).
* anything else: text; its UTF-8 bytes are the tokens (vocabulary 256).

The last 10% of the tokens is validation, the rest training windows.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from gradsync.apps.data.bundle import DataBundle, lm_bundle

_HASH_ALL_BYTES = 256 << 20
_HASH_EDGE_BYTES = 16 << 20


def file_fingerprint(path: Path, *extra: object) -> str:
    """16 hex digits from the file's bytes (or, above 256 MiB, its size, first and last 16 MiB)."""
    h = hashlib.blake2b(digest_size=8)
    size = path.stat().st_size
    h.update(f"{size}:{extra!r}".encode())
    with path.open("rb") as f:
        if size <= _HASH_ALL_BYTES:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        else:
            h.update(f.read(_HASH_EDGE_BYTES))
            f.seek(size - _HASH_EDGE_BYTES)
            h.update(f.read(_HASH_EDGE_BYTES))
    return h.hexdigest()


def load_tokens_bundle(path: str, *, vocab: int | None, seq_len: int) -> DataBundle:
    file = Path(path).expanduser()
    if not file.is_file():
        raise ValueError(
            f"--data tokens: {file} is not a file" + ("" if file.exists() else " (it does not exist)")
        )
    size = file.stat().st_size
    if size == 0:
        raise ValueError(f"--data tokens: {file} is empty")
    binary = file.suffix.lower() == ".bin"
    if binary and size % 2:
        raise ValueError(
            f"--data tokens: {file} has {size} bytes, an odd number, so it is not uint16 token ids"
        )
    raw = np.memmap(file, dtype=np.uint8, mode="r")
    return tokens_from_bytes(
        raw,
        binary,
        str(file),
        vocab=vocab,
        seq_len=seq_len,
        digest=lambda *extra: file_fingerprint(file, *extra),
    )


def tokens_from_bytes(
    raw: np.ndarray,
    binary: bool,
    name: str,
    *,
    vocab: int | None,
    seq_len: int,
    digest: Callable[..., str],
) -> DataBundle:
    """The bundle of a token file whose bytes are ``raw`` (uint8, possibly memory-mapped):
    uint16 ids if ``binary``, else UTF-8 bytes. ``digest(*settings)`` fingerprints the file."""
    if binary:
        tokens: np.ndarray = raw.view("<u2")
        top = int(tokens.max())
        if vocab is None:
            vocab = top + 1
        elif vocab <= top:
            raise ValueError(f"--data tokens: vocab={vocab} but {name} holds token id {top}")
        kind = "uint16 token ids"
    else:
        if vocab is not None and vocab != 256:
            raise ValueError(f"--data tokens: vocab must be 256 for a text file (UTF-8 bytes), got {vocab}")
        tokens = raw
        vocab = 256
        kind = "UTF-8 bytes"
    return lm_bundle(
        "tokens",
        tokens,
        vocab=vocab,
        seq_len=seq_len,
        fingerprint=digest(kind, vocab, seq_len),
        source=f"token file {name} ({len(tokens)} tokens, {kind}); license: that of the file",
    )
