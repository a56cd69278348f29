"""An emulated cluster on one Linux machine: network namespaces as nodes, shaped cables.

Each node ``gs-n<i>`` is a network namespace with one interface ``eth0`` (10.78.0.<i+1>/24)
whose veth peer is plugged into a bridge inside a switch namespace ``gs-sw``. Both directions of
every node's cable are shaped with an htb class at the given rate, like a full-duplex NIC of
that speed. Processes of one node talk over that namespace's loopback, unshaped: the fast
intra-node link. Every node disables IPv6 (so gloo cannot pick a link-local address) and uses
TCP reno (the shaper's queue and reno give steady throughput; see the testbed notes).

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

PREFIX = "gs"
SUBNET = "10.78.0"
SWITCH = f"{PREFIX}-sw"
BRIDGE = f"{PREFIX}br0"
STATE_DIR = Path(os.environ.get("GRADSYNC_CLUSTER_STATE", "/tmp/gradsync-cluster"))
COMMAND_TIMEOUT_S = 20.0

_RATE = re.compile(r"^(\d+(?:\.\d+)?)(gbit|mbit|kbit)$")
_UNITS = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3}


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up or used here; the message says why."""


def parse_rate(rate: str) -> float:
    """``"100mbit"`` -> bits per second (``ValueError`` naming ``--rate`` for anything else)."""
    m = _RATE.match(rate.strip().lower()) if isinstance(rate, str) else None
    if not m or float(m.group(1)) <= 0:
        raise ValueError(
            f"--rate must be a positive number with gbit, mbit or kbit (e.g. 100mbit), got {rate!r}"
        )
    return float(m.group(1)) * _UNITS[m.group(2)]


def node_name(i: int) -> str:
    return f"{PREFIX}-n{i}"


def node_address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


@dataclass
class ClusterState:
    nodes: int
    rate: str

    @classmethod
    def load(cls) -> ClusterState | None:
        path = STATE_DIR / "state.json"
        if not path.is_file():
            return None
        data = json.loads(path.read_text())
        return cls(int(data["nodes"]), str(data["rate"]))

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
    bits = parse_rate(rate)
    burst = max(int(bits / 8000), 32768)  # about 1 ms of traffic, at least 32 KiB
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


def up_commands(nodes: int, rate: str) -> list[list[str]]:
    """Every command :func:`up` runs, in order (``rate`` ``none``: unshaped cables)."""
    cmds = [
        ["ip", "netns", "add", SWITCH],
        ["ip", "-n", SWITCH, "link", "set", "lo", "up"],
        ["ip", "-n", SWITCH, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0"],
        ["ip", "-n", SWITCH, "link", "set", BRIDGE, "up"],
    ]
    for i in range(nodes):
        ns, port = node_name(i), f"{PREFIX}p{i}"
        cmds += [
            ["ip", "netns", "add", ns],
            ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1"],
            ["ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_congestion_control=reno"],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            [
                "ip",
                "link",
                "add",
                f"{PREFIX}n{i}e",
                "netns",
                ns,
                "type",
                "veth",
                "peer",
                "name",
                port,
                "netns",
                SWITCH,
            ],
            ["ip", "-n", ns, "link", "set", f"{PREFIX}n{i}e", "name", "eth0"],
            ["ip", "-n", ns, "addr", "add", f"{node_address(i)}/24", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
            ["ip", "-n", SWITCH, "link", "set", port, "master", BRIDGE],
            ["ip", "-n", SWITCH, "link", "set", port, "up"],
        ]
        if rate != "none":
            cmds += _shape(ns, "eth0", rate) + _shape(SWITCH, port, rate)
    return cmds


def up(nodes: int, rate: str) -> ClusterState:
    """Create the cluster (``ClusterError`` with the reason if it cannot; nothing is left behind)."""
    if not isinstance(nodes, int) or not 1 <= nodes <= 64:
        raise ValueError(f"--nodes must be an integer from 1 to 64, got {nodes!r}")
    if rate != "none":
        parse_rate(rate)
    ok, why = check()
    if not ok:
        raise ClusterError(why)
    if ClusterState.load() is not None or _exists(SWITCH):
        raise ClusterError("an emulated cluster is already up; run 'gradsync cluster down' first")
    ClusterState(nodes, rate).save()
    try:
        for cmd in up_commands(nodes, rate):
            _run(cmd)
        _wait_reachable(nodes)
    except BaseException:
        down()
        raise
    return ClusterState(nodes, rate)


def _exists(ns: str) -> bool:
    return ns in _run(["ip", "netns", "list"], check=False).stdout.split()


def _wait_reachable(nodes: int, deadline_s: float = 10.0) -> None:
    """Every node reaches node 0 (a bounded wait: ``ClusterError`` after ``deadline_s``)."""
    for i in range(1, nodes):
        end = time.monotonic() + deadline_s
        while True:
            # a TCP connection to a closed port: "refused" means the packet got there and back
            probe = f"timeout 1 bash -c '</dev/tcp/{node_address(0)}/9'"
            r = _run(["ip", "netns", "exec", node_name(i), "bash", "-c", f"{probe} 2>&1"], check=False)
            if "refused" in r.stdout or r.returncode == 0:
                break
            if time.monotonic() > end:
                raise ClusterError(f"node {i} cannot reach node 0 ({node_address(0)}) after {deadline_s:g} s")
            time.sleep(0.1)


def down() -> int:
    """Remove the cluster; returns how many namespaces were removed. Safe to call twice."""
    state = ClusterState.load()
    listed = _run(["ip", "netns", "list"], check=False).stdout.split() if shutil.which("ip") else []
    ours = [n for n in listed if re.fullmatch(rf"{PREFIX}-(n\d+|sw)", n)]
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
    for i in range(state.nodes):
        r = _run(["ip", "-n", node_name(i), "-s", "link", "show", "eth0"], check=False)
        tx = re.search(r"TX:.*\n\s+(\d+)", r.stdout)
        lines.append(f"  {node_name(i)} {node_address(i)}: {tx.group(1) if tx else '?'} bytes sent")
    return "\n".join(lines)
