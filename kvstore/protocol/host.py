"""Which machine a process is on: the test that decides whether shared memory between two processes works."""

from __future__ import annotations

import socket
from pathlib import Path


def host_id() -> str:
    """Hostname + kernel boot id: equal values mean the same machine, so shared memory is reachable."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "noboot"
    return f"{socket.gethostname()}/{boot}"
