"""Central storage for the emulated cluster: a read-only HTTP file server over one directory.

Started in the storage node's namespace (``gradsync cluster up --storage-link 20mbit`` makes
``gs-st`` at 10.78.0.250), every byte it sends to a node crosses the storage node's shaped cable
and the node's own, like a file server behind a slow network::

    from gradsync.apps.cluster.netns import STORAGE, STORAGE_ADDRESS

    with storage_server("/data/imagenet-small", namespace=STORAGE, host=STORAGE_ADDRESS) as st:
        before = st.served_bytes()
        ...  # training nodes read st.url + "/train/0001.jpg" (directory listings are followed)
        sent = st.served_bytes() - before

The server is the standard library's ``SimpleHTTPRequestHandler`` (files, HEAD, HTML directory
listings with hrefs, 404s) on a threading server with a deep accept queue (256: the default 5
makes a burst of concurrent clients wait for SYN retries), HTTP/1.1 keep-alive and no request
log. Paths are mapped under the directory (``..`` cannot climb out), and a symlink that leads
outside the directory answers 404, so nothing outside it is served.

``GET /.gradsync-served`` answers, as a plain-text integer, how many body bytes of files and
directory listings the server has sent since it started (headers, error pages and the counter's
own answers are not counted; a chunk is counted as it is handed to the socket, so a client that
has read a whole body always finds it counted). :meth:`StorageServer.served_bytes` asks for it;
when the server runs in a namespace, the request is made by a short Python process inside that
same namespace, where the server's own address is local: it never touches the shaped cables,
whose counters and rate it would otherwise disturb.

Run by hand: ``python -m gradsync.apps.cluster.storage DIR --host H --port P [--ready-file F]``. The
server process started by :func:`storage_server` runs this file by its path in isolated mode
(``python -I .../storage.py``), so it starts without importing gradsync (and torch).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import os
import signal
import socketserver
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

SERVED_PATH = "/.gradsync-served"
_CHUNK = 256 * 1024

# asks a server for its counter; run by the namespace's Python, so the standard library only
_ASK_SERVED = (
    "import sys, urllib.request as u\n"
    "o = u.build_opener(u.ProxyHandler({}))\n"
    "print(int(o.open(sys.argv[1], timeout=float(sys.argv[2])).read()))\n"
)


class _Counter:
    """A running total that many handler threads add to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, n: int) -> None:
        with self._lock:
            self._total += n

    @property
    def total(self) -> int:
        with self._lock:
            return self._total


class _Handler(http.server.SimpleHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a client fetching many files reuses a connection
    timeout = 60  # seconds a connection may sit idle (or stall) before its thread gives up on it
    server: StorageHTTPServer

    def log_message(self, format: str, *args: Any) -> None:
        """No request log: a benchmark makes tens of thousands of requests."""

    def do_GET(self) -> None:
        if urllib.parse.urlsplit(self.path).path == SERVED_PATH:
            body = f"{self.server.served.total}\n".encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)
            return
        super().do_GET()

    def send_head(self) -> Any:
        # translate_path drops '..' segments; a symlink is the remaining way out of the directory
        real = os.path.realpath(self.translate_path(self.path))
        root = self.server.root
        if real != root and not real.startswith(root.rstrip(os.sep) + os.sep):
            self.send_error(404, "File not found")
            return None
        return super().send_head()

    def copyfile(self, source: Any, outputfile: Any) -> None:
        """The base class's copy, counting each chunk as it goes to the socket."""
        while chunk := source.read(_CHUNK):
            self.server.served.add(len(chunk))
            try:
                outputfile.write(chunk)
            except OSError:
                self.server.served.add(-len(chunk))  # the client went away: this chunk was not sent
                raise


class StorageHTTPServer(http.server.ThreadingHTTPServer):
    """A threading HTTP server for one directory, read-only, counting the body bytes it sends."""

    request_queue_size = 256  # the stdlib's 5 stalls bursts of concurrent clients on SYN retries
    daemon_threads = True  # a client holding a keep-alive connection must not block shutdown

    def __init__(self, directory: str | os.PathLike[str], host: str, port: int = 0) -> None:
        self.root = os.path.realpath(directory)
        if not os.path.isdir(self.root):
            raise NotADirectoryError(f"not a directory: {directory}")
        self.served = _Counter()
        super().__init__((host, port), functools.partial(_Handler, directory=self.root))

    def server_bind(self) -> None:
        # HTTPServer.server_bind asks DNS for the host's name (socket.getfqdn), which in a
        # namespace without a resolver waits for the resolver's timeouts: skip it
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def serve_directory(
    directory: str | os.PathLike[str],
    host: str,
    port: int = 0,
    *,
    ready_file: str | os.PathLike[str] | None = None,
) -> None:
    """Serve ``directory`` read-only on ``host:port`` (0: any free port) until SIGTERM or Ctrl-C.
    Once listening, the port is written to ``ready_file`` (atomically: temp file, then rename)."""
    server = StorageHTTPServer(directory, host, port)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    # SIGTERM ends the loop like Ctrl-C, so the socket is closed (only the main thread may do this)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, stop) if main_thread else None
    try:
        if ready_file is not None:
            _write_atomically(Path(ready_file), f"{server.server_port}\n")
        with suppress(KeyboardInterrupt):
            server.serve_forever(poll_interval=0.2)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        server.server_close()


def _ask_served(url: str, timeout_s: float) -> int:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy
    with opener.open(url, timeout=timeout_s) as r:
        return int(r.read())


@dataclass(frozen=True)
class StorageServer:
    """A running storage server: its ``url`` (no trailing slash) and where it runs."""

    url: str
    namespace: str | None
    pid: int

    def served_bytes(self, timeout_s: float = 5.0) -> int:
        """Body bytes the server has sent since it started (see the module's notes)."""
        from gradsync.apps.cluster.netns import ClusterError

        counter = self.url + SERVED_PATH
        if self.namespace is None:
            try:
                return _ask_served(counter, timeout_s)
            except (OSError, ValueError) as e:
                raise ClusterError(f"{counter}: {e}") from e
        cmd = ["ip", "netns", "exec", self.namespace, sys.executable, "-I", "-c", _ASK_SERVED]
        cmd += [counter, str(timeout_s)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 10)
        except subprocess.TimeoutExpired as e:
            raise ClusterError(f"{counter} (from {self.namespace}): no answer within {timeout_s:g} s") from e
        if done.returncode != 0:
            why = done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]
            raise ClusterError(f"{counter} (from {self.namespace}): {why[0]}")
        return int(done.stdout)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)


@contextmanager
def storage_server(
    directory: str | os.PathLike[str],
    *,
    namespace: str | None = None,
    host: str = "127.0.0.1",
    timeout_s: float = 10.0,
) -> Iterator[StorageServer]:
    """Serve ``directory`` from a child process (inside ``ip netns exec NAMESPACE`` when given,
    bound to ``host``) for the duration of the ``with`` block; waits at most ``timeout_s`` for it
    to listen (``ClusterError`` with its stderr if it does not), and stops it on exit (SIGTERM,
    then SIGKILL after a grace period)."""
    from gradsync.apps.cluster.netns import ClusterError  # here: this file also runs without gradsync

    root = Path(directory).resolve()
    if not root.is_dir():
        raise ValueError(f"the storage directory must be an existing directory, got {directory!r}")
    with tempfile.TemporaryDirectory(prefix="gradsync-storage-") as tmp:
        ready, errors = Path(tmp) / "port", Path(tmp) / "stderr"
        cmd = [sys.executable, "-I", str(Path(__file__).resolve()), str(root), "--host", host]
        cmd += ["--port", "0", "--ready-file", str(ready)]
        if namespace is not None:
            cmd = ["ip", "netns", "exec", namespace, *cmd]
        with open(errors, "wb") as err:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True
            )
        try:
            end = time.monotonic() + timeout_s
            while not ready.is_file():
                exited = proc.poll() is not None
                if exited or time.monotonic() > end:
                    _stop(proc)
                    what = f"exited ({proc.returncode})" if exited else f"not up after {timeout_s:g} s"
                    where = f" in {namespace}" if namespace else ""
                    why = errors.read_text(errors="replace").strip() or "no error output"
                    raise ClusterError(f"the storage server for {root}{where}: {what}: {why}")
                time.sleep(0.05)
            port = int(ready.read_text())
            yield StorageServer(f"http://{host}:{port}", namespace, proc.pid)
        finally:
            _stop(proc)


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m gradsync.apps.cluster.storage", description="serve a directory read-only over HTTP"
    )
    p.add_argument("directory")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (the storage node's)")
    p.add_argument("--port", type=int, default=0, help="0: any free port (see --ready-file)")
    p.add_argument("--ready-file", help="once listening, the port is written here (atomically)")
    args = p.parse_args(argv)
    if not os.path.isdir(args.directory):
        p.error(f"not a directory: {args.directory}")
    try:
        serve_directory(args.directory, args.host, args.port, ready_file=args.ready_file)
    except OSError as e:  # mostly the bind: an address this namespace lacks, a port in use
        print(f"storage server on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
