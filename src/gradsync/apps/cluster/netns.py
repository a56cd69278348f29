"""An emulated cluster on one Linux machine: network namespaces as nodes, shaped cables.

Each node ``gs-n<i>`` is a network namespace with one interface ``eth0`` (10.78.0.<i+1>/24)
whose veth peer is plugged into a bridge inside a switch namespace ``gs-sw``. Both directions of
every node's cable are shaped with an htb class at the given rate, like a full-duplex NIC of
that speed. Processes of one node talk over that namespace's loopback, unshaped: the fast
intra-node link. Every node disables IPv6 (so gloo cannot pick a link-local address) and uses
TCP reno (the shaper's queue and reno give steady throughput; see the testbed notes).

Optionally a storage node ``gs-st`` (10.78.0.250, eth0 plugged into the switch's port ``gspst``)
stands for central storage behind its own shaped cable: a file server started in it (see
:mod:`gradsync.apps.cluster.storage`) is reached by the nodes only through that cable and their own.

Only root can do this, and only where the kernel has network namespaces, veth, bridges and the
htb qdisc: :func:`check` says whether it can run and why not. :func:`up` removes whatever it
created if any step fails; :func:`down` removes everything named ``gs-*`` that it knows of.
Every command has a time limit, and traffic only goes to loopback and the 10.78.0.x addresses
created here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from gradsync.units import parse_rate

PREFIX = "gs"
SUBNET = "10.78.0"
SWITCH = f"{PREFIX}-sw"
BRIDGE = f"{PREFIX}br0"
STORAGE = f"{PREFIX}-st"
STORAGE_ADDRESS = f"{SUBNET}.250"  # above the nodes' addresses (at most 64 nodes: .1 to .64)
STATE_DIR = Path(os.environ.get("GRADSYNC_CLUSTER_STATE", "/tmp/gradsync-cluster"))
COMMAND_TIMEOUT_S = 20.0


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up or used here; the message says why."""


def node_name(i: int) -> str:
    return f"{PREFIX}-n{i}"


def node_address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


def check_rate(rate: str, option: str) -> None:
    """A cable rate is ``none`` (unshaped) or a rate in the units ``tc`` takes (gbit, mbit, kbit)."""
    if rate != "none":
        parse_rate(rate, option, tc_units=True)


@dataclass
class ClusterState:
    nodes: int
    rate: str
    storage_rate: str | None = None  # None: no storage node (state files written before it lack it)

    @classmethod
    def load(cls) -> ClusterState | None:
        path = STATE_DIR / "state.json"
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        storage_rate = data.get("storage_rate")
        return cls(int(data["nodes"]), str(data["rate"]), None if storage_rate is None else str(storage_rate))

    def save(self) -> None:
        STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = STATE_DIR / f".state.json.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(asdict(self)))
        os.replace(tmp, STATE_DIR / "state.json")

    @staticmethod
    def clear() -> None:
        (STATE_DIR / "state.json").unlink(missing_ok=True)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"{' '.join(cmd)}: no answer within {COMMAND_TIMEOUT_S:g} s") from e
    if check and done.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done


def check() -> tuple[bool, str]:
    """Whether this machine can run the emulated cluster, and if not, why."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "the emulated cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return False, "the emulated cluster needs root (network namespaces, veth, tc)"
    missing = [b for b in ("ip", "tc") if shutil.which(b) is None]
    if missing:
        return False, f"missing {' and '.join(missing)} (Debian: apt-get install iproute2)"
    probe = f"{PREFIX}-probe"
    _run(["ip", "netns", "del", probe], check=False)
    if _run(["ip", "netns", "add", probe], check=False).returncode != 0:
        return (
            False,
            "cannot create a network namespace (kernel without CONFIG_NET_NS, or a container without it)",
        )
    try:
        steps = [
            ["ip", "-n", probe, "link", "add", "gsa", "type", "veth", "peer", "name", "gsb"],
            ["ip", "-n", probe, "link", "add", "gsbr", "type", "bridge"],
            ["tc", "-n", probe, "qdisc", "add", "dev", "gsa", "root", "handle", "1:", "htb", "default", "10"],
        ]
        for cmd in steps:
            r = _run(cmd, check=False)
            if r.returncode != 0:
                return False, f"{' '.join(cmd[3:])} failed: {r.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return True, "ok: root, network namespaces, veth, bridge and htb are available"


def _shape(ns: str, dev: str, rate: str) -> list[list[str]]:
    bytes_per_s = parse_rate(rate, "--rate", tc_units=True)
    burst = max(int(bytes_per_s / 1000), 32768)  # about 1 ms of traffic, at least 32 KiB
    return [
        ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
        [
            "tc",
            "-n",
            ns,
            "class",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "classid",
            "1:10",
            "htb",
            "rate",
            rate,
            "ceil",
            rate,
            "burst",
            str(burst),
            "cburst",
            str(burst),
            "quantum",
            "60000",
        ],
    ]


def _plug_in(ns: str, veth: str, port: str, address: str, rate: str) -> list[list[str]]:
    """Namespace ``ns`` with eth0 at ``address``, cabled to the switch's ``port`` at ``rate``."""
    cmds = [
        ["ip", "netns", "add", ns],
        ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
        ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_congestion_control=reno"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
        ["ip", "link", "add", veth, "netns", ns, "type", "veth", "peer", "name", port, "netns", SWITCH],
        ["ip", "-n", ns, "link", "set", veth, "name", "eth0"],
        ["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", "eth0"],
        ["ip", "-n", ns, "link", "set", "eth0", "up"],
        ["ip", "-n", SWITCH, "link", "set", port, "master", BRIDGE],
        ["ip", "-n", SWITCH, "link", "set", port, "up"],
    ]
    if rate != "none":
        cmds += _shape(ns, "eth0", rate) + _shape(SWITCH, port, rate)
    return cmds


def up_commands(nodes: int, rate: str, storage_rate: str | None = None) -> list[list[str]]:
    """Every command :func:`up` runs, in order (``rate`` ``none``: unshaped cables). With
    ``storage_rate`` (a rate or ``none``) the storage node ``gs-st`` gets a cable of that speed."""
    check_rate(rate, "--rate")
    if storage_rate is not None:
        check_rate(storage_rate, "--storage-link")
    cmds = [
        ["ip", "netns", "add", SWITCH],
        ["ip", "-n", SWITCH, "link", "set", "lo", "up"],
        ["ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0"],
        ["ip", "-n", SWITCH, "link", "set", BRIDGE, "up"],
    ]
    for i in range(nodes):
        cmds += _plug_in(node_name(i), f"{PREFIX}n{i}e", f"{PREFIX}p{i}", node_address(i), rate)
    if storage_rate is not None:
        cmds += _plug_in(STORAGE, f"{PREFIX}ste", f"{PREFIX}pst", STORAGE_ADDRESS, storage_rate)
    return cmds


def up(nodes: int, rate: str, storage_rate: str | None = None) -> ClusterState:
    """Create the cluster, with the storage node when ``storage_rate`` is given (a rate or
    ``none``); ``ClusterError`` with the reason if it cannot, and then nothing is left behind."""
    if not isinstance(nodes, int) or not 1 <= nodes <= 64:
        raise ValueError(f"--nodes must be an integer from 1 to 64, got {nodes!r}")
    check_rate(rate, "--rate")
    if storage_rate is not None:
        check_rate(storage_rate, "--storage-link")
    ok, why = check()
    if not ok:
        raise ClusterError(why)
    if ClusterState.load() is not None or _exists(SWITCH) or _exists(STORAGE):
        raise ClusterError("an emulated cluster is already up; run 'gradsync cluster down' first")
    state = ClusterState(nodes, rate, storage_rate)
    state.save()
    try:
        for cmd in up_commands(nodes, rate, storage_rate):
            _run(cmd)
        _wait_reachable(nodes, storage=storage_rate is not None)
    except BaseException:
        down()
        raise
    return state


def _exists(ns: str) -> bool:
    return ns in _run(["ip", "netns", "list"], check=False).stdout.split()


def _wait_reachable(nodes: int, deadline_s: float = 10.0, storage: bool = False) -> None:
    """Every node reaches node 0, and node 0 the storage node if there is one (a bounded wait:
    ``ClusterError`` after ``deadline_s`` per pair)."""
    pairs = [(node_name(i), f"node {i}", node_address(0), "node 0") for i in range(1, nodes)]
    if storage:
        pairs.append((node_name(0), "node 0", STORAGE_ADDRESS, "the storage node"))
    for ns, who, address, whom in pairs:
        end = time.monotonic() + deadline_s
        while True:
            # a TCP connection to a closed port: "refused" means the packet got there and back
            probe = f"timeout 1 bash -c '</dev/tcp/{address}/9'"
            r = _run(["ip", "netns", "exec", ns, "bash", "-c", f"{probe} 2>&1"], check=False)
            if "refused" in r.stdout or r.returncode == 0:
                break
            if time.monotonic() > end:
                raise ClusterError(f"{who} cannot reach {whom} ({address}) after {deadline_s:g} s")
            time.sleep(0.1)


def down() -> int:
    """Remove the cluster; returns how many namespaces were removed. Safe to call twice."""
    state = ClusterState.load()
    listed = _run(["ip", "netns", "list"], check=False).stdout.split() if shutil.which("ip") else []
    ours = [n for n in listed if re.fullmatch(rf"{PREFIX}-(n\d+|sw|st)", n)]
    if state is not None:
        ours = sorted(set(ours) | {node_name(i) for i in range(state.nodes)} & set(listed))
    for ns in ours:
        _run(["ip", "netns", "del", ns], check=False)  # deleting a namespace deletes its veth end
    ClusterState.clear()
    return len(ours)


def status() -> str:
    state = ClusterState.load()
    if state is None:
        return "no emulated cluster is up"
    lines = [f"{state.nodes} nodes, cables at {state.rate}"]
    if state.storage_rate is not None:
        lines[0] += f"; storage node, cable at {state.storage_rate}"
    members = [(node_name(i), node_address(i)) for i in range(state.nodes)]
    if state.storage_rate is not None:
        members.append((STORAGE, STORAGE_ADDRESS))
    for ns, address in members:
        r = _run(["ip", "-n", ns, "-s", "link", "show", "eth0"], check=False)
        tx = re.search(r"TX:.*\n\s+(\d+)", r.stdout)
        lines.append(f"  {ns} {address}: {tx.group(1) if tx else '?'} bytes sent")
    return "\n".join(lines)
