"""A token file on central storage (any fsspec URL), kept whole in the disk tier.

A token file needs no decoding and is read by windows, so its cache is the disk tier alone: it
is streamed from central storage once per node into a verified entry, then memory-mapped (the
operating system's page cache then plays the memory tier, shared by the node's processes).
Without a disk tier the file is read into this process's memory.

The entry's key is the file's URL, size and version (its ETag, Last-Modified or modification
time, as storage reports it), so a file changed on central storage gets a new entry. Storage
that reports no version at all cannot tell a file replaced in place with one of the same size:
then the disk tier is not used for it (one warning), and the file is read from central storage.
The mapping is made from the very file whose digest was checked (see
:meth:`~gradsync.apps.data.cache.disk.DiskCache.map_payload`), so another process evicting or
replacing the entry meanwhile cannot change what is read.
"""

from __future__ import annotations

import hashlib
import posixpath
import warnings
from collections.abc import Iterator

import numpy as np

from gradsync.apps.data.bundle import DataBundle
from gradsync.apps.data.cache.config import CacheConfig
from gradsync.apps.data.cache.disk import entry_key
from gradsync.apps.data.cache.source import Storage, StorageError, version_of
from gradsync.apps.data.tokenfile import tokens_from_bytes

_CHUNK = 4 << 20


def load_cached_tokens(url: str, *, vocab: int | None, seq_len: int, cache: CacheConfig | None) -> DataBundle:
    cache = cache if cache is not None else CacheConfig(memory=False)
    storage = Storage(url, cache.storage_options)
    fs = storage.fs
    try:
        info = fs.info(storage.root)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--data tokens: cannot read {url}: {exc}") from exc
    size = info.get("size")
    if info.get("type") == "directory" or size is None:
        raise ValueError(f"--data tokens: {url} is not a file")
    if size == 0:
        raise ValueError(f"--data tokens: {url} is empty")
    binary = posixpath.splitext(url.rstrip("/"))[1].lower() == ".bin"
    if binary and size % 2:
        raise ValueError(
            f"--data tokens: {url} has {size} bytes, an odd number, so it is not uint16 token ids"
        )
    version = version_of(info)
    key = entry_key("file", url, int(size), version)
    disk = cache.build_disk()
    if disk is not None and not version:
        warnings.warn(
            f"--data tokens: {url} has no version on its storage (no ETag, Last-Modified or "
            "modification time), so a cached copy could not tell that it changed: it is read from "
            "central storage, not from the disk cache",
            RuntimeWarning,
            stacklevel=2,
        )
        disk = None
    raw: np.ndarray | None = None
    if disk is not None and disk.enabled:
        found = disk.map_payload(key)
        if found is None and disk.put_file(key, _stream(storage, url, int(size))):
            found = disk.map_payload(key)
        if found is not None:
            raw = np.frombuffer(found, dtype=np.uint8)
    if raw is None:  # no disk tier, or it could not take the file
        raw = np.frombuffer(b"".join(_stream(storage, url, int(size))), dtype=np.uint8)

    def digest(*settings: object) -> str:
        return hashlib.blake2b(repr((url, int(size), version, settings)).encode(), digest_size=8).hexdigest()

    return tokens_from_bytes(raw, binary, url, vocab=vocab, seq_len=seq_len, digest=digest)


def _stream(storage: Storage, url: str, size: int) -> Iterator[bytes]:
    got = 0
    with storage.open_stream(storage.root) as f:
        while True:
            block = f.read(_CHUNK)
            if not block:
                break
            got += len(block)
            yield block
    storage.count_fetched(got)
    if got != size:
        raise StorageError(f"{url}: read {got} bytes but it was listed with {size}")
