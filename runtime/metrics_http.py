"""The one ``GET /metrics`` server of every kvpool process (master, storage node, workers).

A tiny asyncio HTTP server on the process's own event loop: the body is rendered at scrape time on the loop
that mutates the state, so every scrape is a consistent snapshot and no lock is needed. ``render`` returns
the Prometheus text exposition (``prometheus_client.generate_latest`` of the process's own registry, or the
master's renderer of its Stats). No ``_created`` series: they double the series count and nothing queries
them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest

log = logging.getLogger(__name__)
disable_created_metrics()
READ_TIMEOUT_S = 5.0
CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


class MetricsHttpServer:
    """``GET /metrics`` -> ``render()``; anything else 404. ``port`` 0 = any free port."""

    def __init__(self, render: CollectorRegistry | Callable[[], bytes], host: str, port: int) -> None:
        if isinstance(render, CollectorRegistry):
            registry = render
            self.registry: CollectorRegistry | None = registry
            self._render: Callable[[], bytes] = lambda: generate_latest(registry)
        else:
            self.registry, self._render = None, render
        self.host = host
        self.requested_port = port
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._handle, self.host, self.requested_port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._server.wait_closed(), READ_TIMEOUT_S)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            parts = head.split(b" ", 2)
            if len(parts) >= 2 and parts[0] == b"GET" and parts[1].split(b"?")[0] == b"/metrics":
                body, status, ctype = self._render(), b"200 OK", CONTENT_TYPE
            else:
                body, status, ctype = b"not found: try /metrics\n", b"404 Not Found", b"text/plain"
            writer.write(
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: "
                + ctype
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT_S)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError) as exc:
            log.debug("metrics request dropped: %s", exc)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), READ_TIMEOUT_S)
