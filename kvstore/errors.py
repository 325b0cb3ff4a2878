"""Typed errors of the store data plane and client library.

Callers branch on the type, never on message text: a missing object (``ObjectNotFoundError``) is not an
empty object, a corrupt one (``CorruptObjectError``) is a miss to recompute, and a dead or slow peer
(``StoreUnavailableError`` / ``TransportTimeoutError``) is retryable.

This is the one error hierarchy of the store: the master, the nodes, the index (``StoreIndexError``) and the
client raise these classes. Each class's ``code`` is its number in the one status table (:data:`_BY_CODE`,
:func:`error_for_code`) that every framed boundary carries: the master wire's reply status, the tcp / ucx
data-plane frames. So the receiving side raises the very class the other side raised, no translation. (The
storage node's gRPC control plane, which only the master calls, answers with ``grpc_status``.)
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every store error."""

    code = 255  # wire status code (see ``error_for_code``); the base class: an internal error
    grpc_status = "INTERNAL"  # what the node's gRPC control plane answers it with (node/process.py)


class ObjectNotFoundError(StoreError, KeyError):
    """The key is not stored (or not on the node the index pointed at). Missing is never empty bytes."""

    code = 1
    grpc_status = "NOT_FOUND"

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "object not found"


class CorruptObjectError(StoreError):
    """Stored bytes do not match their checksum (treat as a miss and recompute)."""

    code = 2
    grpc_status = "DATA_LOSS"


class ChecksumMismatchError(CorruptObjectError):
    """A put's payload does not hash to the checksum it declared; the put is rejected."""

    code = 3


class StaleReadError(CorruptObjectError):
    """A read in place (``Transport.read_in_place``) saw the object's shm stamp change while it was being
    read: it was deleted or moved meanwhile, so what the reader took may not be its bytes. A miss; local to
    the reader, never on the wire."""

    code = 18


class CapacityExceededError(StoreError):
    """The node's pool (or SSD tier) has no extent large enough for the object."""

    code = 4
    grpc_status = "RESOURCE_EXHAUSTED"


class ObjectTooLargeError(CapacityExceededError):
    """The object can never fit (larger than the node's max object size or total capacity)."""

    code = 5


class BadRequestError(StoreError, ValueError):
    """Malformed request: bad key, bad sizes, bad frame."""

    code = 6
    grpc_status = "INVALID_ARGUMENT"


class ProtocolError(BadRequestError):
    """Garbage or truncated data on a data-plane connection; the connection is closed."""

    code = 7


class StoreUnavailableError(StoreError, ConnectionError):
    """The master or a storage node cannot be reached or died mid-operation."""

    code = 8
    grpc_status = "UNAVAILABLE"


class TransportTimeoutError(StoreUnavailableError, TimeoutError):
    """A network wait passed its deadline."""

    code = 9
    grpc_status = "DEADLINE_EXCEEDED"


class MasterSilentError(StoreUnavailableError):
    """The master let a call run to its deadline moments ago (partitioned, frozen or drowning): calls fail at
    once until a probe call gets an answer, instead of each one waiting out its own deadline."""

    code = 13


class NotLeaderError(StoreUnavailableError):
    """This master is an HA standby (or a deposed leader): nothing was executed, so any call may go to the
    leader instead. ``leader`` is where the leader said it serves (``host:port``), None while unknown."""

    code = 14

    @property
    def leader(self) -> str | None:
        for word in str(self).split():
            if word.startswith(LEADER_HINT):
                return word.removeprefix(LEADER_HINT).rstrip(";,.") or None
        return None


LEADER_HINT = "leader="  # how a NotLeaderError's message names the leader: "... leader=HOST:PORT ..."


class UnauthenticatedError(StoreUnavailableError):
    """The peer refused this process's connection: it presented no cluster secret, or another one. Nothing
    it sent was executed. Retrying cannot help; the operator must give this process the cluster's secret
    (the message says where this process looked for it)."""

    code = 19
    grpc_status = "UNAUTHENTICATED"


class StaleEpochError(StoreError):
    """HA fencing: a node refused an order or a put from a master whose leadership epoch is older than the
    newest the node has seen (a deposed leader that has not noticed yet). Nothing was done."""

    code = 15
    grpc_status = "FAILED_PRECONDITION"


class TransportUnavailableError(StoreError):
    """An explicitly chosen transport cannot reach this peer (no silent fallback)."""

    code = 10


class ObjectNotAdmittedError(StoreError):
    """The master's admission control turned a put away (PutStart status NOT_ADMITTED). A per-item result of
    ``batch_put``, never raised to a user: the object is simply not cached and the request goes on."""

    code = 12  # never on the wire as an error: PutStart answers it as a status


class ObjectExistsError(StoreError):
    """The node already holds a different object under this key (objects are immutable)."""

    code = 11
    grpc_status = "ALREADY_EXISTS"


class ShardSetError(BadRequestError):
    """Master shards (``kvstore/shards.py``): shard parameters out of range, or two parties (a master and
    the shard set in etcd, a client or node and its master) that disagree on them; names both values."""

    code = 16


class WrongShardError(StoreError):
    """Master shards: this master does not own the chain's route (the caller's shard set is stale, or it
    routed by hand). Nothing was done; the caller treats it as a miss and refreshes its shard set."""

    code = 17
    grpc_status = "FAILED_PRECONDITION"


_BY_CODE: dict[int, type[StoreError]] = {
    cls.code: cls
    for cls in (
        ObjectNotFoundError,
        CorruptObjectError,
        ChecksumMismatchError,
        CapacityExceededError,
        ObjectTooLargeError,
        BadRequestError,
        ProtocolError,
        StoreUnavailableError,
        TransportTimeoutError,
        TransportUnavailableError,
        ObjectExistsError,
        MasterSilentError,
        NotLeaderError,
        StaleEpochError,
        ShardSetError,
        WrongShardError,
        StaleReadError,
        UnauthenticatedError,
    )
}


def error_for_code(code: int, message: str) -> StoreError:
    """Rebuild the typed error a peer reported in a wire frame (unknown codes become ``StoreError``)."""
    return _BY_CODE.get(code, StoreError)(message)
