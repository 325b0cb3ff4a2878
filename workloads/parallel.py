"""Independent sweep points in a process pool: one task per point (a whole simulation, seconds each, so a
process pays), results in the order of the tasks, so a parallel sweep returns what the sequential one does.

Why processes, and why fork: a point is pure-Python replay (one core each, the GIL forbids threads); the
trace is handed to the workers by inheritance (fork copies the parent's memory), never pickled per task,
and a task is only its small parameters. Where fork is unavailable the points run here, one by one.
Progress stays one line per finished point, printed by the parent (``PointProgress``); the per-request
bars of a single simulation are not drawn by workers, whose lines would interleave.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_SHARED: Any = None  # what every task reads (the trace), set in the parent before the workers fork


def default_jobs() -> int:
    """The machine's cores (``os.cpu_count()``), at least 1."""
    return max(1, os.cpu_count() or 1)


def run_points(
    fn: Callable[[Any, T], R],
    shared: Any,
    tasks: Sequence[T],
    jobs: int | None = None,
    done: Callable[[int, R, float], None] | None = None,
) -> list[R]:
    """``[fn(shared, t) for t in tasks]``, on up to ``jobs`` processes (None: the machine's cores; 1: here,
    in order). ``fn`` must be a module-level function. ``done(i, result, seconds)`` is called in this
    process as each task finishes, in finishing order."""
    global _SHARED
    jobs = default_jobs() if jobs is None else jobs
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    workers = min(jobs, len(tasks))
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        out = []
        for i, t in enumerate(tasks):
            start = time.monotonic()
            out.append(fn(shared, t))
            if done is not None:
                done(i, out[-1], time.monotonic() - start)
        return out
    results: list[Any] = [None] * len(tasks)
    _SHARED = shared
    try:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
            futures = {pool.submit(_call, fn, t): i for i, t in enumerate(tasks)}
            for fut in as_completed(futures):
                i = futures[fut]
                results[i], seconds = fut.result()
                if done is not None:
                    done(i, results[i], seconds)
    finally:
        _SHARED = None
    return results


def _call(fn: Callable[[Any, T], R], task: T) -> tuple[R, float]:
    """In a worker: one task on the inherited shared data, with its own duration."""
    start = time.monotonic()
    return fn(_SHARED, task), time.monotonic() - start
