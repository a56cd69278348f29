"""The emulated cluster: rate parsing, the commands it would run, the launcher's command lines and
its errors, all without root. One test really builds a 2-node cluster and runs a gradsync command
on it; it skips, saying why, where network namespaces cannot be made (no root, a container)."""

import os
import sys

import pytest

from gradsync.cli import main
from gradsync.cluster import netns
from gradsync.cluster.launch import node_command, node_environment


def test_rates_parse_to_bits_per_second():
    assert netns.parse_rate("100mbit") == 100e6
    assert netns.parse_rate("1gbit") == 1e9
    assert netns.parse_rate(" 2.5Gbit ") == 2.5e9
    for bad in ("100", "fast", "0mbit", "-1gbit", "100mb"):
        with pytest.raises(ValueError, match="--rate must be a positive number with gbit, mbit or kbit"):
            netns.parse_rate(bad)


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
        (["cluster", "up", "--rate", "warp"], 2, "--rate must be a positive number"),
        (["cluster", "up", "--nodes", "0"], 2, "--nodes must be an integer from 1 to 64"),
        (["cluster", "launch", "--", "bench", "step"], 1, "no emulated cluster is up"),
        (["cluster", "launch", "--per-node", "0", "--", "bench", "step"], 2, "--per-node must be at least 1"),
        (["cluster", "launch"], 2, "no gradsync command given"),
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
