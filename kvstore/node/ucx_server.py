"""The node's ucx data plane: a ucxx listener; each endpoint is served by its handler coroutine.

Same frames as tcp (``transport_frame``) but as fixed-size control messages, with an explicit READY step
before a put's payload so a refused put never has to be received (see ``transport_ucx``). Payloads are
received into / sent from the shared-memory extent directly. A handler that fails (garbage, peer reset,
deadline) closes only its own endpoint; freeing an extent after a timeout happens only once the endpoint is
closed, so a late receive cannot write into reused memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import numpy as np
from kvpool.kvstore.errors import BadRequestError, ProtocolError, StoreError, UnauthenticatedError
from kvpool.kvstore.node.object_store import ObjectStore
from kvpool.kvstore.protocol.data_frame import (
    CONTROL_SIZE,
    OP_GET,
    OP_PING,
    OP_PUT,
    RESPONSE,
    STATUS_READY,
    Frame,
    FrameError,
    decode_control,
    encode_control,
    error_frame,
)
from kvpool.kvstore.transport.ucx import abort_endpoint, load_ucxx, until_message
from kvpool.proto import node_pb2
from kvpool.runtime import cluster_auth

log = logging.getLogger(__name__)


class UcxDataServer:
    """ucxx listener bound to ``port`` (0 = any)."""

    def __init__(
        self, store: ObjectStore, port: int, frame_timeout_s: float = 5.0, floor_rate: float = 100e6
    ) -> None:
        self.store = store
        self.frame_timeout_s = frame_timeout_s
        self.floor_rate = floor_rate
        self.auth = cluster_auth.server_hello_check("node ucx")  # None: no cluster secret configured
        ucxx = load_ucxx()
        self._listener = ucxx.create_listener(self._handle, port=port or None)
        self.port: int = self._listener.port
        self._handlers: set[asyncio.Task] = set()

    async def close(self) -> None:
        for task in list(self._handlers):
            task.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        with contextlib.suppress(Exception):
            self._listener.close()

    async def _handle(self, ep) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        ctrl = np.empty(CONTROL_SIZE, np.uint8)
        try:
            if self.auth is not None and not await self._authenticated(ep):
                return
            while True:
                try:
                    await until_message(ep)  # idle wait without ucxx's poll loop
                    await ep.recv(ctrl)  # no deadline; a closed peer raises
                except Exception:
                    return
                try:
                    frame = decode_control(ctrl)
                    if frame.op & RESPONSE:
                        raise FrameError("response frame sent to the node")
                except FrameError as exc:
                    self.store.count("frames_rejected")
                    await self._reply(ep, error_frame(OP_PING, ProtocolError.code, str(exc)))
                    return
                try:
                    async with asyncio.timeout(self.frame_timeout_s + frame.payload_len / self.floor_rate):
                        await self._dispatch(ep, frame)
                except TimeoutError:
                    self.store.count("frames_timed_out")
                    return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("ucx endpoint closed: %s", exc)
        finally:
            abort_endpoint(ep)
            if task is not None:
                self._handlers.discard(task)

    async def _authenticated(self, ep) -> bool:  # type: ignore[no-untyped-def]
        """The endpoint's first message is the cluster hello (``runtime.cluster_auth``), within the frame
        deadline; a control frame instead (larger than the hello: truncated), a wrong MAC or silence is
        answered with an ``UnauthenticatedError`` frame and closes it before a frame is read."""
        assert self.auth is not None
        hello = np.zeros(cluster_auth.HELLO_SIZE, np.uint8)
        try:
            async with asyncio.timeout(self.frame_timeout_s):  # a peer that never sends it is closed
                await until_message(ep)
                await ep.recv(hello)
        except Exception:
            hello = np.zeros(0, np.uint8)
        why = self.auth.refusal(hello.tobytes(), "ucx peer")
        if why is None:
            return True
        self.store.count("auth_rejected")
        refused = UnauthenticatedError(f"the storage node refused the connection: {why}")
        await self._reply(ep, error_frame(OP_PING, refused.code, str(refused)))  # the client raises it
        return False

    async def _reply(self, ep, frame: Frame) -> None:  # type: ignore[no-untyped-def]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(ep.send(np.frombuffer(encode_control(frame), np.uint8)), 1.0)

    async def _dispatch(self, ep, frame: Frame) -> None:  # type: ignore[no-untyped-def]
        if frame.op == OP_PING:
            await ep.send(np.frombuffer(encode_control(Frame(OP_PING | RESPONSE)), np.uint8))
        elif frame.op == OP_PUT:
            await self._put(ep, frame)
        elif frame.op == OP_GET:
            await self._get(ep, frame)

    async def _put(self, ep, frame: Frame) -> None:  # type: ignore[no-untyped-def]
        header = node_pb2.PutHeader()
        try:
            try:
                header.ParseFromString(frame.aux)
            except Exception as exc:
                raise BadRequestError(f"bad PutHeader: {exc}") from exc
            if header.meta.size != frame.payload_len or header.meta.checksum != frame.checksum:
                raise BadRequestError("frame and PutHeader disagree on size or checksum")
            pending = self.store.begin_put(header.put_id, header.meta)
        except StoreError as exc:
            await ep.send(np.frombuffer(encode_control(error_frame(OP_PUT, exc.code, str(exc))), np.uint8))
            return
        if pending is None:  # duplicate: tell the client there is nothing to send
            await ep.send(np.frombuffer(encode_control(Frame(OP_PUT | RESPONSE)), np.uint8))
            return
        try:
            await ep.send(
                np.frombuffer(encode_control(Frame(OP_PUT | RESPONSE, status=STATUS_READY)), np.uint8)
            )
            if pending.meta.size:
                await ep.recv(np.frombuffer(self.store.pool.view(pending.extent), np.uint8))
        except BaseException:
            abort_endpoint(ep)  # no late write into the extent once it is freed
            self.store.abort_put(pending)
            raise
        try:
            self.store.finish_put(pending)
        except StoreError as exc:
            await ep.send(np.frombuffer(encode_control(error_frame(OP_PUT, exc.code, str(exc))), np.uint8))
            return
        await ep.send(np.frombuffer(encode_control(Frame(OP_PUT | RESPONSE)), np.uint8))

    async def _get(self, ep, frame: Frame) -> None:  # type: ignore[no-untyped-def]
        try:
            obj = await self.store.acquire(frame.key)
        except StoreError as exc:
            await ep.send(np.frombuffer(encode_control(error_frame(OP_GET, exc.code, str(exc))), np.uint8))
            return
        try:
            try:
                if obj.meta.size > frame.payload_len:
                    raise BadRequestError(
                        f"object is {obj.meta.size} B, the reader's buffer {frame.payload_len} B"
                    )
                data = await self.store.read(obj)
            except StoreError as exc:
                await ep.send(
                    np.frombuffer(encode_control(error_frame(OP_GET, exc.code, str(exc))), np.uint8)
                )
                return
            head = Frame(OP_GET | RESPONSE, payload_len=len(data), checksum=obj.meta.checksum)
            await ep.send(np.frombuffer(encode_control(head), np.uint8))
            if len(data):
                await ep.send(np.frombuffer(data, np.uint8))
        except BaseException:
            abort_endpoint(ep)  # the extent may be freed after release: stop any in-flight send first
            raise
        finally:
            self.store.release(obj)
