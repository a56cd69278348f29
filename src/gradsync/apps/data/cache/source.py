"""Central storage: the place a dataset's files live, reached through fsspec.

Any URL fsspec understands works: a local path or ``file://``, ``http(s)://`` (a server's
directory listings are followed, as ``python -m http.server`` or nginx's ``autoindex`` write
them), ``s3://`` with the ``s3`` extra, and so on. :class:`Storage` lists the files under a root
with a size and a version for each (the modification time, or the ``ETag`` / ``Last-Modified``
header over HTTP), so a cache key changes whenever a file does, and fetches many files at once
(fsspec runs the requests of a batch concurrently).

The fsspec filesystem object is made lazily in each process: fsspec's HTTP filesystem refuses to
be used after a fork (DataLoader workers), so only the URL and the storage options are kept.
"""

from __future__ import annotations

import asyncio
import os
import threading
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_INFO_BATCH = 256  # HEAD requests in flight at once when an HTTP listing lacks sizes


class StorageError(OSError):
    """Central storage cannot be read; the message names the URL and the cause."""


@dataclass(frozen=True)
class RemoteFile:
    """One file under a storage root."""

    url: str  # what fsspec fetches (over HTTP: the listed, percent-encoded address)
    rel: str  # the path under the root, '/'-separated and decoded (labels, display)
    size: int
    version: str  # changes when the file does: mtime in ns, ETag or Last-Modified


def is_url(path: str) -> bool:
    """Whether ``path`` names a remote location (``scheme://``) rather than a local path."""
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum()


def version_of(info: dict[str, Any]) -> str:
    """What changes when a file does, from fsspec's ``info()`` (an ETag, a modification time);
    "" when storage reports none (then a cached copy cannot tell a changed file)."""
    for key in ("ETag", "etag", "Last-Modified", "LastModified", "last_modified", "mtime", "updated"):
        value = info.get(key)
        if value is not None:
            return f"{key}={value}"
    return ""


class Storage:
    """A root URL (and fsspec storage options) under which a dataset's files live."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        if not isinstance(url, str) or not url:
            raise ValueError(f"the storage URL must be a non-empty string, got {url!r}")
        self.options = dict(storage_options or {})
        self.url = url.rstrip("/") if url.rstrip("/") else url
        self._fs: Any = None
        self._root = ""
        self._pid = -1
        self._lock = threading.Lock()
        self.bytes_fetched = 0
        self.files_fetched = 0
        self.fs  # noqa: B018  (an unknown protocol or a missing extra fails here, at once)

    @property
    def fs(self) -> Any:
        """This process's fsspec filesystem (a new one after a fork)."""
        if self._pid != os.getpid():
            try:
                from fsspec.core import url_to_fs
            except ImportError as exc:  # pragma: no cover - fsspec comes with gradsync[apps]
                raise ImportError('remote datasets need fsspec: pip install "gradsync[apps]"') from exc
            try:
                self._fs, self._root = url_to_fs(self.url, **self.options)
            except (ImportError, ValueError) as exc:
                raise ValueError(f"cannot read {self.url}: {exc}") from exc
            self._pid = os.getpid()
        return self._fs

    @property
    def root(self) -> str:
        self.fs  # noqa: B018
        return self._root.rstrip("/")

    @property
    def remote(self) -> bool:
        """Whether the files cross a network (anything but the local filesystem)."""
        return "file" not in _protocols(self.fs)

    def _rel(self, name: str) -> str:
        root = self.root
        rel = name[len(root) :].lstrip("/") if name.startswith(root) else name
        return urllib.parse.unquote(rel) if self._is_http() else rel

    def _is_http(self) -> bool:
        return bool({"http", "https"} & set(_protocols(self.fs)))

    def list_files(self) -> list[RemoteFile]:
        """Every file under the root, sorted by path, with sizes and versions."""
        fs = self.fs
        try:
            found = fs.find(self.root, detail=True)
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot list {self.url}: {exc}") from exc
        entries = [
            (name, info)
            for name, info in found.items()
            if info.get("type", "file") == "file" and not name.endswith("/")
        ]
        missing = [name for name, info in entries if info.get("size") is None or not version_of(info)]
        if missing:
            extra = self._info_many(missing)
            entries = [(name, {**info, **extra.get(name, {})}) for name, info in entries]
        files = []
        for name, info in entries:
            size = info.get("size")
            if size is None:
                raise StorageError(f"{self.url}: the server gives no size for {name}")
            files.append(RemoteFile(name, self._rel(name), int(size), version_of(info)))
        files.sort(key=lambda f: f.rel)
        return files

    def _info_many(self, names: list[str]) -> dict[str, dict[str, Any]]:
        fs = self.fs
        if not getattr(fs, "async_impl", False):
            return {name: fs.info(name) for name in names}
        from fsspec.asyn import sync

        async def gather(batch: list[str]) -> list[Any]:
            return await asyncio.gather(*(fs._info(n) for n in batch), return_exceptions=True)

        out: dict[str, dict[str, Any]] = {}
        for start in range(0, len(names), _INFO_BATCH):
            batch = names[start : start + _INFO_BATCH]
            for name, info in zip(batch, sync(fs.loop, gather, batch), strict=True):
                if isinstance(info, BaseException):
                    raise StorageError(f"cannot read {name}: {info}") from info
                out[name] = info
        return out

    def fetch(self, urls: Sequence[str]) -> list[bytes]:
        """The bytes of each file, in order; the requests of one call run concurrently where the
        filesystem allows. Any failure raises :class:`StorageError` naming the file."""
        if not urls:
            return []
        fs = self.fs
        try:
            # cat runs the requests concurrently on an asynchronous filesystem (HTTP, S3), but
            # it reads glob characters such as [ in a name: local names go one by one
            if len(urls) > 1 and getattr(fs, "async_impl", False):
                got = fs.cat(list(urls), on_error="return")
            else:
                got = {url: fs.cat_file(url) for url in urls}
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot fetch {urls[0]} from {self.url}: {exc}") from exc
        out = []
        for url in urls:
            data = got.get(url)
            if data is None:
                # fsspec may key results by its own spelling of the path
                data = got.get(fs._strip_protocol(url)) if hasattr(fs, "_strip_protocol") else None
            if isinstance(data, BaseException) or data is None:
                why = data if data is not None else "no data returned"
                raise StorageError(f"cannot fetch {url}: {why}")
            out.append(bytes(data))
        with self._lock:
            self.bytes_fetched += sum(len(b) for b in out)
            self.files_fetched += len(out)
        return out

    def open_stream(self, url: str) -> Any:
        """A file object reading ``url`` front to back in one request (no range requests, which
        simple HTTP servers do not support)."""
        kw = {"block_size": 0} if self._is_http() else {}
        try:
            return self.fs.open(url, "rb", **kw)
        except (OSError, ValueError) as exc:
            raise StorageError(f"cannot open {url}: {exc}") from exc

    def count_fetched(self, nbytes: int) -> None:
        """Count bytes read through :meth:`open_stream` (the caller knows how many)."""
        with self._lock:
            self.bytes_fetched += nbytes
            self.files_fetched += 1


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)
