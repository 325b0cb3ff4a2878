"""Authenticated internal traffic: one cluster secret, required by every internal listener once configured.

Why: anyone who can reach a storage node or the master could otherwise write an object under a popular
prefix hash. A checksum does not help against a writer who computes it, so such a write would poison every
tenant's answers. The secret comes from ``KVPOOL_CLUSTER_SECRET_FILE`` (a file, e.g. a mounted k8s Secret)
or ``KVPOOL_CLUSTER_SECRET`` (the value); ``kvpool up`` makes one per run. Unset = no auth (as before).

Two mechanisms, by channel:

* **gRPC** (master, storage node, prefill, decode): a per-call token in the ``x-kvpool-auth`` metadata,
  ``HMAC-SHA256(secret, "kvpool-grpc-v1")``. It never reveals the secret, costs one header per call and
  no round trip. It is a bearer token: on a network where sniffing is a threat, run gRPC over TLS. The
  standard health service stays open (it answers SERVING or not and changes nothing), so probes need no
  secret.
* **Raw connections** (master wire, node tcp, ucx): the client's first 56 bytes are a hello
  ``"KVA1" | unix time u64 | nonce 12 B | HMAC-SHA256(secret, time | nonce)``. The server checks the MAC,
  that the time is within ``HELLO_WINDOW_S`` and that the nonce was not seen in that window (no replay),
  before it reads a single frame. One message, no extra round trip, paid once per connection.

A peer without the secret is rejected: its call fails with UNAUTHENTICATED or its connection is closed, one
warning is logged per peer address, ``rejected`` counts it per listener, and nothing it sent is executed.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import grpc

log = logging.getLogger(__name__)

ENV_FILE = "KVPOOL_CLUSTER_SECRET_FILE"
ENV_VALUE = "KVPOOL_CLUSTER_SECRET"
METADATA_KEY = "x-kvpool-auth"
HELLO = struct.Struct("<4sQ12s32s")
HELLO_SIZE = HELLO.size  # 56
HELLO_MAGIC = b"KVA1"
HELLO_WINDOW_S = 120.0
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # answered without the secret: read-only liveness
MAX_LOGGED_PEERS = 1024

rejected: dict[str, int] = {}  # listener kind -> rejected peers/calls, for the services' metrics
_logged: OrderedDict[str, None] = OrderedDict()


class ClusterSecretError(ValueError):
    """The configured secret cannot be read or is too short."""


def load_secret(environ: dict[str, str] | None = None) -> bytes | None:
    """The cluster secret from the environment, None when none is configured."""
    env = os.environ if environ is None else environ
    path = env.get(ENV_FILE)
    if path:
        try:
            value = open(path, "rb").read().strip()  # noqa: SIM115 - tiny file, read once
        except OSError as exc:
            raise ClusterSecretError(f"{ENV_FILE}={path}: {exc}") from None
    else:
        raw = env.get(ENV_VALUE)
        if not raw:
            return None
        value = raw.encode().strip()
    if len(value) < 16:
        raise ClusterSecretError("the cluster secret must be at least 16 bytes")
    return value


_SECRET: list[bytes | None] = []
_SOURCE: list[str] = []  # where _SECRET came from, for error messages


def secret() -> bytes | None:
    """This process's secret (read from the environment once, unless :func:`configure` set it)."""
    if not _SECRET:
        _SECRET.append(load_secret())
        _SOURCE[:] = [_environment_source()]
    return _SECRET[0]


def configure(key: bytes | None, source: str = "set by this process") -> None:
    """Set this process's secret explicitly (a client of a cluster whose secret it read from a file, and
    tests); servers and channels made afterwards use it. ``source`` says where it was read from."""
    _SECRET[:] = [key]
    _SOURCE[:] = [source if key else "none configured"]


def _environment_source() -> str:
    if os.environ.get(ENV_FILE):
        return f"{ENV_FILE}={os.environ[ENV_FILE]}"
    return ENV_VALUE if os.environ.get(ENV_VALUE) else "none configured"


_NOT_GIVEN = object()


def refusal_advice(reason: str, key: Any = _NOT_GIVEN) -> str:
    """What a refused client should be told about its own side, by the listener's ``reason``: for a missing
    or wrong secret, which secret it presented (``key``, default this process's) and where one is read
    from, so an operator fixes the configuration instead of looking for a crash; for a stale hello, the
    clock; a replayed one is the network's doing and worth a retry."""
    if "stale hello" in reason:
        return f"this host's clock and the listener's differ by more than {HELLO_WINDOW_S:.0f} s: sync them"
    if "replayed hello" in reason:
        return "the listener saw this hello before (a replay); a new connection sends a new one"
    key = secret() if key is _NOT_GIVEN else key
    where = f"{ENV_FILE} (a file) or {ENV_VALUE} (the value)"
    if key is None:
        return f"this process has no cluster secret: neither {ENV_FILE} nor {ENV_VALUE} is set; set {where}"
    source = _SOURCE[0] if _SOURCE and key == _SECRET[0] else "given to this call"
    return (
        f"the cluster secret this process presented (from {source}) is not the cluster's; "
        f"set {where} to the secret the cluster was started with"
    )


def read_secret_file(path: str) -> bytes:
    return load_secret({ENV_FILE: path}) or b""


def new_secret() -> str:
    return secrets.token_hex(32)


def rejection_counters() -> dict[str, int]:
    """``auth_rejected_<listener>`` -> count, for a service's stats and metrics."""
    return {f"auth_rejected_{k.replace(' ', '_')}": v for k, v in rejected.items()}


def count_rejection(listener: str, peer: str, why: str) -> None:
    """Count a rejected peer; log it once per listener and peer *host* (``peer`` may carry the connection's
    port, which every new connection changes: a scanner must not flood the log)."""
    rejected[listener] = rejected.get(listener, 0) + 1
    key = f"{listener} {_host_of(peer)}"
    if key not in _logged:
        _logged[key] = None
        if len(_logged) > MAX_LOGGED_PEERS:
            _logged.popitem(last=False)
        log.warning("rejected unauthenticated %s peer %s: %s", listener, peer, why)


def _host_of(peer: str) -> str:
    """The host part of a peer as listeners name it: ``ipv4:1.2.3.4:5`` (gRPC), ``1.2.3.4:5``,
    ``('1.2.3.4', 5)`` (a socket's peername), ``[::1]:5``; anything else as it is."""
    text = peer
    for prefix in ("ipv4:", "ipv6:"):
        text = text.removeprefix(prefix)
    if text.startswith("(") and "," in text:  # a peername tuple
        return text.strip("()").split(",")[0].strip(" '")
    host, sep, port = text.rpartition(":")
    return host.strip("[]") if sep and port.isdigit() else text


# -- gRPC ------------------------------------------------------------------------------------------------
def grpc_token(key: bytes) -> str:
    return hmac.new(key, b"kvpool-grpc-v1", hashlib.sha256).hexdigest()


def _with_token(details: grpc.aio.ClientCallDetails, token: str) -> grpc.aio.ClientCallDetails:
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), (METADATA_KEY, token)))


# two classes: grpc.aio files an interceptor under the first kind it is an instance of, never both
class _UnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(details, self.token), request)


class _StreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return await continuation(_with_token(details, self.token), request)


class _SyncMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    def _with_token(self, details: Any) -> Any:
        return details._replace(metadata=[*(details.metadata or ()), (METADATA_KEY, self.token)])

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._with_token(details), request)


def aio_channel(address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
    """An asyncio gRPC channel that presents the cluster token (a plain channel without a secret)."""
    key = secret()
    interceptors = [_UnaryToken(grpc_token(key)), _StreamToken(grpc_token(key))] if key else None
    return grpc.aio.insecure_channel(address, options=list(options), interceptors=interceptors)


def sync_channel(
    address: str, options: Sequence[tuple[str, Any]] = (), key: bytes | None = None
) -> grpc.Channel:
    """A blocking gRPC channel that presents the cluster token (``key``, default this process's secret)."""
    channel = grpc.insecure_channel(address, options=list(options))
    key = key or secret()
    return grpc.intercept_channel(channel, _SyncMetadata(grpc_token(key))) if key else channel


class ServerAuth(grpc.aio.ServerInterceptor):
    """Refuses every call without the token (UNAUTHENTICATED) before its handler runs."""

    def __init__(self, key: bytes, listener: str = "grpc") -> None:
        self.token = grpc_token(key)
        self.listener = listener

    async def intercept_service(self, continuation, details):  # type: ignore[no-untyped-def]
        if details.method.startswith(OPEN_METHODS):
            return await continuation(details)
        got = dict(details.invocation_metadata or ()).get(METADATA_KEY, "")
        if isinstance(got, str) and hmac.compare_digest(got, self.token):
            return await continuation(details)
        why = "no cluster token" if not got else "wrong cluster token"
        handler = await continuation(details)
        return _refusing(handler, why, self.listener, details.method)


def _refusing(handler: Any, why: str, listener: str, method: str) -> Any:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        count_rejection(listener, context.peer(), f"{why} ({method})")
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{why}: this cluster requires its secret")

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
        await refuse(request, context)
        yield  # pragma: no cover - abort raised

    if handler is None:
        return None
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, **kw)
    return grpc.unary_unary_rpc_method_handler(refuse, **kw)


# -- raw connections ---------------------------------------------------------------------------------------
def hello(key: bytes, now: Callable[[], float] = time.time) -> bytes:
    """The 56-byte hello a client sends first on a raw connection."""
    stamp, nonce = int(now()), secrets.token_bytes(12)
    mac = hmac.new(key, struct.pack("<Q", stamp) + nonce, hashlib.sha256).digest()
    return HELLO.pack(HELLO_MAGIC, stamp, nonce, mac)


def client_hello() -> bytes:
    """This process's hello, or b"" when no secret is configured."""
    key = secret()
    return hello(key) if key else b""


class HelloCheck:
    """Server side of the hello: MAC, freshness and replay (nonces of the last window are remembered)."""

    def __init__(self, key: bytes, listener: str, now: Callable[[], float] = time.time) -> None:
        self.key = key
        self.listener = listener
        self._now = now
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def verify(self, data: bytes, peer: str) -> bool:
        """True to serve the connection; False (counted, logged once per peer) to close it."""
        return self.refusal(data, peer) is None

    def refusal(self, data: bytes, peer: str) -> str | None:
        """None to serve the connection; else why it is refused (counted, logged once per peer), for the
        answer a listener sends before it closes the connection."""
        why = self._problem(data)
        if why is not None:
            count_rejection(self.listener, peer, why)
        return why

    @staticmethod
    def cannot_be_hello(data: bytes) -> bool:
        """The first bytes of a connection already show it is no hello (a client without a secret sends
        its first frame at once): refuse now rather than wait for 56 bytes that may never come."""
        head = data[: len(HELLO_MAGIC)]
        return not HELLO_MAGIC.startswith(head)

    def _problem(self, data: bytes) -> str | None:
        if len(data) != HELLO_SIZE:
            return "no hello (the connection did not start with the cluster handshake: no cluster secret)"
        magic, stamp, nonce, mac = HELLO.unpack(data)
        if magic != HELLO_MAGIC:
            return "no hello (the connection did not start with the cluster handshake: no cluster secret)"
        want = hmac.new(self.key, struct.pack("<Q", stamp) + nonce, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, want):
            return "wrong cluster secret"
        now = self._now()
        if abs(now - stamp) > HELLO_WINDOW_S:
            return "stale hello (clock skew or replay)"
        while self._seen and next(iter(self._seen.values())) < now - HELLO_WINDOW_S:
            self._seen.popitem(last=False)
        if nonce in self._seen:
            return "replayed hello"
        self._seen[nonce] = now
        return None


def server_hello_check(listener: str) -> HelloCheck | None:
    """The check a raw listener applies, None when no secret is configured."""
    key = secret()
    return HelloCheck(key, listener) if key else None
