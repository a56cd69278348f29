"""The emulated cluster: rate parsing, the commands it would run, the launcher's command lines and
its errors, and the storage node's file server on loopback, all without root. Two tests really
build a cluster (2 nodes running a gradsync command; 1 node fetching from the storage node over
its shaped cable); they skip, saying why, where network namespaces cannot be made (no root, a
container)."""

import http.client
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pytest

from gradsync.apps.cluster import netns
from gradsync.apps.cluster.launch import node_command, node_environment
from gradsync.apps.cluster.storage import SERVED_PATH, storage_server
from gradsync.apps.commands import main
from gradsync.units import parse_duration, parse_rate, parse_size, rate_text


def test_one_parser_reads_rates_durations_and_sizes_in_explicit_units():
    """gradsync.units: every rate in bytes per second (bits as tc writes them, or bytes), every
    duration in seconds, every size in bytes; a bad value names the option and what it takes."""
    assert parse_rate("100mbit", "--rate") == 100e6 / 8
    assert parse_rate(" 2.5Gbit ", "--rate", tc_units=True) == 2.5e9 / 8
    assert parse_rate("12GB/s", "--inter") == 12e9
    assert parse_rate("800kbit", "--inter") == 1e5
    for bad in ("100", "fast", "0mbit", "-1gbit", "100mb"):
        with pytest.raises(ValueError, match="--rate must be a positive rate like 25gbit"):
            parse_rate(bad, "--rate")
    with pytest.raises(
        ValueError, match=r"--link must be a positive rate like 100mbit or 1gbit \(gbit, mbit or kbit\)"
    ):
        parse_rate("12GB/s", "--link", tc_units=True)
    assert rate_text(parse_rate("25gbit", "--inter")) == "25gbit"
    assert parse_duration("1.5ms", "--step-time") == pytest.approx(1.5e-3, rel=1e-12)
    assert parse_duration("20us", "--inter-latency") == pytest.approx(20e-6, rel=1e-12)
    with pytest.raises(ValueError, match="--step-time must be a duration like 20us"):
        parse_duration("3 hours", "--step-time")
    assert parse_size("512m", "--cache-memory", ("auto", "off")) == 512 << 20
    assert parse_size("auto", "--cache-memory", ("auto", "off")) == "auto"
    assert parse_size("123456", "--cache-disk") == 123456
    with pytest.raises(
        ValueError, match="--cache-disk must be a size such as 512m, 4g or a number of bytes, or none"
    ):
        parse_size("lots", "--cache-disk", ("none",))


def test_up_commands_shape_both_ends_of_every_cable():
    cmds = netns.up_commands(3, "100mbit")
    text = [" ".join(c) for c in cmds]
    for i in range(3):
        assert f"ip netns add gs-n{i}" in text
        assert f"ip -n gs-n{i} addr add 10.78.0.{i + 1}/24 dev eth0" in text
        # the node's side of its cable and the switch's port to it, each with an htb rate class
        assert sum(f"-n gs-n{i} class add dev eth0" in t and "rate 100mbit" in t for t in text) == 1
        assert sum(f"-n gs-sw class add dev gsp{i}" in t and "ceil 100mbit" in t for t in text) == 1
        assert f"ip netns exec gs-n{i} sysctl -qw net.ipv6.conf.all.disable_ipv6=1" in text
    assert not any("class add" in t for t in (" ".join(c) for c in netns.up_commands(2, "none")))


def test_up_commands_give_the_storage_node_its_own_shaped_cable():
    text = [" ".join(c) for c in netns.up_commands(2, "1gbit", "20mbit")]
    assert "ip netns add gs-st" in text
    assert "ip -n gs-st addr add 10.78.0.250/24 dev eth0" in text
    assert "ip -n gs-sw link set gspst master gsbr0" in text
    assert "ip -n gs-st link set lo up" in text
    assert "ip netns exec gs-st sysctl -qw net.ipv6.conf.all.disable_ipv6=1" in text
    assert "ip netns exec gs-st sysctl -qw net.ipv4.tcp_congestion_control=reno" in text
    # both ends of the storage cable at the storage rate; the nodes' cables keep theirs
    assert sum("-n gs-st class add dev eth0" in t and "rate 20mbit" in t for t in text) == 1
    assert sum("-n gs-sw class add dev gspst" in t and "ceil 20mbit" in t for t in text) == 1
    assert sum("class add" in t and "rate 1gbit" in t for t in text) == 4
    assert netns.STORAGE == "gs-st" and netns.STORAGE_ADDRESS == "10.78.0.250"
    # without a storage rate nothing of it; "none" makes the node with an unshaped cable
    assert not any("gs-st" in t or "gspst" in t for t in (" ".join(c) for c in netns.up_commands(2, "1gbit")))
    unshaped = [" ".join(c) for c in netns.up_commands(1, "1gbit", "none")]
    assert "ip netns add gs-st" in unshaped
    assert not any("class add" in t and ("gs-st" in t or "gspst" in t) for t in unshaped)


def test_a_bad_storage_rate_names_its_option():
    for bad in ("slow", "100", "0mbit", ""):
        with pytest.raises(ValueError, match="--storage-link must be a positive rate like 100mbit"):
            netns.up_commands(1, "1gbit", bad)
        with pytest.raises(ValueError, match="--storage-link must be a positive rate like 100mbit"):
            netns.up(1, "1gbit", bad)  # refused before anything is created


def test_cluster_state_files_without_a_storage_node_still_load(monkeypatch, tmp_path):
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path)
    (tmp_path / "state.json").write_text(json.dumps({"nodes": 3, "rate": "1gbit"}))
    assert netns.ClusterState.load() == netns.ClusterState(3, "1gbit", None)
    netns.ClusterState(2, "100mbit", "20mbit").save()
    assert netns.ClusterState.load() == netns.ClusterState(2, "100mbit", "20mbit")


def test_node_command_is_one_torchrun_per_node_with_static_rendezvous():
    cmd = node_command(1, 2, 3, 29511, ["bench", "step", "--model", "vgg"])
    assert cmd[:4] == ["ip", "netns", "exec", "gs-n1"]
    assert cmd[4:7] == [sys.executable, "-m", "torch.distributed.run"]
    assert {
        "--nnodes=2",
        "--nproc-per-node=3",
        "--node-rank=1",
        "--master-addr=10.78.0.1",
        "--master-port=29511",
    } <= set(cmd)
    assert cmd[-6:] == ["-m", "gradsync", "bench", "step", "--model", "vgg"]
    env = node_environment("1gbit")
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["TB_RATE"] == "1gbit" and env["OMP_NUM_THREADS"] == "1"


def test_without_root_the_cluster_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, why = netns.check()
    assert not ok and "needs root" in why
    with pytest.raises(netns.ClusterError, match="needs root"):
        netns.up(2, "100mbit")


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["cluster", "up", "--rate", "warp"], 2, "--rate must be a positive rate like 100mbit"),
        (["cluster", "up", "--nodes", "0"], 2, "--nodes must be an integer from 1 to 64"),
        (["cluster", "launch", "--", "bench", "step"], 1, "no emulated cluster is up"),
        (["cluster", "launch", "--per-node", "0", "--", "bench", "step"], 2, "--per-node must be at least 1"),
        (["cluster", "launch"], 2, "no gradsync command given"),
        (["cluster", "up", "--storage-link", "slow"], 2, "--storage-link must be a positive rate like"),
    ],
)
def test_cluster_command_errors(argv, code, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path)  # no cluster state here
    assert main(argv) == code
    assert message in capsys.readouterr().err


def _cluster_unusable() -> str | None:
    ok, why = netns.check()
    if not ok:
        return why
    if netns.ClusterState.load() is not None:
        return "an emulated cluster is already up (a benchmark may be using it)"
    return None


@pytest.mark.timeout(240)
def test_a_real_two_node_cluster_runs_a_gradsync_command(tmp_path, monkeypatch):
    reason = _cluster_unusable()
    if reason:
        pytest.skip(f"emulated cluster unavailable: {reason}")
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path / "state")
    out = tmp_path / "c.json"
    argv = [
        "cluster",
        "run",
        "--nodes",
        "2",
        "--per-node",
        "1",
        "--rate",
        "1gbit",
        "--timeout",
        "180",
        "--port",
        "29517",
        "--",
        "bench",
        "collectives",
        "--schemes",
        "flat,hierarchical",
        "--sizes-mb",
        "0.25",
        "--budget",
        "0.05",
        "--max-iters",
        "2",
        "--calibration-reps",
        "1",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    import json

    result = json.loads(out.read_text())
    assert result["nodes"] == 2 and result["per_node"] == 1
    # bytes really left each node through its shaped NIC (read from the namespace's counters)
    assert all(
        r["cable_bytes_per_op"] and r["cable_bytes_per_op"] > 0.25 * 2**20 * 0.9 for r in result["rows"]
    )
    assert netns.ClusterState.load() is None  # taken down again
    assert not any(
        n.startswith("gs-n") for n in netns._run(["ip", "netns", "list"], check=False).stdout.split()
    )


# --- the storage node's file server, on loopback (no namespace, no root) ---


@pytest.fixture
def tree(tmp_path):
    """A directory to serve, a secret beside it and a symlink from inside it to that secret."""
    root = tmp_path / "served"
    (root / "sub" / "deeper").mkdir(parents=True)
    files = {
        "a.bin": os.urandom(300_000),
        "empty.txt": b"",
        "sub/b.txt": b"hello\n",
        "sub/deeper/c.bin": os.urandom(70_000),
        "name with space.txt": b"spaced",
    }
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    (tmp_path / "secret.txt").write_bytes(b"outside the served directory")
    (root / "leak").symlink_to(tmp_path / "secret.txt")
    return root, files


def _get(url: str, path: str, method: str = "GET") -> tuple[int, bytes]:
    """One request, the path sent exactly as given (urllib would not normalize it either)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request(method, path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def test_storage_server_serves_the_tree_read_only(tree):
    root, files = tree
    with storage_server(root) as st:
        assert st.url.startswith("http://127.0.0.1:") and st.namespace is None
        for rel, data in files.items():
            assert _get(st.url, "/" + urllib.parse.quote(rel)) == (200, data)
        status, page = _get(st.url, "/")
        assert status == 200
        for href in ('href="a.bin"', 'href="sub/"', 'href="name%20with%20space.txt"'):
            assert href.encode() in page
        status, page = _get(st.url, "/sub/")
        assert status == 200 and b'href="b.txt"' in page and b'href="deeper/"' in page
        assert _get(st.url, "/sub")[0] == 301  # to "/sub/", as a directory
        assert _get(st.url, "/missing.bin")[0] == 404
        assert _get(st.url, "/a.bin", "HEAD") == (200, b"")
        assert _get(st.url, "/a.bin", "PUT")[0] == 501  # read-only: no PUT, POST or DELETE
        assert _get(st.url, "/a.bin", "DELETE")[0] == 501
        assert (root / "a.bin").read_bytes() == files["a.bin"]


@pytest.mark.parametrize(
    "path",
    [
        "/../secret.txt",
        "/sub/../../secret.txt",
        "/%2e%2e/secret.txt",
        "/sub/%2E%2E/%2E%2E/secret.txt",
        "/..%2fsecret.txt",
        "//../secret.txt",
        "/leak",  # a symlink inside that points outside
    ],
)
def test_storage_server_serves_nothing_outside_its_directory(tree, path):
    root, _ = tree
    with storage_server(root) as st:
        status, body = _get(st.url, path)
        assert status == 404 and b"outside the served directory" not in body


def test_storage_server_counts_the_body_bytes_it_served(tree):
    root, files = tree
    with storage_server(root) as st:
        assert st.served_bytes() == 0
        fetched = ["a.bin", "sub/b.txt", "sub/deeper/c.bin", "a.bin"]
        for rel in fetched:
            assert _get(st.url, "/" + rel)[0] == 200
        # neither error pages, HEAD nor the counter's own answers count
        assert _get(st.url, "/missing")[0] == 404
        assert _get(st.url, "/a.bin", "HEAD")[0] == 200
        expected = sum(len(files[rel]) for rel in fetched)
        assert st.served_bytes() == expected
        assert _get(st.url, SERVED_PATH) == (200, f"{expected}\n".encode())
        page = _get(st.url, "/sub/")[1]  # a directory listing is a body too
        assert st.served_bytes() == expected + len(page)


def test_storage_server_keeps_connections_alive(tree):
    root, files = tree
    with storage_server(root) as st:
        parts = urllib.parse.urlsplit(st.url)
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
        try:
            sockets = set()
            for rel in ("sub/b.txt", "a.bin", "sub/", "sub/b.txt"):
                conn.request("GET", "/" + rel)
                r = conn.getresponse()
                assert r.status == 200 and r.version == 11 and not r.will_close
                body = r.read()
                assert rel not in files or body == files[rel]
                sockets.add(id(conn.sock))
            assert len(sockets) == 1  # one connection for every request
        finally:
            conn.close()


def test_storage_server_answers_many_clients_at_once(tree):
    root, files = tree
    clients = 64
    start = threading.Barrier(clients)

    def fetch(i: int) -> bytes:
        start.wait(timeout=30)  # every client connects at the same moment
        return _get(st.url, "/a.bin" if i % 2 else "/sub/deeper/c.bin")[1]

    with storage_server(root) as st, ThreadPoolExecutor(clients) as pool:
        t0 = time.monotonic()
        bodies = list(pool.map(fetch, range(clients)))
        elapsed = time.monotonic() - t0
        expected = [files["a.bin"] if i % 2 else files["sub/deeper/c.bin"] for i in range(clients)]
        assert bodies == expected
        assert st.served_bytes() == sum(map(len, bodies))
    assert elapsed < 5.0  # with the stdlib's accept queue of 5 this waits for SYN retries (1 s, 3 s...)


def test_storage_server_stops_when_the_block_ends(tree):
    root, _ = tree
    with storage_server(root) as st:
        pid, url = st.pid, st.url
        assert _get(url, "/sub/b.txt")[0] == 200
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    with pytest.raises(ConnectionRefusedError):
        _get(url, "/sub/b.txt")


def test_storage_server_that_cannot_start_says_why(tree, tmp_path):
    root, _ = tree
    with (
        pytest.raises(ValueError, match="must be an existing directory"),
        storage_server(tmp_path / "nowhere"),
    ):
        pass
    # an address this machine does not have: the bind fails and its error comes back
    with (
        pytest.raises(netns.ClusterError, match=r"exited \(1\): storage server on 192\.0\.2\.1:0: .*assign"),
        storage_server(root, host="192.0.2.1", timeout_s=10),
    ):
        pass


@pytest.mark.timeout(60)
def test_a_node_fetches_from_storage_through_the_shaped_cable(tmp_path, monkeypatch):
    reason = _cluster_unusable()
    if reason:
        pytest.skip(f"emulated cluster unavailable: {reason}")
    monkeypatch.setattr(netns, "STATE_DIR", tmp_path / "state")
    served = tmp_path / "served"
    served.mkdir()
    data = os.urandom(1_000_000)
    (served / "big.bin").write_bytes(data)
    fetch = (
        "import sys, time, urllib.request as u\n"
        "opener = u.build_opener(u.ProxyHandler({}))\n"
        "t = time.monotonic()\n"
        "body = opener.open(sys.argv[1], timeout=30).read()\n"
        "sys.stderr.write(f'{time.monotonic() - t}\\n')\n"
        "sys.stdout.buffer.write(body)\n"
    )
    try:
        state = netns.up(1, "1gbit", "20mbit")
        assert state.storage_rate == "20mbit" and "gs-st 10.78.0.250" in netns.status()
        with storage_server(served, namespace=netns.STORAGE, host=netns.STORAGE_ADDRESS) as st:
            assert st.url.startswith("http://10.78.0.250:")
            cmd = ["ip", "netns", "exec", "gs-n0", sys.executable, "-I", "-c", fetch, st.url + "/big.bin"]
            done = subprocess.run(cmd, capture_output=True, timeout=30)
            assert done.returncode == 0, done.stderr.decode()
            assert done.stdout == data
            # 1 MB at 20 Mbit/s takes 0.4 s; over the unshaped loopback it would take milliseconds
            assert float(done.stderr.decode().split()[-1]) > 0.3
            assert st.served_bytes() == len(data)
    finally:
        netns.down()
    assert netns.ClusterState.load() is None
    assert not any(
        n.startswith("gs-") for n in netns._run(["ip", "netns", "list"], check=False).stdout.split()
    )
