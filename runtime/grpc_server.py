"""The one gRPC server shape of every kvpool service: a grpc.aio server with its servicers and the standard
gRPC health service, bound to one port.

Why one: master, storage node and workers must all answer ``grpc.health.v1`` the same way (``kvpool up``,
``kvpool status`` and the gateway's worker checks rely on it): SERVING for ``""`` and every named service
once the port accepts calls, NOT_SERVING before a graceful stop. A bind failure is an ``OSError`` the
lifecycle (``kvpool.runtime.lifecycle``) turns into one stderr line and exit 1.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from kvpool.runtime import cluster_auth

AddServicer = Callable[[grpc.aio.Server], None]


class GrpcServer:
    """``services`` maps a gRPC service name to the function adding its servicer to a server."""

    def __init__(
        self, services: dict[str, AddServicer], host: str, port: int, max_message_bytes: int = 64 << 20
    ) -> None:
        self.services = services
        self.host = host
        self.requested_port = port
        self.max_message_bytes = max_message_bytes
        self.health = health.aio.HealthServicer()
        self.port = 0
        self._server: grpc.aio.Server | None = None

    async def start(self) -> int:
        key = cluster_auth.secret()  # with a cluster secret, every call but health checks must present it
        server = grpc.aio.server(
            interceptors=[cluster_auth.ServerAuth(key)] if key else None,
            options=[
                ("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ],
        )
        for add in self.services.values():
            add(server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        self.port = server.add_insecure_port(f"{self.host}:{self.requested_port}")
        if self.port == 0:
            raise OSError(f"cannot bind {self.host}:{self.requested_port}")
        await server.start()
        self._server = server
        for name in ("", *self.services):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        for name in ("", *self.services):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if self._server is not None:
            await self._server.stop(grace_s)

    async def wait(self) -> None:
        if self._server is not None:
            await self._server.wait_for_termination()
