"""One MasterCore call for any front end of the master (gRPC in ``master_server``, the wire in
``master_wire``), so both answer with exactly the same semantics.

:meth:`CoreDispatch.run` calls the synchronous core method on the event loop (one thread: no locks), maps
:class:`~kvpool.kvstore.master.core.MasterError` to its status name and message, turns any other exception
into INTERNAL (a bug costs one call, never the server) and hands the node orders the call produced to the
:class:`~kvpool.kvstore.master.node_notifier.NodeNotifier` right away. Most replies go out at once; the calls
in :data:`WAITS_FOR_NODES` are answered only after their node orders were attempted (bounded), which
:meth:`CoreDispatch.settle` does.

Calls are named, not bound, because with HA the core is replaced on every election (a new leader starts
from an empty index that the nodes' inventories refill). A ``gate`` (``ha.LeaderGate``) may refuse a call
before it runs: a standby answers ``NotLeaderError`` naming the leader, and nothing was executed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol

from kvpool.kvstore.errors import MasterError
from kvpool.kvstore.master.core import MasterCore
from kvpool.kvstore.master.node_notifier import NodeNotifier

log = logging.getLogger(__name__)

# Core methods answered only once their node orders were attempted: ``remove`` must not say "removed"
# while a node still serves the key (clients read keys they know straight from nodes).
WAITS_FOR_NODES = frozenset({"remove"})


class CoreCallError(Exception):
    """A core call failed; ``code`` is the grpc.StatusCode name to answer with, ``message`` the details."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Gate(Protocol):
    """Decides whether this master may run a call now (HA: only the leader may)."""

    def refusal(self, method: str) -> str | None:
        """None to run ``method``; else why not, naming the leader (``leader=HOST:PORT``) when known."""
        ...


class CoreDispatch:
    """Runs core calls and delivers their node orders (see the module docstring)."""

    def __init__(self, core: MasterCore, notifier: NodeNotifier, gate: Gate | None = None) -> None:
        self.core = core
        self.notifier = notifier
        self.gate = gate

    def run(self, method: str, request: Any) -> tuple[Any, list[asyncio.Future[None]]]:
        """The reply of core method ``method`` and the futures of the node orders to wait for before
        answering (empty unless ``method`` is in :data:`WAITS_FOR_NODES`). Raises :class:`CoreCallError`."""
        if self.gate is not None:
            refusal = self.gate.refusal(method)
            if refusal is not None:
                self.core.count("rpc_not_leader")
                raise CoreCallError("UNAVAILABLE", f"NotLeaderError: {refusal}")
        fn: Callable[[Any], Any] = getattr(self.core, method)
        try:
            reply = fn(request)
        except MasterError as exc:
            self.core.count(f"rpc_{exc.grpc_status.lower()}")
            raise CoreCallError(exc.grpc_status, str(exc)) from exc
        except Exception as exc:  # a bug must cost one call, never the server
            log.exception("%s failed", getattr(fn, "__name__", fn))
            self.core.count("rpc_internal")
            raise CoreCallError("INTERNAL", f"{type(exc).__name__}: {exc}") from exc
        finally:
            done = self.flush()
        return reply, (done if method in WAITS_FOR_NODES else [])

    def flush(self) -> list[asyncio.Future[None]]:
        """Hand every queued node order to the notifier; the futures resolve as each is attempted."""
        actions = self.core.take_actions()
        if not actions:
            return []
        return self.notifier.submit(actions) or []

    async def settle(self, done: list[asyncio.Future[None]]) -> None:
        """Wait, bounded by the node call deadline, for node orders (a dead node is dropped by the sweep)."""
        if done:
            await asyncio.wait(done, timeout=self.notifier.timeout_s)
