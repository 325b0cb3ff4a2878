"""Container health probe: ``healthcheck.py http URL`` | ``grpc HOST:PORT`` | ``master HOST:PORT`` | ``auto``
(exit 0 = healthy).

Why a script: the image has no grpc_health_probe/curl; this uses libraries kvpool already depends on, with a
3 s deadline. ``auto`` reads the role from the container's command line (``/proc/1/cmdline``): the gateway
is probed over HTTP (/health), the master by its wire's ``Describe`` call (its one listener; an HA standby
answers too; the cluster secret comes from the container's environment), every gRPC service through the
standard health service.
"""

from __future__ import annotations

import sys
from pathlib import Path

DEFAULT_PORTS = {"gateway": 8000, "master": 50051, "node": 50052, "prefill": 50061, "decode": 50071}
TIMEOUT_S = 3.0


def http_ok(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=TIMEOUT_S).status_code == 200
    except httpx.HTTPError:
        return False


def grpc_ok(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError as exc:
            return exc.code() == grpc.StatusCode.UNIMPLEMENTED  # serving, without a health service
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def master_ok(address: str) -> bool:
    from kvpool.kvstore.errors import StoreError
    from kvpool.kvstore.protocol.master_wire import call_blocking
    from kvpool.proto import master_pb2

    try:
        call_blocking(address, "Describe", master_pb2.DescribeRequest(), TIMEOUT_S)
    except StoreError:
        return False
    return True


def auto() -> bool:
    argv = Path("/proc/1/cmdline").read_bytes().decode(errors="replace").split("\0")
    role = next((r for r in DEFAULT_PORTS if r in argv), "gateway")
    port = DEFAULT_PORTS[role]
    if "--port" in argv:
        port = int(argv[argv.index("--port") + 1])
    # a service bound to one address (a storage node binds the name it advertises) is not on loopback
    host = argv[argv.index("--host") + 1] if "--host" in argv else "127.0.0.1"
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    if role == "gateway":
        return http_ok(f"http://{host}:{port}/health")
    if role == "master":
        return master_ok(f"{host}:{port}")
    return grpc_ok(f"{host}:{port}")


def main(argv: list[str]) -> int:
    if argv[:1] == ["http"] and len(argv) == 2:
        return 0 if http_ok(argv[1]) else 1
    if argv[:1] == ["grpc"] and len(argv) == 2:
        return 0 if grpc_ok(argv[1]) else 1
    if argv[:1] == ["master"] and len(argv) == 2:
        return 0 if master_ok(argv[1]) else 1
    if argv[:1] == ["auto"]:
        return 0 if auto() else 1
    print(__doc__.splitlines()[0], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
