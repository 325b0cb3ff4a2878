"""Where ``kvpool up`` puts each service: all on loopback (the default), or each in its own network
namespace with its own IP (``--netns``), its link shaped by ``--link``.

Why a separate object: the launcher only asks "where does service X run, and on which address does it
listen"; building namespaces, shaping links, starting delay relays and tearing it all down again is this
module's job, and ``kvpool chaos`` finds all of it again in ``state.json`` (``NetnsPlacement.state``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvpool.runtime import netfaults
from kvpool.runtime.netns import LinkSpec, NetnsError, Topology, check_can_create, sweep_stale
from kvpool.runtime.spawn import Child, LaunchError, start, wait_ready

RELAY_READY_S = 20.0


@dataclass(slots=True)
class Placed:
    """How to start one service: the exec prefix, the address to bind and advertise, and its namespace."""

    host: str = "127.0.0.1"
    prefix: list[str] = field(default_factory=list)
    netns: str | None = None


class LoopbackPlacement:
    """Every service on 127.0.0.1 in the launcher's own namespace."""

    def place(self, name: str) -> Placed:
        return Placed()

    def state(self) -> dict | None:
        return None

    def close(self) -> None:
        pass


class NetnsPlacement:
    """One namespace per service, on one bridge; ``close`` removes all of it (and stops the relays)."""

    def __init__(self, run_dir: Path, link: LinkSpec) -> None:
        check_can_create()
        self.run_dir = run_dir
        self.link = link
        self.swept = sweep_stale()  # what a crashed launcher left behind
        self.topology = Topology.create()
        self.relays: dict[str, Child] = {}

    def place(self, name: str) -> Placed:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            host = self.topology.add_host(name)
            netfaults.install_chains(host)
            self.topology.shape_rate(host, self.link.rate_bps)
            netfaults.loss(host, self.link.loss_pct)
            if self.link.needs_relay:
                netfaults.write_delay(self.control_file, host.ip, self.link.delay_ms, self.link.jitter_ms)
                self._start_relay(name)
        except NetnsError as exc:
            raise LaunchError(f"namespace for {name}: {exc}") from exc
        return Placed(host=host.ip, prefix=host.exec_prefix(), netns=host.netns)

    @property
    def control_file(self) -> Path:
        """Every link's delay, by IP: what all relays read and ``kvpool chaos delay`` writes."""
        return self.run_dir / "link-delays.json"

    def _start_relay(self, name: str) -> None:
        host = self.topology.hosts[name]
        relay = start(
            f"relay-{name}",
            ["kvpool.runtime.netrelay", "--control", str(self.control_file), "--self-ip", host.ip],
            self.run_dir / f"relay-{name}.log",
            own_session=True,
            prefix=host.exec_prefix(),
        )
        self.relays[name] = relay
        wait_ready(relay, RELAY_READY_S)
        netfaults.install_redirect(host, int(relay.ready["port"]))

    def state(self) -> dict:
        return {
            "topology": self.topology.to_dict(),
            "link": asdict(self.link),
            "swept": self.swept,
            "delay_control": str(self.control_file) if self.relays else None,
            "relays": {name: {"pid": r.pid, "port": r.ready.get("port")} for name, r in self.relays.items()},
        }

    def close(self) -> None:
        for relay in self.relays.values():
            with contextlib.suppress(OSError):
                relay.kill()
        self.topology.destroy()


def make_placement(run_dir: Path, netns: bool, link: str | None) -> LoopbackPlacement | NetnsPlacement:
    """``NetnsPlacement`` for ``--netns`` (``LaunchError`` saying why when this box cannot), else loopback."""
    if not netns:
        if link:
            raise LaunchError("--link shapes namespace links: it needs --netns")
        return LoopbackPlacement()
    try:
        spec = LinkSpec.parse(link or "")
    except ValueError as exc:
        raise LaunchError(str(exc)) from exc
    if os.geteuid() != 0:
        raise LaunchError("--netns needs root: network namespaces, veths and iptables are root-only")
    try:
        return NetnsPlacement(run_dir, spec)
    except NetnsError as exc:
        raise LaunchError(f"--netns: {exc}") from exc
