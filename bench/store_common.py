"""Shared plumbing for the store benchmark: timing, verification, payloads, child processes, results.

Every number the store bench reports goes through :func:`time_reps`, so all methods share one rule: a few
warm-ups, then timed reps, the median, and a verification of every rep *outside* the timed window. A rep
whose data does not verify raises :class:`VerifyError` and the whole row is dropped (an unverified number
is never printed). Payloads are stamped with the rep index at both ends so stale data from an earlier rep
cannot pass verification.

This module is imported by the bench sections (``store_baselines``, ``store_ours``, ``store_ours_master``); it
must stay free of project imports so it also loads under ``python bench/store_bench.py`` from a bare checkout.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MB = 1 << 20
GB = 1e9  # GB/s = 1e9 B/s, as in overview §5
RESULT_MARK = "@@STORE_BENCH_RESULT "  # children print noisy logs (UCX writes to stdout); this marks our line
HOST = "127.0.0.1"

# Timed reps per object size (MB) without --reps; larger objects need fewer reps for a stable median.
DEFAULT_REPS = {1: 30, 4: 20, 16: 10, 64: 6}
QUICK_REPS = 3
DEFAULT_WARMUP = 3
QUICK_WARMUP = 1


class VerifyError(RuntimeError):
    """Data read back (or written) did not match what was sent: the measurement is discarded."""


class SectionTimeout(TimeoutError):
    """A bench section ran past its own deadline (raised from SIGALRM inside the child)."""


@dataclass
class Plan:
    """What to measure: object sizes, reps per size and warm-ups; the same plan is handed to every section."""

    sizes_mb: list[int]
    reps: dict[int, int]
    warmup: int
    quick: bool = False
    objects: int = 1_000_000  # objects indexed for the master-memory test

    def to_json(self) -> dict[str, Any]:
        return {
            "sizes_mb": self.sizes_mb,
            "reps": {str(k): v for k, v in self.reps.items()},
            "warmup": self.warmup,
            "quick": self.quick,
            "objects": self.objects,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        return cls(
            sizes_mb=[int(s) for s in d["sizes_mb"]],
            reps={int(k): int(v) for k, v in d["reps"].items()},
            warmup=int(d["warmup"]),
            quick=bool(d.get("quick", False)),
            objects=int(d.get("objects", 1_000_000)),
        )

    def reps_for(self, size_mb: int) -> int:
        return self.reps.get(size_mb, max(3, 64 // max(size_mb, 1)))


@dataclass
class Row:
    """One method's put/get throughput per object size (GB/s); ``None`` = not measured at that size."""

    id: str  # short stable name the summary's ratios look rows up by ("tcp", "redis", ...)
    method: str  # what the table prints
    put: dict[int, float | None] = field(default_factory=dict)
    get: dict[int, float | None] = field(default_factory=dict)
    note: str = ""
    # op -> size -> [lowest, highest] round median, when several rounds were merged: how much to trust a cell
    spread: dict[str, dict[int, list[float]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "method": self.method,
            "note": self.note,
            "put_gbps": {str(k): _round(v) for k, v in self.put.items()},
            "get_gbps": {str(k): _round(v) for k, v in self.get.items()},
        }
        if self.spread:
            out["round_range_gbps"] = {
                op: {str(k): [_round(x) for x in v] for k, v in cells.items()}
                for op, cells in self.spread.items()
            }
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Row:
        return cls(
            id=d["id"],
            method=d["method"],
            note=d.get("note", ""),
            put={int(k): v for k, v in d.get("put_gbps", {}).items()},
            get={int(k): v for k, v in d.get("get_gbps", {}).items()},
        )


def _round(v: float | None) -> float | None:
    return None if v is None else round(float(v), 3)


def time_reps(
    op: Callable[[int], object],
    verify: Callable[[int], None],
    warmup: int,
    reps: int,
    prepare: Callable[[int], None] | None = None,
) -> float:
    """Median seconds of ``op(i)`` over ``reps`` timed calls after ``warmup`` untimed ones.

    ``prepare(i)`` runs untimed before each call (e.g. clear the destination so a stale buffer cannot pass)
    and ``verify(i)`` untimed after it; rep indices continue from the warm-ups so every call sees fresh
    keys and fresh stamps.
    """
    times: list[float] = []
    for i in range(warmup + reps):
        if prepare is not None:
            prepare(i)
        t0 = time.perf_counter()
        op(i)
        dt = time.perf_counter() - t0
        verify(i)
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


async def atime_reps(
    op: Callable[[int], Awaitable[object]],
    verify: Callable[[int], object],
    warmup: int,
    reps: int,
    prepare: Callable[[int], None] | None = None,
) -> float:
    """:func:`time_reps` for coroutine ops (the store's async client), with the same untimed verification.

    ``verify`` may be sync or async; its await happens outside the timed window.
    """
    times: list[float] = []
    for i in range(warmup + reps):
        if prepare is not None:
            prepare(i)
        t0 = time.perf_counter()
        await op(i)
        dt = time.perf_counter() - t0
        res = verify(i)
        if inspect.isawaitable(res):
            await res
        if i >= warmup:
            times.append(dt)
    return statistics.median(times)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / GB


def make_payload(nbytes: int, seed: int = 7) -> np.ndarray:
    """Random bytes (incompressible, so no transport can cheat) as a uint8 array."""
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def stamp(buf: np.ndarray, i: int) -> None:
    """Write the rep index into the first and last 8 bytes, making each rep's payload unique."""
    tag = np.frombuffer(int(i + 1).to_bytes(8, "little"), dtype=np.uint8)
    buf[:8] = tag
    buf[-8:] = tag


def check_equal(got: object, want: np.ndarray, what: str) -> None:
    """Raise :class:`VerifyError` unless ``got`` (bytes-like or array) equals ``want`` byte for byte."""
    arr = got if isinstance(got, np.ndarray) else np.frombuffer(memoryview(got).cast("B"), dtype=np.uint8)  # type: ignore[arg-type]
    if arr.nbytes != want.nbytes or not np.array_equal(arr.reshape(-1).view(np.uint8), want):
        raise VerifyError(f"{what}: data mismatch ({arr.nbytes} B vs {want.nbytes} B expected)")


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1 (for servers that cannot bind port 0 and report it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_port(port: int, deadline_s: float, proc: subprocess.Popen[Any] | None = None) -> None:
    """Block until something accepts on ``port``; fail fast if ``proc`` died; TimeoutError at the deadline."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with rc={proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {HOST}:{port} after {deadline_s:.0f}s")


def read_json_line(
    proc: subprocess.Popen[str], deadline_s: float, want_key: str | None = None
) -> dict[str, Any]:
    """First JSON object line a child prints on stdout (its readiness line), skipping log noise.

    Reads with a deadline (select on the pipe) so a child that never becomes ready cannot hang the bench.
    """
    import select

    assert proc.stdout is not None
    end = time.monotonic() + deadline_s
    seen: list[str] = []
    while True:
        left = end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no readiness line after {deadline_s:.0f}s; stdout so far: {seen[-3:]}")
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
        if not ready:
            if proc.poll() is not None:
                raise RuntimeError(f"child exited rc={proc.returncode} before its JSON line: {seen[-3:]}")
            continue
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child closed stdout (rc={proc.poll()}) before its JSON line: {seen[-3:]}")
        seen.append(line.rstrip())
        text = line.strip()
        if text.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                obj = json.loads(text)
                if isinstance(obj, dict) and (want_key is None or want_key in obj):
                    return obj


def stop_process(proc: subprocess.Popen[Any] | None, grace_s: float = 5.0) -> None:
    """Terminate one child we started (by its pid), escalating to SIGKILL after ``grace_s``."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)


@contextlib.contextmanager
def children() -> Iterator[list[subprocess.Popen[Any]]]:
    """Collect the servers a section starts and stop every one of them on the way out, whatever happened."""
    procs: list[subprocess.Popen[Any]] = []
    try:
        yield procs
    finally:
        for p in reversed(procs):
            stop_process(p)


@contextlib.contextmanager
def alarm(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`SectionTimeout` in the main thread after ``seconds`` (blocking Python calls included)."""

    def _fire(_sig: int, _frame: object) -> None:
        raise SectionTimeout(f"{what}: no result after {seconds:.0f}s")

    old = signal.signal(signal.SIGALRM, _fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def emit_result(obj: dict[str, Any]) -> None:
    """Print a section's result as the one marked line its parent parses (everything else is log)."""
    sys.stdout.write(RESULT_MARK + json.dumps(obj) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARK):
            return json.loads(line[len(RESULT_MARK) :])
    return None


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (VmRSS), without needing psutil in every venv."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def env_without(keys: Sequence[str]) -> dict[str, str]:
    env = dict(os.environ)
    for k in keys:
        env.pop(k, None)
    return env
