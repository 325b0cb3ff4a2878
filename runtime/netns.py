"""A multi-host topology on one Linux box: every "host" is a network namespace with its own IP and stack,
joined to a bridge by a veth pair; the root namespace reaches all of them through the bridge's address.

Why namespaces: on loopback a transport can take shortcuts (shared memory, no loss, no delay) that a real
cluster never offers, and a "dead node" is only ever a SIGKILL. In a namespace a service has its own
``eth0``, its own routing table and its own iptables, so links can be shaped and cut one by one.

Names carry the launcher's pid (``kvp<pid>-<host>`` namespaces, ``kvb<pid>`` bridge, ``kvv<pid>n<i>`` veths),
so ``sweep_stale`` can remove whatever a crashed launcher left behind: any of ours whose pid is dead.
Everything here shells out to ``ip`` / ``tc`` / ``iptables`` (root only); a failing command raises
``NetnsError`` with its stderr.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import asdict, dataclass, field

from kvpool.runtime.spawn import pid_alive

NS_PREFIX = "kvp"
BRIDGE_PREFIX = "kvb"
VETH_PREFIX = "kvv"
NS_DEV = "eth0"
SUBNET_BASE = "10.213"  # 10.213.<k>.0/24, k picked free at creation


class NetnsError(RuntimeError):
    """A namespace could not be created, shaped or torn down (the failing command and its stderr)."""


def tool_path(name: str) -> str:
    """Full path of a system tool: ``PATH`` first, then the sbin directories a non-login root shell (CI,
    sudo with a reset PATH) may lack."""
    found = shutil.which(name)
    if found:
        return found
    for folder in ("/usr/sbin", "/sbin", "/usr/bin", "/bin"):
        candidate = os.path.join(folder, name)
        if os.access(candidate, os.X_OK):
            return candidate
    return name


def run(argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc``/``iptables`` command; ``NetnsError`` with its stderr when it fails."""
    argv = [tool_path(argv[0]), *argv[1:]]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError as exc:
        raise NetnsError(f"`{argv[0]}` is not installed (scripts/sysdeps.sh installs it)") from exc
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def in_ns(netns: str, argv: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run(["ip", "netns", "exec", netns, tool_path(argv[0]), *argv[1:]], check=check)


def check_can_create() -> None:
    """``NetnsError`` saying why namespaces cannot be built here (not root, no ``ip``/``iptables``)."""
    if os.geteuid() != 0:
        raise NetnsError("network namespaces need root (run as root, or without --netns)")
    for tool in ("ip", "tc", "iptables"):
        if not os.path.isabs(tool_path(tool)):
            raise NetnsError(f"`{tool}` is not installed (scripts/sysdeps.sh installs it)")


def sweep_stale() -> list[str]:
    """Delete namespaces, bridges and veths of ours whose launcher pid is gone; returns what was removed."""
    removed: list[str] = []
    listing = run(["ip", "netns", "list"], check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{NS_PREFIX}(\d+)-.+", name)
        if m and not pid_alive(int(m.group(1))):
            run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    links = run(["ip", "-o", "link", "show"], check=False).stdout
    for m in re.finditer(rf"^\d+: ((?:{BRIDGE_PREFIX}|{VETH_PREFIX})(\d+)\w*)[@:]", links, re.M):
        if not pid_alive(int(m.group(2))):
            run(["ip", "link", "del", m.group(1)], check=False)
            removed.append(m.group(1))
    rules = run(["iptables", "-S", "FORWARD"], check=False).stdout
    for m in re.finditer(rf"^-A FORWARD -i ({BRIDGE_PREFIX}(\d+)) -o \1 -j ACCEPT$", rules, re.M):
        if not pid_alive(int(m.group(2))):
            run(["iptables", "-D", "FORWARD", *_bridge_rule(m.group(1))], check=False)
    return removed


@dataclass(slots=True)
class LinkSpec:
    """How one host's link to the bridge behaves: ``"delay 200us jitter 50us rate 10gbit loss 1%"``.

    ``rate`` is enforced by a tbf qdisc on both ends of the veth, ``loss`` by iptables' random ``statistic``
    match inside the namespace, ``delay``/``jitter`` by the host's TCP relay (``kvpool.runtime.netrelay``):
    this kernel has no netem.
    """

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    rate_bps: float = 0.0
    loss_pct: float = 0.0

    @staticmethod
    def parse(text: str) -> LinkSpec:
        words = text.split()
        if len(words) % 2:
            raise ValueError(f"link spec {text!r}: expected 'key value' pairs (delay, jitter, rate, loss)")
        spec = LinkSpec()
        for key, value in zip(words[::2], words[1::2], strict=True):
            if key in ("delay", "jitter"):
                setattr(spec, f"{key}_ms", parse_duration_ms(value))
            elif key == "rate":
                spec.rate_bps = parse_rate_bps(value)
            elif key == "loss":
                spec.loss_pct = parse_percent(value)
            else:
                raise ValueError(f"link spec {text!r}: unknown key {key!r} (delay, jitter, rate, loss)")
        return spec

    @property
    def needs_relay(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0


def parse_duration_ms(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)(us|ms|s)", text.strip())
    if not m:
        raise ValueError(f"duration {text!r}: expected a number with us, ms or s (e.g. 200us, 50ms)")
    return float(m.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]


def parse_rate_bps(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)([kmg]?)bit", text.strip().lower())
    if not m:
        raise ValueError(f"rate {text!r}: expected e.g. 10gbit, 800mbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def parse_percent(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)%?", text.strip())
    if not m or not 0 <= float(m.group(1)) <= 100:
        raise ValueError(f"percentage {text!r}: expected 0-100, e.g. 5%")
    return float(m.group(1))


@dataclass(slots=True)
class Host:
    """One namespace: its name, its IP on the bridge, and the host-side end of its veth."""

    name: str
    netns: str
    ip: str
    veth: str

    def exec_prefix(self) -> list[str]:
        return [tool_path("ip"), "netns", "exec", self.netns]


@dataclass
class Topology:
    """A bridge plus one namespace per host; ``to_dict``/``from_dict`` round-trip it through state.json."""

    tag: int
    subnet: str = ""
    bridge: str = ""
    gateway_ip: str = ""
    hosts: dict[str, Host] = field(default_factory=dict)

    @staticmethod
    def create(tag: int | None = None) -> Topology:
        """The bridge, up, with the root namespace's address on it (x.x.k.1)."""
        check_can_create()
        tag = os.getpid() if tag is None else tag
        topo = Topology(tag=tag, subnet=_free_subnet(tag), bridge=f"{BRIDGE_PREFIX}{tag}")
        topo.gateway_ip = topo.subnet.rsplit(".", 1)[0] + ".1"
        run(["ip", "link", "add", topo.bridge, "type", "bridge"])
        run(["ip", "addr", "add", f"{topo.gateway_ip}/24", "dev", topo.bridge])
        run(["ip", "link", "set", topo.bridge, "up"])
        run(["iptables", "-I", "FORWARD", *_bridge_rule(topo.bridge)])
        return topo

    def add_host(self, name: str) -> Host:
        """A namespace for ``name`` with ``eth0`` on the bridge and ``lo`` up."""
        index = len(self.hosts) + 2
        host = Host(
            name=name,
            netns=f"{NS_PREFIX}{self.tag}-{name}",
            ip=f"{self.subnet.rsplit('.', 1)[0]}.{index}",
            veth=f"{VETH_PREFIX}{self.tag}n{index}",
        )
        run(["ip", "netns", "add", host.netns])
        self.hosts[name] = host
        run(["ip", "link", "add", host.veth, "type", "veth", "peer", "name", NS_DEV, "netns", host.netns])
        run(["ip", "link", "set", host.veth, "master", self.bridge, "up"])
        in_ns(host.netns, ["ip", "addr", "add", f"{host.ip}/24", "dev", NS_DEV])
        in_ns(host.netns, ["ip", "link", "set", NS_DEV, "up"])
        in_ns(host.netns, ["ip", "link", "set", "lo", "up"])
        return host

    def shape_rate(self, host: Host, rate_bps: float) -> None:
        """tbf on both ends of the host's veth: what leaves the namespace and what enters it."""
        if rate_bps <= 0:
            return
        rate = f"{int(rate_bps)}bit"
        burst = str(max(int(rate_bps / 8 / 250), 256 << 10))  # one 4 ms tick of bytes, >= 256 KiB
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", "50ms"]
        run(["tc", "qdisc", "replace", "dev", host.veth, "root", *tbf])
        in_ns(host.netns, ["tc", "qdisc", "replace", "dev", NS_DEV, "root", *tbf])

    def destroy(self) -> None:
        """Delete every namespace (its veth end goes with it), then the bridge; never raises."""
        for host in self.hosts.values():
            run(["ip", "netns", "del", host.netns], check=False)
            run(["ip", "link", "del", host.veth], check=False)
        if self.bridge:
            run(["ip", "link", "del", self.bridge], check=False)
            run(["iptables", "-D", "FORWARD", *_bridge_rule(self.bridge)], check=False)

    def to_dict(self) -> dict:
        return {
            "tag": self.tag,
            "subnet": self.subnet,
            "bridge": self.bridge,
            "gateway_ip": self.gateway_ip,
            "hosts": {name: asdict(h) for name, h in self.hosts.items()},
        }

    @staticmethod
    def from_dict(data: dict) -> Topology:
        hosts = {name: Host(**h) for name, h in data.get("hosts", {}).items()}
        return Topology(data["tag"], data["subnet"], data["bridge"], data["gateway_ip"], hosts)


def _bridge_rule(bridge: str) -> list[str]:
    """Traffic between two of our hosts crosses the root namespace's FORWARD chain whenever br_netfilter is
    loaded, and Docker loads it and sets that chain's policy to DROP: without this rule, namespaces on a host
    that also runs Docker cannot reach each other."""
    return ["-i", bridge, "-o", bridge, "-j", "ACCEPT"]


def _free_subnet(tag: int) -> str:
    """A 10.213.k.0/24 that no route on this box uses yet (k derived from the tag, then probed)."""
    routes = run(["ip", "-4", "route", "show"], check=False).stdout
    for step in range(250):
        k = (tag + step) % 250 + 1
        subnet = f"{SUBNET_BASE}.{k}.0"
        if f"{SUBNET_BASE}.{k}." not in routes:
            return subnet
    raise NetnsError(f"no free {SUBNET_BASE}.k.0/24 subnet on this box")
