"""Sweep points as Ray tasks (``--ray auto|ADDRESS``, the optional extra ``kvpool[ray]``): the same contract
as :func:`kvpool.workloads.parallel.run_points`, on a Ray cluster instead of local processes.

One task per point (a whole simulation, seconds each: Ray's own guidance is that tasks under ~10 ms do not
pay); the shared data (the trace, the spec, the offline plan) is put in Ray's object store **once** and
every task receives it by reference, unpickled once per worker process (``_shared``); results come back in
task order, so the rows equal the local pool's.
Connecting has a deadline: an address that does not answer is one ReplayError naming ``--ray``, not a hang.
So does the sweep: when no point finishes for ``max(--ray-stall-s, STALL_FACTOR x the slowest point so
far)`` (a frozen node keeps its task neither done nor failed; Ray fails the task of a dead one itself), the
sweep is one ReplayError; whatever ends it early (that, a failed point, an interrupt) cancels the points
still out.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from kvpool.workloads.errors import ReplayError

T = TypeVar("T")
R = TypeVar("R")

CONNECT_TIMEOUT_S = 30.0
# A sweep is stuck, not slow, when no point has finished for the longer of these: a floor (``--ray-stall-s``;
# a 1 M-request point takes minutes, a 10 M one tens of them), then a multiple of the slowest point seen
STALL_FLOOR_S = 3600.0
STALL_FACTOR = 4.0


def connect(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> Any:
    """``ray.init(address=...)`` within ``timeout_s`` (``auto``: the cluster this machine is part of), or a
    ReplayError naming ``--ray``. Returns the ``ray`` module."""
    try:
        import ray
    except ImportError:
        raise ReplayError("--ray needs Ray: pip install 'kvpool[ray]'") from None
    if ray.is_initialized():
        return ray
    box: dict[str, BaseException | None] = {"error": None}

    def init() -> None:
        try:
            ray.init(address=address, log_to_driver=False, include_dashboard=False)
        except BaseException as e:  # reported to the caller below
            box["error"] = e

    t = threading.Thread(target=init, name="ray-connect", daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        raise ReplayError(f"--ray {address}: no Ray cluster answered within {timeout_s:g} s")
    if box["error"] is not None:
        raise ReplayError(f"--ray {address}: cannot connect ({box['error']})") from None
    return ray


# Per worker process: the shared data of the sweep it serves, by object id (one sweep's at a time).
_SHARED: dict[str, Any] = {}


def _shared(box: list[Any]) -> Any:
    """The object ``box[0]`` refers to, unpickled once per worker process. Why in a box: Ray resolves a
    task's top-level object-ref arguments itself, unpickling them for every task (1.2-1.5 s for a
    100 k-request trace and its chain hashes, against 10 s points), and a worker runs many tasks."""
    key = box[0].hex()
    if key not in _SHARED:
        import ray

        _SHARED.clear()  # an earlier sweep's data goes before this one's arrives
        _SHARED[key] = ray.get(box[0])
    return _SHARED[key]


def _call(fn: Callable[[Any, T], R], box: list[Any], task: T) -> tuple[R, float]:
    shared = _shared(box)
    start = time.monotonic()
    return fn(shared, task), time.monotonic() - start


def run_points_ray(
    fn: Callable[[Any, T], R],
    shared: Any,
    tasks: Sequence[T],
    address: str,
    done: Callable[[int, R, float], None] | None = None,
    timeout_s: float = CONNECT_TIMEOUT_S,
    stall_floor_s: float = STALL_FLOOR_S,
) -> list[R]:
    """``[fn(shared, t) for t in tasks]`` as Ray tasks (one CPU each), ``shared`` put once in the object
    store; ``done(i, result, seconds)`` here as each finishes. ``fn`` must be importable by the workers.
    A sweep where no point finishes for ``max(stall_floor_s, STALL_FACTOR x the slowest so far)`` seconds
    is cancelled: a ReplayError, never a wait without end."""
    ray = connect(address, timeout_s)
    ref = ray.put(shared)
    remote = ray.remote(num_cpus=1)(_call)
    pending = {remote.remote(fn, [ref], t): i for i, t in enumerate(tasks)}
    results: list[Any] = [None] * len(tasks)
    slowest = 0.0
    try:
        while pending:
            stall_s = max(stall_floor_s, STALL_FACTOR * slowest)
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=stall_s)
            if not ready:
                raise ReplayError(
                    f"--ray: no sweep point finished within {stall_s:g} s; {len(pending)} of {len(tasks)} "
                    "still out were cancelled (a node that stopped answering? --ray-stall-s sets the wait)"
                )
            for r in ready:
                i = pending.pop(r)
                try:
                    results[i], seconds = ray.get(r, timeout=stall_s)  # done: only its transfer is left
                except ray.exceptions.GetTimeoutError:
                    raise ReplayError(
                        f"--ray: the result of a finished sweep point did not arrive within {stall_s:g} s"
                    ) from None
                slowest = max(slowest, seconds)
                if done is not None:
                    done(i, results[i], seconds)
    except BaseException:  # a stall, a failed point, an interrupt: what is still out is cancelled
        _cancel(ray, list(pending))
        raise
    return results


def _cancel(ray: Any, refs: list[Any]) -> None:
    """Cancel the tasks still out, each on its own: one that cannot be cancelled (its node is gone) does
    not keep the others running."""
    for r in refs:
        try:
            ray.cancel(r, force=True)
        except Exception:  # best effort: the sweep has failed either way
            continue
