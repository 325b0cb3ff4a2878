"""ASGI middleware in front of the routes: API-key check, request-body size limit and body deadline.

Why middleware and not FastAPI dependencies: these checks must run *before* the body is parsed — a wrong key
is a 401 even when the body is also malformed, and an oversized body must be refused without being
materialised by the JSON parser. A body is read here, up to the limit, within ``body_timeout_s``: the server
sets no deadline on reading a body, so a client that stops sending mid-body (stalled, or slow on purpose)
would hold its connection and coroutine for as long as it liked; it gets a 408.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvpool.gateway.errors import BodyTimeout, BodyTooLarge, GatewayError, Unauthorized
from kvpool.gateway.tenants import parse_key

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
PROTECTED_PREFIX = "/v1/"


class Guard:
    def __init__(
        self, app: Callable, api_keys: list[str], max_body_bytes: int, body_timeout_s: float
    ) -> None:
        self.app = app
        self.api_keys = [(k.encode(), tenant) for k, tenant in map(parse_key, api_keys) if k]
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

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
            try:
                async with asyncio.timeout(self.body_timeout_s):
                    body, over = await _buffer(receive, self.max_body_bytes)
            except TimeoutError:
                late = BodyTimeout(f"the request body was not received within {self.body_timeout_s:g} s")
                await _reply(late, scope, receive, send)
                return
            except _ClientGone:  # it left mid-body: nobody to run the request for, nobody to answer
                return
            if over:
                await _reply(too_big, scope, receive, send)
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)


class _ClientGone(Exception):
    """The client disconnected before its body was complete."""


async def _buffer(receive: Receive, limit: int) -> tuple[bytes, bool]:
    """The whole body and False, or b"" and True once it passes ``limit``; ``_ClientGone`` when the client
    leaves first (a partial body is never handed on as if it were complete)."""
    parts: list[bytes] = []
    size = 0
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            raise _ClientGone
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            return b"", True
        parts.append(chunk)
        if not msg.get("more_body", False):
            return b"".join(parts), False


def _replay(body: bytes, then: Receive) -> Receive:
    """The body read here, as one message; after it, what the server says (``then``): a streaming response
    waits on it for the client's disconnect, so an invented one would end every stream at once."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()

    return receive


async def _reply(err: GatewayError, scope: Scope, receive: Receive, send: Send) -> None:
    await err.response()(scope, receive, send)
