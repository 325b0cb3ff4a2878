"""One service lifecycle for every kvpool process: start, announce readiness, serve until a signal, stop.

Why a readiness line: launchers (``kvpool up``, tests, benchmarks, deploy scripts) bind ``--port 0`` and need
the real ports; one JSON object on stdout, ``{"ready": true, ...}``, printed only once every listener accepts
calls, is race-free. ``kvpool.runtime.spawn`` is the reader of that line.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import Awaitable, Callable
from typing import Any

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def print_ready(fields: dict[str, Any]) -> None:
    """Announce readiness: one JSON line on stdout, ``ready`` first, flushed at once."""
    print(json.dumps({"ready": True, **fields}), flush=True)


async def wait_for_stop_signal() -> None:
    """Return on the first SIGTERM or SIGINT (installed on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


async def serve_until_signal(
    name: str,
    start: Callable[[], Awaitable[dict[str, Any]]],
    stop: Callable[[], Awaitable[object]],
) -> int:
    """``start()`` returns the readiness fields; a bind failure (``OSError``) is one stderr line and exit 1.
    Then print the readiness line, wait for SIGTERM/SIGINT, ``stop()`` and return 0."""
    try:
        fields = await start()
    except OSError as exc:
        print(f"kvpool {name}: {exc}", file=sys.stderr)
        await stop()
        return 1
    print_ready(fields)
    await wait_for_stop_signal()
    await stop()
    return 0
