"""The gateway's view of its prefill and decode workers: gRPC channels, load counters, health.

Why the gateway keeps its own load numbers: it is the only client of the workers, so the tokens it has
dispatched and not yet seen answered *are* each worker's queue — no extra RPC on the hot path. Health comes
from two sources: the standard gRPC health service, polled in the background under a deadline, and the
outcome of real calls (an UNAVAILABLE marks the worker down at once, so the next request routes around it
instead of waiting for the next poll).

Discovery: an address ``dns:HOST:PORT`` stands for every A/AAAA record of HOST (a Kubernetes headless
Service lists one per ready pod); it is re-resolved every ``DNS_REFRESH_S`` under a deadline, new pods become
workers and vanished ones are dropped once idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvpool.proto import decode_pb2_grpc, prefill_pb2_grpc
from kvpool.runtime import cluster_auth

log = logging.getLogger("kvpool.gateway")
MAX_MESSAGE_BYTES = 64 << 20
HEALTH_INTERVAL_S = 1.0
HEALTH_TIMEOUT_S = 1.0
DOWN_AFTER_FAILURE_S = 2.0  # a worker that refused a call is skipped this long unless health says otherwise
DNS_PREFIX = "dns:"
DNS_REFRESH_S = 5.0
DNS_TIMEOUT_S = 2.0  # deadline of one re-resolution of a dns: spec


@dataclass
class Worker:
    role: str  # "prefill" | "decode"
    address: str
    channel: grpc.aio.Channel
    stub: object
    health: health_pb2_grpc.HealthStub
    healthy: bool = True
    down_until: float = 0.0
    inflight: int = 0
    queued_tokens: int = 0  # prefill: uncached prompt tokens dispatched, not answered; decode: output budget
    served: int = 0
    failures: int = 0
    source: str = ""  # the dns: spec this worker was discovered from ("" = given explicitly)

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.down_until

    def mark_failed(self) -> None:
        self.failures += 1
        self.down_until = time.monotonic() + DOWN_AFTER_FAILURE_S

    def snapshot(self) -> dict:
        return {
            "address": self.address,
            "healthy": self.healthy and time.monotonic() >= self.down_until,
            "inflight": self.inflight,
            "queued_tokens": self.queued_tokens,
            "served": self.served,
            "failures": self.failures,
        }


def _worker(role: str, address: str, source: str = "") -> Worker:
    ch = _channel(address)
    stub = prefill_pb2_grpc.PrefillStub(ch) if role == "prefill" else decode_pb2_grpc.DecodeStub(ch)
    return Worker(role, address, ch, stub, health_pb2_grpc.HealthStub(ch), source=source)


def _channel(address: str) -> grpc.aio.Channel:
    return cluster_auth.aio_channel(
        address,
        [
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.enable_retries", 0),
        ],
    )


def resolve(host: str, port: int) -> asyncio.Future[list]:
    """``getaddrinfo`` in a daemon thread of its own, as an awaitable future.

    Why not ``loop.getaddrinfo``: that runs in asyncio's default executor, whose threads ``asyncio.run``
    joins at shutdown (Python 3.11 has no timeout there) and the interpreter joins at exit. ``wait_for``
    gives up on a hung resolver, but its thread stays blocked in the C library, so the gateway could not
    stop. A daemon thread per lookup is abandoned instead: nothing waits for it.
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[list] = loop.create_future()

    def settle(result: list | None, exc: BaseException | None) -> None:
        if fut.done():  # the caller gave up (timeout, cancellation)
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result or [])

    def work() -> None:
        try:
            result, exc = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM), None
        except OSError as err:
            result, exc = None, err
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
            loop.call_soon_threadsafe(settle, result, exc)

    threading.Thread(target=work, name=f"gateway-dns-{host}", daemon=True).start()
    return fut


@dataclass
class WorkerPool:
    """All workers of both roles; ``start`` launches the health poller, ``close`` stops it + channels."""

    prefill_addresses: list[str]
    decode_addresses: list[str]
    prefill: list[Worker] = field(default_factory=list)
    decode: list[Worker] = field(default_factory=list)
    _task: asyncio.Task | None = None

    def start(self) -> WorkerPool:
        for role, addresses in (("prefill", self.prefill_addresses), ("decode", self.decode_addresses)):
            for addr in addresses:
                if not addr.startswith(DNS_PREFIX):
                    self._group(role).append(_worker(role, addr))
        self._task = asyncio.get_running_loop().create_task(self._poll_health(), name="gateway-health")
        return self

    def _group(self, role: str) -> list[Worker]:
        return self.prefill if role == "prefill" else self.decode

    async def refresh_dns(self) -> None:
        """Re-resolve every ``dns:HOST:PORT`` spec; add new addresses, drop idle vanished ones."""
        for role, addresses in (("prefill", self.prefill_addresses), ("decode", self.decode_addresses)):
            for spec in (a for a in addresses if a.startswith(DNS_PREFIX)):
                host, _, port = spec.removeprefix(DNS_PREFIX).rpartition(":")
                try:
                    infos = await asyncio.wait_for(resolve(host, int(port)), DNS_TIMEOUT_S)
                except (OSError, TimeoutError, ValueError) as exc:
                    log.warning("cannot resolve %s: %s", spec, exc)
                    continue
                found = {f"[{i[4][0]}]:{port}" if ":" in i[4][0] else f"{i[4][0]}:{port}" for i in infos}
                group = self._group(role)
                known = {w.address for w in group if w.source == spec}
                group.extend(_worker(role, addr, spec) for addr in sorted(found - known))
                for w in [
                    w for w in group if w.source == spec and w.address not in found and w.inflight == 0
                ]:
                    group.remove(w)
                    await w.channel.close()

    def workers(self) -> list[Worker]:
        return [*self.prefill, *self.decode]

    def available(self, role: str) -> list[Worker]:
        now = time.monotonic()
        return [w for w in (self.prefill if role == "prefill" else self.decode) if w.available(now)]

    async def check(self, w: Worker) -> bool:
        try:
            reply = await w.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S)
            ok = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            ok = False
        if ok != w.healthy:
            log.warning("%s worker %s is now %s", w.role, w.address, "healthy" if ok else "DOWN")
        w.healthy = ok
        if ok and w.down_until and w.inflight == 0:
            w.down_until = 0.0
        return ok

    async def _poll_health(self) -> None:
        next_dns = 0.0
        while True:
            try:
                if time.monotonic() >= next_dns:
                    await self.refresh_dns()
                    next_dns = time.monotonic() + DNS_REFRESH_S
                await asyncio.gather(*(self.check(w) for w in self.workers()), return_exceptions=True)
            except Exception:  # the poller must outlive any one bad round
                log.exception("worker health round failed")
            await asyncio.sleep(HEALTH_INTERVAL_S)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for w in self.workers():
            await w.channel.close()
