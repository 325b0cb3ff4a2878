"""ASGI middleware in front of the routes: API-key check and request-body size limit.

Why middleware and not FastAPI dependencies: both checks must run *before* the body is parsed — a wrong key
is a 401 even when the body is also malformed, and an oversized body must be refused without being
materialised by the JSON parser. Bodies without Content-Length (chunked) are buffered up to the limit only.
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvpool.gateway.errors import BodyTooLarge, GatewayError, Unauthorized
from kvpool.gateway.tenants import parse_key

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
PROTECTED_PREFIX = "/v1/"


class Guard:
    def __init__(self, app: Callable, api_keys: list[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_keys = [(k.encode(), tenant) for k, tenant in map(parse_key, api_keys) if k]
        self.max_body_bytes = max_body_bytes

    def _authorized(self, headers: dict[bytes, bytes]) -> tuple[bool, str | None]:
        """(the request carries a configured key, the tenant that key is bound to or None)."""
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        if scheme.lower() != b"bearer":
            return False, None
        token = token.strip()
        found = [tenant for k, tenant in self.api_keys if hmac.compare_digest(token, k)]
        return (True, found[0]) if found else (False, None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        ok, tenant = self._authorized(headers) if self.api_keys else (True, None)
        scope.setdefault("state", {})["tenant"] = tenant  # read by the app: the salt it binds (tenants.py)
        if self.api_keys and scope["path"].startswith(PROTECTED_PREFIX) and not ok:
            await _reply(
                Unauthorized("Incorrect API key provided (send 'Authorization: Bearer <key>')"),
                scope,
                receive,
                send,
            )
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            length = headers.get(b"content-length")
            too_big = BodyTooLarge(f"request body exceeds {self.max_body_bytes} bytes")
            if length is not None:
                try:
                    n = int(length)
                except ValueError:
                    n = self.max_body_bytes + 1
                if n > self.max_body_bytes:
                    await _reply(too_big, scope, receive, send)
                    return
            else:
                body, over = await _buffer(receive, self.max_body_bytes)
                if over:
                    await _reply(too_big, scope, receive, send)
                    return
                receive = _replay(body)
        await self.app(scope, receive, send)


async def _buffer(receive: Receive, limit: int) -> tuple[bytes, bool]:
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            return b"".join(parts), False
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", True
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts), False


def _replay(body: bytes) -> Receive:
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.disconnect"}

    return receive


async def _reply(err: GatewayError, scope: Scope, receive: Receive, send: Send) -> None:
    await err.response()(scope, receive, send)
