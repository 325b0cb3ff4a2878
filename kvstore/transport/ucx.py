"""ucx transport (client side) and the one safe way to import ucxx.

Import ucxx the one safe way: tuned environment first, blocking progress, and a clear error if absent.

ucxx must see its environment before import (overview §5): blocking progress mode (the default
thread mode is 6-11x slower on 2 cores), 512 KiB tcp segments (0.5 → 4 GB/s), and no "unused variable"
warnings,
because UCX logs to *stdout* and would corrupt the node's JSON readiness line. Callers' own settings win.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from types import ModuleType

import numpy as np
from kvpool.kvstore.errors import (
    ProtocolError,
    StoreError,
    StoreUnavailableError,
    TransportUnavailableError,
)
from kvpool.kvstore.protocol.data_frame import (
    CONTROL_SIZE,
    OP_GET,
    OP_PUT,
    STATUS_OK,
    STATUS_READY,
    Frame,
    decode_control,
    encode_control,
    reported_error,
)
from kvpool.kvstore.transport.base import (
    DEFAULT_DEADLINES,
    Buffer,
    Deadlines,
    Payload,
    Transport,
    fill_checksum,
    with_deadline,
)
from kvpool.proto import common_pb2, node_pb2
from kvpool.runtime import cluster_auth

UCX_DEFAULTS = {
    "UCX_WARN_UNUSED_ENV_VARS": "n",
    "UCX_TCP_TX_SEG_SIZE": "512k",
    "UCX_TCP_RX_SEG_SIZE": "512k",
    "UCXPY_PROGRESS_MODE": "blocking",
    # a restarted node rebinds its ucx port while old connections sit in TIME_WAIT (else UCXXBusyError)
    "UCX_TCP_CM_REUSEADDR": "y",
    # a host reaching its peers through a Linux bridge (containers, `kvpool up --netns`): UCX skips bridge
    # interfaces by default and then finds no route ("Destination is unreachable")
    "UCX_TCP_BRIDGE_ENABLE": "y",
}

_ucxx: ModuleType | None = None
_error: str | None = None


def load_ucxx() -> ModuleType:
    """The initialised ucxx module, or ``TransportUnavailableError`` when it cannot be imported."""
    global _ucxx, _error
    if _ucxx is not None:
        return _ucxx
    if _error is not None:
        raise TransportUnavailableError(_error)
    for name, value in UCX_DEFAULTS.items():
        os.environ.setdefault(name, value)
    try:
        import ucxx
    except Exception as exc:  # ImportError, OSError for missing shared libraries
        _error = f"ucxx is not usable here: {type(exc).__name__}: {exc}"
        raise TransportUnavailableError(_error) from exc
    _rearm_after_events()
    ucxx.init(progress_mode="blocking")
    _ucxx = ucxx
    return ucxx


def _rearm_after_events() -> None:
    """Make ucxx's blocking progress mode go back to sleep after an event.

    Why: in ucxx (0.4x), ``BlockingMode._fd_reader_callback`` progresses the worker but never re-arms it
    (ucx-py's original scheduled a new arm task there). Once the first event has arrived the worker's epoll
    fd stays readable, so asyncio calls the callback on every loop turn: each process with a ucx endpoint
    then burns a core polling (measured: ~50 % CPU per idle node and worker on a 2-core box), and everything
    else on the machine — the model, the other transports — slows by as much. This restores the re-arm:
    after progressing, an arm task is scheduled; it arms the worker once the loop's other ready tasks ran.
    """
    from ucxx._lib_async import continuous_ucx_progress as progress

    blocking = progress.BlockingMode
    if getattr(blocking, "_kvpool_rearms", False):
        return

    def fd_reader_callback(self) -> None:  # type: ignore[no-untyped-def]
        self.worker.progress()
        task = self.arm_task
        if task is None or task.done():
            self.arm_task = self.event_loop.create_task(self._arm_worker())

    blocking._fd_reader_callback = fd_reader_callback
    blocking._kvpool_rearms = True


IDLE_HOT_S = 0.002  # keep yielding this long after the last message (a burst's next frame is close behind)
IDLE_MAX_SLEEP_S = 0.001  # then sleep, doubling from 50 µs up to this, between probes


async def until_message(ep) -> None:  # type: ignore[no-untyped-def]
    """Return once a message for ``ep`` is queued on the worker, or the endpoint has failed.

    Why: in blocking mode ucxx waits for a receive by yielding to the event loop until it completes
    (``UCXRequest.wait_yield``), so a node that keeps a receive posted on every idle connection turns one
    core per process into a poll loop (measured: 100 % CPU per idle node on a 2-core box, which then
    steals that core from the model and the other transports). This waits with a probe instead: hot for
    ``IDLE_HOT_S``, then sleeping up to ``IDLE_MAX_SLEEP_S`` between probes; the receive posted after it
    completes at once. If ucxx's internals differ from what this expects, it returns at once (the old
    busy wait, never a hang).
    """
    try:
        from ucxx.types import Tag

        worker = ep._ctx.worker
        tag = ep._tags["msg_recv"]
        tag = tag if isinstance(tag, Tag) else Tag(tag)
    except Exception:
        return
    loop = asyncio.get_running_loop()
    hot_until = loop.time() + IDLE_HOT_S
    sleep = 0.0
    while True:
        try:
            if ep.closed:
                return
            ep._ep.raise_on_error()
            if worker.tag_probe(tag).matched:
                return
        except Exception:
            return  # the receive that follows raises the endpoint's error
        if loop.time() < hot_until:
            await asyncio.sleep(0)
        else:
            sleep = min(max(sleep * 2, 50e-6), IDLE_MAX_SLEEP_S)
            await asyncio.sleep(sleep)


def ucx_available() -> bool:
    try:
        load_ucxx()
    except TransportUnavailableError:
        return False
    return True


HANDSHAKE_UNBOUNDED_S = 1e9  # ucxx's own handshake timeout: never (see UcxTransport._connect)


async def _endpoint_with_hello(ucxx: ModuleType, host: str, port: int):  # type: ignore[no-untyped-def]
    """Connect, then (with a cluster secret) send the hello the node reads before any frame. Both inside
    the one never-cancelled connect task: a send cancelled mid-flight could leave UCX reading freed bytes."""
    ep = await ucxx.create_endpoint(host, port, connect_timeout=HANDSHAKE_UNBOUNDED_S)
    hello = cluster_auth.client_hello()
    if hello:
        try:
            await ep.send(np.frombuffer(hello, np.uint8))
        except BaseException:
            abort_endpoint(ep)
            raise
    return ep


def _abort_when_connected(task: asyncio.Task) -> None:
    """Done-callback of an abandoned connect: close the endpoint it produced (errors are already moot)."""
    if task.cancelled() or task.exception() is not None:
        return
    abort_endpoint(task.result())


# --- client side ------------------------------------------------------------------------------------------
class UcxTransport(Transport):
    """ucxx tag send/recv to the node's ucxx listener; one request at a time per pooled endpoint.

    Protocol per request (fixed ``CONTROL_SIZE`` control messages, because tag receives need the length):
    PUT: ctrl → node replies READY (extent reserved) or an error → payload → node replies final status.
    GET: ctrl (with the reader's capacity) → node replies status + size + checksum → payload.
    The READY round trip costs ~50 µs but means a refused put never has to be drained.
    """

    name = "ucx"

    def __init__(self, deadlines: Deadlines = DEFAULT_DEADLINES, max_endpoints_per_peer: int = 4) -> None:
        super().__init__(deadlines)
        self._idle: dict[tuple[str, int], list[object]] = {}
        self._max_idle = max_endpoints_per_peer
        self._slots: dict[tuple[str, int], asyncio.Semaphore] = {}
        self._connecting: set[asyncio.Task] = set()  # handshakes in flight, abandoned ones included

    async def _acquire(
        self, node: common_pb2.NodeEndpoint, fresh: bool = False
    ) -> tuple[tuple[str, int], object, bool]:
        """An endpoint to ``node`` and whether it was reused from the pool."""
        if not node.ucx_port:
            raise TransportUnavailableError(f"node {node.node_id} has no ucx listener")
        ucxx = load_ucxx()
        addr = (node.host, node.ucx_port)
        idle = self._idle.get(addr)
        if idle and not fresh:
            return addr, idle.pop(), True
        connect = self._connect(ucxx, node.host, node.ucx_port)
        where = f"ucx connect to {node.host}:{node.ucx_port}"
        try:
            ep = await with_deadline(asyncio.shield(connect), self.deadlines.connect_s, where)
        except BaseException as exc:
            connect.add_done_callback(_abort_when_connected)  # finishes in the background, then closes
            if isinstance(exc, Exception) and not isinstance(exc, StoreError):  # ucxx's own error
                raise StoreUnavailableError(f"{where}: {exc}") from exc
            raise
        return addr, ep, False

    def _connect(self, ucxx: ModuleType, host: str, port: int) -> asyncio.Task:
        """``create_endpoint`` as a task that is never cancelled and never times out inside ucxx.

        Why: ucxx's handshake receives the peer's info into a 16-byte ``bytearray`` (Python's small-object
        heap) and, when its own ``connect_timeout`` fires or the call is cancelled, returns with that receive
        still posted. A peer that was only frozen or partitioned answers later, UCX writes 16 bytes into
        freed interpreter memory and the process dies in ``malloc`` (seen: a prefill worker, SIGSEGV, after
        ``kvpool chaos freeze node-0`` then ``heal``). So the caller's deadline waits on a shield, and an
        abandoned connect runs to its end in the background and is then closed (``_abort_when_connected``).
        """
        task = asyncio.ensure_future(_endpoint_with_hello(ucxx, host, port))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)
        return task

    def _release(self, addr: tuple[str, int], ep: object, ok: bool) -> None:
        idle = self._idle.setdefault(addr, [])
        if ok and len(idle) < self._max_idle:
            idle.append(ep)
        else:
            abort_endpoint(ep)

    async def _exchange(self, node: common_pb2.NodeEndpoint, size: int, body) -> int:  # type: ignore[no-untyped-def]
        """Run ``body(ep)`` on a pooled endpoint; at most ``max_endpoints_per_peer`` run at once per node, so
        a wide batch reuses a few endpoints instead of paying a connection setup per object."""
        slots = self._slots.setdefault((node.host, node.ucx_port), asyncio.Semaphore(self._max_idle))
        await with_deadline(
            slots.acquire(), self.deadlines.for_size(size), f"ucx endpoint for {node.node_id}"
        )
        try:
            return await self._exchange_on_endpoint(node, size, body)
        finally:
            slots.release()

    async def _exchange_on_endpoint(self, node: common_pb2.NodeEndpoint, size: int, body) -> int:  # type: ignore[no-untyped-def]
        """A pooled endpoint that fails with a ucx error (its node restarted) is replaced once by a fresh
        one; safe because puts are idempotent. A dead node then fails the fresh connect at once."""
        for attempt in (0, 1):
            addr, ep, reused = await self._acquire(node, fresh=attempt == 1)
            ok = False
            try:
                result = await with_deadline(
                    body(ep), self.deadlines.for_size(size), f"ucx transfer with {addr}"
                )
                ok = True
                return result
            except StoreError as exc:
                ok = not isinstance(exc, StoreUnavailableError)  # an error reply keeps the endpoint in sync
                raise
            except Exception as exc:
                if reused and attempt == 0:
                    continue
                raise StoreUnavailableError(f"ucx transfer with {addr[0]}:{addr[1]} failed: {exc}") from exc
            finally:
                self._release(addr, ep, ok)  # a failed endpoint is aborted: ucxx cancels its posted receives
        raise AssertionError("unreachable")

    async def put(
        self, node: common_pb2.NodeEndpoint, put_id: str, meta: common_pb2.ObjectMeta, data: Buffer
    ) -> None:
        payload = Payload.of(data)
        if payload.nbytes != meta.size:
            raise ValueError(f"data is {payload.nbytes} B, meta says {meta.size} B")
        fill_checksum(meta, payload)
        view = payload.joined()  # ucxx sends one buffer: parts are joined here (tcp and shm never do)
        ctrl = encode_control(
            Frame(
                OP_PUT,
                key=meta.key,
                payload_len=meta.size,
                checksum=meta.checksum,
                aux=node_pb2.PutHeader(put_id=put_id, meta=meta).SerializeToString(),
            )
        )

        async def body(ep) -> int:  # type: ignore[no-untyped-def]
            reply = np.empty(CONTROL_SIZE, np.uint8)
            await ep.send(np.frombuffer(ctrl, np.uint8))
            await ep.recv(reply)
            first = decode_control(reply)
            if first.status not in (STATUS_READY, STATUS_OK):
                raise reported_error(first)
            if first.status == STATUS_OK:  # duplicate: nothing to send
                return 0
            if meta.size:
                await ep.send(np.frombuffer(view, np.uint8))
            await ep.recv(reply)
            final = decode_control(reply)
            if final.status != STATUS_OK:
                raise reported_error(final)
            return meta.size

        self.bytes_out += await self._exchange(node, meta.size, body)

    async def _get_into(self, location: common_pb2.ObjectLocation, out: memoryview) -> int:
        meta = location.meta
        ctrl = encode_control(Frame(OP_GET, key=meta.key, payload_len=len(out)))

        async def body(ep) -> int:  # type: ignore[no-untyped-def]
            reply = np.empty(CONTROL_SIZE, np.uint8)
            await ep.send(np.frombuffer(ctrl, np.uint8))
            await ep.recv(reply)
            head = decode_control(reply)
            if head.status != STATUS_OK:
                raise reported_error(head)
            if head.payload_len > len(out):
                raise ProtocolError(f"node announced {head.payload_len} B for a {len(out)} B buffer")
            if head.payload_len:
                await ep.recv(np.frombuffer(out[: head.payload_len], np.uint8))
            return head.payload_len

        return await self._exchange(location.node, meta.size, body)

    async def close(self) -> None:
        for idle in self._idle.values():
            for ep in idle:
                abort_endpoint(ep)
        self._idle.clear()
        self._slots.clear()


# How long closing an endpoint may hold the event loop. ucxx's default is 10 s per phase, and with a peer that
# is frozen or partitioned the close waits all of it, in the loop's thread: every other request of the
# process (and its gRPC health answer) stalls behind one dead peer.
ABORT_PERIOD_NS = 100_000_000


def abort_endpoint(ep: object) -> None:
    """Close ``ep`` at once, waiting at most ``ABORT_PERIOD_NS`` for the peer; never raises."""
    with contextlib.suppress(Exception):
        ep.abort(period=ABORT_PERIOD_NS)  # type: ignore[attr-defined]
