"""Which machine a process is on: the test that decides whether shared memory between two processes works."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def host_id() -> str:
    """Hostname + kernel boot id + network namespace: equal values mean the same machine, so shared memory
    is reachable. The namespace is part of it because a namespace stands for a host (``kvpool up --netns``
    builds a multi-host cluster on one box): two processes in different namespaces must talk over the
    network, as they would across machines, never through /dev/shm."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "noboot"
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "nonetns"
    return f"{socket.gethostname()}/{boot}/{netns}"
