"""Faults on one namespace's link: partition, random loss, delay, and heal — what ``kvpool chaos`` applies.

Why iptables chains of our own: each namespace gets ``KVPOOL-IN`` (jumped to from INPUT on eth0) and
``KVPOOL-OUT`` (from OUTPUT on eth0). A partition is a DROP in both, loss is a ``statistic --mode random``
DROP in both; ``heal`` flushes the two chains and puts the link's baseline loss back. Nothing else in the
namespace is touched, so healing can never leave a stray rule behind. Delay is not a kernel rule here (no
netem on this kernel): it is the relays' (``kvpool.runtime.netrelay``), steered through one small JSON
control file per cluster, ``{ip: {"delay_ms": .., "jitter_ms": ..}}``, that every relay polls.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from kvpool.runtime.netns import NS_DEV, in_ns

CHAIN_IN = "KVPOOL-IN"
CHAIN_OUT = "KVPOOL-OUT"
RELAY_MARK = 0x4B56  # the relay's own connections carry this mark so its redirect rule skips them


class _Host(Protocol):
    netns: str


def install_chains(host: _Host) -> None:
    in_ns(host.netns, ["iptables", "-N", CHAIN_IN])
    in_ns(host.netns, ["iptables", "-N", CHAIN_OUT])
    in_ns(host.netns, ["iptables", "-A", "INPUT", "-i", NS_DEV, "-j", CHAIN_IN])
    in_ns(host.netns, ["iptables", "-A", "OUTPUT", "-o", NS_DEV, "-j", CHAIN_OUT])


def partition(host: _Host) -> None:
    """Every packet in or out of the host's eth0 is dropped: peers see silence, not a reset."""
    for chain in (CHAIN_IN, CHAIN_OUT):
        in_ns(host.netns, ["iptables", "-I", chain, "1", "-j", "DROP"])


def loss(host: _Host, percent: float) -> None:
    """Drop ``percent`` % of the packets in each direction, independently at random."""
    if percent <= 0:
        return
    rule = ["-m", "statistic", "--mode", "random", "--probability", f"{percent / 100:.6f}", "-j", "DROP"]
    for chain in (CHAIN_IN, CHAIN_OUT):
        in_ns(host.netns, ["iptables", "-A", chain, *rule])


def heal(host: _Host, baseline_loss_pct: float = 0.0) -> None:
    """Remove every partition and loss rule, then restore the link's baseline loss."""
    for chain in (CHAIN_IN, CHAIN_OUT):
        in_ns(host.netns, ["iptables", "-F", chain])
    loss(host, baseline_loss_pct)


def install_redirect(host: _Host, relay_port: int) -> None:
    """Send every TCP connection this host opens through eth0 to its relay (transparent: the relay reads
    the original destination with ``SO_ORIGINAL_DST``); the relay's own connections carry ``RELAY_MARK``.

    Only connections the host *opens* are redirected: the relay then connects from the host's own IP, so
    the far end sees the true peer address (UCX learns its peer's address from the socket: a relay on the
    accepting side would make every peer look like the node itself)."""
    in_ns(host.netns, ["iptables", "-t", "nat", "-A", "OUTPUT", "-o", NS_DEV, "-p", "tcp",
                       "-m", "mark", "!", "--mark", str(RELAY_MARK),
                       "-j", "REDIRECT", "--to-ports", str(relay_port)])  # fmt: skip


def write_delay(control: Path, ip: str, delay_ms: float, jitter_ms: float = 0.0) -> None:
    """Set the delay of the link of the host at ``ip``; relays pick it up within their poll (50 ms)."""
    delays = read_delays(control)
    delays[ip] = (delay_ms, jitter_ms)
    tmp = control.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({k: {"delay_ms": d, "jitter_ms": j} for k, (d, j) in delays.items()}))
    tmp.replace(control)


def read_delays(control: Path) -> dict[str, tuple[float, float]]:
    """``{ip: (delay_ms, jitter_ms)}`` of every link in the control file (empty when there is none)."""
    try:
        data = json.loads(control.read_text())
        return {ip: (float(v.get("delay_ms", 0.0)), float(v.get("jitter_ms", 0.0))) for ip, v in data.items()}
    except (OSError, ValueError, AttributeError):
        return {}
