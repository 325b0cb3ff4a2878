"""``kvpool chaos``: faults on the links of a ``kvpool up --netns`` cluster, for tests and for users.

    kvpool chaos partition node-0          # node-0's link drops every packet
    kvpool chaos loss node-0 5%            # 5 % random loss each way
    kvpool chaos delay node-0 50ms         # +50 ms each way (needs a relay: up --link "delay ...")
    kvpool chaos freeze node-0             # SIGSTOP: the link stays up, the process answers nothing
    kvpool chaos heal [node-0]             # back to the --link baseline (no service = everything)

Everything it needs is in ``state.json`` (``--state``; default the current run): each service's namespace
and pid, the link baseline, and each relay's control file. Errors are one line and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

from kvpool.launch.config import runs_root
from kvpool.runtime import netfaults
from kvpool.runtime.netns import Host, LinkSpec, NetnsError, Topology, parse_duration_ms, parse_percent


class ChaosError(RuntimeError):
    """The state file names no such service, the cluster has no namespaces, or a rule failed."""


class ChaosTarget:
    """The faultable parts of one running cluster, read from its state.json."""

    def __init__(self, state_path: Path) -> None:
        try:
            self.state = json.loads(state_path.read_text())
        except (OSError, ValueError) as exc:
            raise ChaosError(f"cannot read state file {state_path}: {exc}") from exc
        netns = self.state.get("netns")
        if not netns:
            raise ChaosError(
                f"{state_path}: this cluster was not started with --netns; links cannot be faulted"
            )
        self.hosts = Topology.from_dict(netns["topology"]).hosts
        self.link = LinkSpec(**netns["link"])
        control = netns.get("delay_control")
        self.delay_control = Path(control) if control else None
        self.pids = {s["name"]: int(s["pid"]) for s in self.state.get("services", [])}

    def host(self, service: str) -> Host:
        if service not in self.hosts:
            names = ", ".join(sorted(self.hosts))
            raise ChaosError(f"no service {service!r} with its own namespace (have: {names})")
        return self.hosts[service]

    def partition(self, service: str) -> None:
        netfaults.partition(self.host(service))

    def loss(self, service: str, percent: float) -> None:
        netfaults.loss(self.host(service), percent)

    def delay(self, service: str, delay_ms: float, jitter_ms: float = 0.0) -> None:
        host = self.host(service)
        if self.delay_control is None:
            raise ChaosError(
                'delay needs the relay that `kvpool up --netns --link "delay ..."` starts; '
                "this cluster has none"
            )
        netfaults.write_delay(self.delay_control, host.ip, delay_ms, jitter_ms)

    def send_signal(self, service: str, sig: signal.Signals) -> None:
        if service not in self.pids:
            raise ChaosError(f"no service {service!r} (have: {', '.join(sorted(self.pids))})")
        try:
            os.kill(self.pids[service], sig)
        except ProcessLookupError as exc:
            raise ChaosError(f"{service} (pid {self.pids[service]}) is not running") from exc

    def heal(self, service: str | None = None) -> None:
        """Partitions and loss off, delay back to the baseline, frozen processes resumed."""
        for name in [service] if service else sorted(self.hosts):
            host = self.host(name)
            netfaults.heal(host, self.link.loss_pct)
            if self.delay_control is not None:
                netfaults.write_delay(self.delay_control, host.ip, self.link.delay_ms, self.link.jitter_ms)
            if name in self.pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pids[name], signal.SIGCONT)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "chaos",
        help="faults on a --netns cluster's links: partition, loss, delay, freeze, heal",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("action", choices=("partition", "loss", "delay", "freeze", "heal"))
    p.add_argument("service", nargs="?", default=None, help="e.g. node-0, master, decode-0")
    p.add_argument("amount", nargs="?", default=None, help="loss: percent (5%%); delay: duration (50ms)")
    p.add_argument("--jitter", default="0ms", help="delay: ± this much per chunk (e.g. 5ms)")
    p.add_argument("--state", type=Path, default=None, help="the cluster's state.json (default: current run)")
    p.set_defaults(func=run_chaos)


def apply(args: argparse.Namespace) -> str:
    target = ChaosTarget(args.state or runs_root() / "current.json")
    if args.action == "heal":
        target.heal(args.service)
        return f"healed {args.service or 'every link'}"
    if not args.service:
        raise ChaosError(f"{args.action} needs a service")
    if args.action in ("loss", "delay") and args.amount is None:
        raise ChaosError(f"{args.action} needs an amount (loss: 5%; delay: 50ms)")
    try:
        if args.action == "partition":
            target.partition(args.service)
        elif args.action == "loss":
            target.loss(args.service, parse_percent(args.amount))
        elif args.action == "delay":
            target.delay(args.service, parse_duration_ms(args.amount), parse_duration_ms(args.jitter))
        else:
            target.send_signal(args.service, signal.SIGSTOP)
    except ValueError as exc:
        raise ChaosError(str(exc)) from exc
    return f"{args.action} {args.service} {args.amount or ''}".rstrip()


def run_chaos(args: argparse.Namespace) -> int:
    try:
        print(f"kvpool chaos: {apply(args)}")
    except (ChaosError, NetnsError) as exc:
        print(f"kvpool chaos: {exc}", file=sys.stderr)
        return 2
    return 0
