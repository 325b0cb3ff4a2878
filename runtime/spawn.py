"""The one way kvpool starts its own processes as children: ``kvpool up``, ``kvpool verify``'s local cluster,
the tests' harnesses and the benchmarks all call :func:`spawn` (or :func:`start` then :func:`wait_ready`).

Why it looks like this: every kvpool service binds ``--port 0`` and prints one JSON readiness line
(``kvpool.runtime.lifecycle``). The child's stdout and stderr go to one log file, never a pipe, so a chatty
child can never block on a full pipe and the log survives for post-mortems; the readiness line is read from
that file with a deadline. ``start`` without waiting lets a launcher start several children and then wait for
all of them (they boot in parallel). ``own_session`` puts the child in its own session and asks the kernel to
SIGTERM it when the launcher dies (Linux), so a killed ``kvpool up`` leaves no orphans.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

READY_TIMEOUT_S = 60.0
POLL_S = 0.02
PR_SET_PDEATHSIG = 1


C = TypeVar("C", bound="Child")


class LaunchError(RuntimeError):
    """A child exited or stayed silent past its readiness deadline (the tail of its log is in the message)."""


@dataclass
class Child:
    """A started child: its process, its log file, and its readiness record once it announced one."""

    name: str
    popen: subprocess.Popen
    log_path: Path
    ready: dict = field(default_factory=dict)
    _offset: int = 0

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def address(self) -> str:
        return f"{self.ready.get('host', '127.0.0.1')}:{self.ready['port']}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code."""
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                return self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        """SIGKILL now (also fault injection: a node dying mid-request); returns the exit code."""
        if self.alive():
            self.popen.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(10)
        return self.popen.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    stderr = log  # stdout and stderr share the log

    def log_tail(self, n: int = 3000) -> str:
        return self.log()[-n:]


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists and has not exited (one we may not signal counts as alive).
    A zombie, killed but not yet reaped by its parent (``kvpool up`` reaps its services on its next
    round), has exited: not alive, though signal 0 still finds it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # reaped since; without procfs (not Linux) signal 0 is all there is to know
        return not os.path.isdir("/proc/self")
    state = stat[stat.rfind(b")") + 2 :][:1]  # the field after "(comm) ", which may hold ")" itself
    return state != b"Z"


def _child_setup_fn() -> Callable[[], None]:
    """What runs in the child between fork and exec: own session, and SIGTERM when the launcher dies.

    Everything is resolved here, in the parent: the child must not import (another thread of the parent may
    have held the import lock at fork time). Linux only; elsewhere just the new session.
    """
    prctl = None
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(OSError, AttributeError):
            prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def setup() -> None:
        os.setsid()
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
            if os.getppid() != parent:  # the launcher died before prctl took effect
                os.kill(os.getpid(), signal.SIGTERM)

    return setup


def start(
    name: str,
    module_argv: Sequence[str],
    log_path: Path,
    *,
    own_session: bool = False,
    env: dict[str, str] | None = None,
    child_type: type[C] = Child,  # type: ignore[assignment]
    prefix: Sequence[str] = (),
    **fields: Any,
) -> C:
    """Start ``python -m <module_argv>`` with stdout+stderr appended to ``log_path``; does not wait.
    ``child_type`` (a ``Child`` subclass) and its extra ``fields`` let a launcher keep its own view of it.
    ``prefix`` runs it through a wrapper that execs it in place (``ip netns exec NS``): same pid, so the
    death signal and the launcher's kill still reach the service itself."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", "UCX_WARN_UNUSED_ENV_VARS": "n", **(env or {})}
    with log_path.open("ab") as out:
        offset = out.tell()
        popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", *module_argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=child_env,
            preexec_fn=_child_setup_fn() if own_session else None,
        )
    return child_type(name, popen, log_path, _offset=offset, **fields)


def wait_ready(child: Child, timeout_s: float = READY_TIMEOUT_S) -> dict:
    """The child's ``{"ready": true, ...}`` record; ``LaunchError`` if it exits or the deadline passes first
    (the child is killed then, so a failed launch leaves nothing running)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with child.log_path.open("rb") as f:
            f.seek(child._offset)
            data = f.read()
        *lines, _partial = data.split(b"\n")
        for line in lines:
            child._offset += len(line) + 1
            if line.startswith(b"{"):
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and record.get("ready"):
                        child.ready = record
                        return record
        if not child.alive():
            raise LaunchError(f"{child.name} exited (rc={child.popen.returncode}):\n{child.log_tail()}")
        if time.monotonic() >= deadline:
            child.kill()
            raise LaunchError(f"{child.name} not ready within {timeout_s:.0f}s:\n{child.log_tail()}")
        time.sleep(POLL_S)


def spawn(
    name: str,
    module_argv: Sequence[str],
    log_dir: Path,
    timeout_s: float = READY_TIMEOUT_S,
    *,
    own_session: bool = False,
    env: dict[str, str] | None = None,
    child_type: type[C] = Child,  # type: ignore[assignment]
) -> C:
    """Start a child (log ``<log_dir>/<name>-<ns>.log``) and wait for its readiness line."""
    log_path = log_dir / f"{name}-{time.monotonic_ns()}.log"
    child = start(name, module_argv, log_path, own_session=own_session, env=env, child_type=child_type)
    wait_ready(child, timeout_s)
    return child
