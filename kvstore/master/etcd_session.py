"""One etcd client over the members of a cluster, with a deadline on every call.

``aetcd`` talks to one member; a member that is down (or cut off from its quorum) must not stall the
master, so every call here runs under ``timeout_s`` and, on failure, is tried once on each other member
before :class:`EtcdUnavailableError` is raised. Writes and lease keep-alives need a quorum, so with most
members down they fail within the deadline too, which is exactly what the leadership loop needs to see.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aetcd
import grpc
from kvpool.kvstore.errors import StoreUnavailableError

log = logging.getLogger(__name__)
T = TypeVar("T")


class EtcdUnavailableError(StoreUnavailableError):
    """No etcd member answered within the deadline (down, partitioned, or without a quorum)."""


def parse_members(spec: str) -> list[tuple[str, int]]:
    """``"http://a:2379,b:2381"`` -> [("a", 2379), ("b", 2381)]; ValueError on a malformed entry."""
    members = []
    for raw in spec.split(","):
        entry = raw.strip().removeprefix("http://")
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd member {raw.strip()!r} is not HOST:PORT")
        members.append((host, int(port)))
    if not members:
        raise ValueError(f"no etcd member in {spec!r}")
    return members


class EtcdSession:
    """``await session.run(lambda client: client.get(key))``: the result, or ``EtcdUnavailableError``."""

    def __init__(self, members: str, timeout_s: float = 1.0) -> None:
        self.members = parse_members(members)
        self.timeout_s = timeout_s
        self._at = 0
        self._client: aetcd.Client | None = None

    @property
    def member(self) -> str:
        host, port = self.members[self._at]
        return f"{host}:{port}"

    async def run(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        last: BaseException | None = None
        for _ in range(len(self.members)):
            try:
                return await asyncio.wait_for(self._on_member(op), self.timeout_s)
            except (TimeoutError, aetcd.exceptions.ClientError, grpc.RpcError, OSError) as exc:
                last = exc
                log.debug("etcd member %s failed: %r", self.member, exc)
                await self._drop()
                self._at = (self._at + 1) % len(self.members)
        raise EtcdUnavailableError(f"no etcd member of {len(self.members)} answered: {last!r}")

    async def _on_member(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Connect if needed and run ``op``, both inside the caller's deadline."""
        return await op(await self._connected())

    async def _connected(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.members[self._at]
            self._client = aetcd.Client(host=host, port=port, timeout=self.timeout_s)
            await self._client.connect()
        return self._client

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), self.timeout_s)

    async def close(self) -> None:
        await self._drop()
