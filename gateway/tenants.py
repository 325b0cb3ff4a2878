"""API keys bound to tenants: the cache salt a request really uses is decided here, not by the client.

A key configured as ``KEY=TENANT`` (``--api-key``, ``KVPOOL_API_KEYS``, ``api_keys`` in ``kvpool up``'s
config) binds every request it authenticates to TENANT: the salt that roots the request's hash chain is
derived from (tenant, client ``cache_salt``), so two keys sending the same prompt with the same client salt
never share a block, and a salt stolen from another tenant finds nothing. Metrics label such requests with
the tenant's name. A bare ``KEY`` keeps the client's salt as it is (one-tenant deployments), as does a
gateway without keys.

Worked example: keys ``k1=acme`` and ``k2=beta``. A request with ``k1`` and ``cache_salt "s"`` is salted
``tenant:acme/s``; the same body sent with ``k2`` is salted ``tenant:beta/s``: different roots, no common key.
"""

from __future__ import annotations

import re
from typing import Any

from kvpool.gateway.errors import InvalidRequest

TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
BOUND_PREFIX = "tenant:"


def parse_key(entry: str) -> tuple[str, str | None]:
    """``"KEY=TENANT"`` -> (KEY, TENANT); anything else (a bare key, base64 padding) -> (entry, None)."""
    key, sep, tenant = entry.rpartition("=")
    if sep and key and TENANT_NAME.fullmatch(tenant):
        return key, tenant
    return entry, None


def bound_salt(tenant: str | None, client_salt: str | None) -> str:
    """The salt a request is hashed under: the client's, or (tenant, client's) when its key is bound. A
    client salt that reads like a bound one is refused: it would reach that tenant's chains and sessions."""
    if tenant is None:
        if client_salt and client_salt.startswith(BOUND_PREFIX):
            raise InvalidRequest(
                f"cache_salt may not start with {BOUND_PREFIX!r}: reserved for API keys bound to tenants",
                param="cache_salt",
            )
        return client_salt or ""
    return f"{BOUND_PREFIX}{tenant}/{client_salt or ''}"


def key_tenant(request: Any) -> str | None:
    """The tenant the request's API key is bound to (set by ``Guard``), or None."""
    return getattr(request.state, "tenant", None)
