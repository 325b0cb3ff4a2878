"""gRPC failures → the store's typed errors, for every gRPC call the client and transports make.

The node (and, by convention, the master) put the error class name first in the status details
(``"ObjectTooLargeError: ..."``); when that name is one of ours the exact class comes back, otherwise the
status code decides. UNAVAILABLE → ``StoreUnavailableError``, DEADLINE_EXCEEDED → ``TransportTimeoutError``.
The master wire (``master_wire``) reports failures as the same code + message and maps them here too.
"""

from __future__ import annotations

from typing import NoReturn

import grpc
from kvpool.kvstore import errors
from kvpool.kvstore.errors import (
    BadRequestError,
    CapacityExceededError,
    CorruptObjectError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
    StoreUnavailableError,
    TransportTimeoutError,
)

# Reconnect quickly after a master/node restart (gRPC's default backoff grows to 120 s, which would leave a
# restarted master unreachable from long-lived clients and nodes for minutes).
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 1 << 30),  # a node's RegisterNode carries its whole inventory
)

_BY_STATUS: dict[grpc.StatusCode, type[StoreError]] = {
    grpc.StatusCode.NOT_FOUND: ObjectNotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExceededError,
    grpc.StatusCode.DATA_LOSS: CorruptObjectError,
    grpc.StatusCode.INVALID_ARGUMENT: BadRequestError,
    grpc.StatusCode.OUT_OF_RANGE: BadRequestError,
    grpc.StatusCode.ALREADY_EXISTS: ObjectExistsError,
    grpc.StatusCode.UNAVAILABLE: StoreUnavailableError,
    grpc.StatusCode.CANCELLED: StoreUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: TransportTimeoutError,
}


def status_of(exc: StoreError) -> grpc.StatusCode:
    """The gRPC status a server answers a typed store error with (the class's ``grpc_status``)."""
    return grpc.StatusCode[exc.grpc_status]


def typed_error_from(code: grpc.StatusCode, details: str, where: str = "") -> StoreError:
    """The typed store error for a call that failed with ``code`` and ``details``, however it travelled
    (a gRPC status, or a master wire reply frame carrying the same code and message): one mapping, so a
    caller sees the same class whichever channel answered."""
    name = details.split(":", 1)[0].strip()
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, StoreError)):
        cls = _BY_STATUS.get(code, StoreError)
    prefix = f"{where}: " if where else ""
    return cls(f"{prefix}{code.name}: {details}")


def typed_error(exc: grpc.aio.AioRpcError | grpc.RpcError, where: str = "") -> StoreError:
    """The typed store error for a failed gRPC call."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    return typed_error_from(code, details, where)


def raise_typed(exc: grpc.aio.AioRpcError | grpc.RpcError, where: str = "") -> NoReturn:
    raise typed_error(exc, where) from exc
