"""What every data-plane backend shares: the bytes it moves (``Payload``), the ``Transport`` interface, the
deadline policy and the socket helpers both ends use.

A transport moves object bytes between a client and a storage node; the master never sees them. The client
picks one per peer (``TransportSelector``). Every wait has a deadline: ``deadline_for(size)`` = a fixed
connect/latency allowance plus the size at a floor rate, so a dead or stalled peer surfaces as
``TransportTimeoutError`` instead of a hang, and a large object is not cut off on a slow link.

An object's bytes are one buffer, or several parts in order (``Payload``). Why parts: a cache unit is a
header, zero padding and tensors. Gluing them into one buffer before a put is a full extra copy of every
byte a prefill pushes (a K3 request: ~770 MB). A put of a ``Payload`` copies each part straight into the
node's pool (shm) or hands the parts to ``sendmsg`` (tcp), hashing on the way as for one buffer; only the
ucx path joins them. The store checksum is the xxh3-64 of the concatenation either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import xxhash
from kvpool.kvstore.errors import CorruptObjectError, ProtocolError, StoreError, TransportTimeoutError
from kvpool.proto import common_pb2

Buffer = bytes | bytearray | memoryview
# ``read_in_place``'s callback: (item index, the object's bytes, valid only during the call)
Visit = Callable[[int, memoryview], None]
# Payload.copy_hashing_into's step: 6.8 GB/s fused copy+hash of 64 MB at 128-256 KB against 6.2 at 512 KB
# and 5.9 at 1 MB on this box (plain copy 8.7): the chunk must still be in L2 when it is hashed
COPY_HASH_CHUNK = 256 << 10


def as_bytes_view(buf: object) -> memoryview:
    """A flat, byte-typed memoryview of bytes / bytearray / numpy / torch (CPU, contiguous) buffers.

    Torch tensors of any dtype (bfloat16 included, which numpy cannot represent) are viewed as bytes."""
    if type(buf).__module__.startswith("torch"):  # a torch.Tensor (torch is loaded if one exists)
        import torch

        tensor = buf.detach()  # type: ignore[attr-defined]
        if not tensor.is_contiguous():
            raise ValueError("tensor must be contiguous")
        if tensor.device.type != "cpu":
            raise ValueError("tensor must be in host memory (copy it to a pinned CPU tensor first)")
        return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())  # shares memory, keeps it alive
    view = memoryview(buf)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise ValueError("buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _copy_hashing_into(hasher: xxhash.xxh3_64, dst: memoryview, src: memoryview) -> None:
    for off in range(0, len(src), COPY_HASH_CHUNK):
        end = min(off + COPY_HASH_CHUNK, len(src))
        dst[off:end] = src[off:end]
        hasher.update(dst[off:end])


class Payload:
    """The parts of one object, in order; ``nbytes`` is the object's size."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: Iterable[object]) -> None:
        views = (as_bytes_view(p) for p in parts)
        self.parts: tuple[memoryview, ...] = tuple(v for v in views if v.nbytes)
        self.nbytes = sum(v.nbytes for v in self.parts)

    @classmethod
    def of(cls, data: object) -> Payload:
        """``data`` itself when it is a Payload, else a one-part Payload over it."""
        return data if isinstance(data, Payload) else cls((data,))

    def slices(self, chunk: int) -> Iterator[memoryview]:
        """The bytes in order, at most ``chunk`` at a time (a slice never spans two parts)."""
        for part in self.parts:
            for start in range(0, len(part), chunk):
                yield part[start : start + chunk]

    def copy_into(self, dst: memoryview) -> None:
        at = 0
        for part in self.parts:
            dst[at : at + len(part)] = part
            at += len(part)

    def copy_hashing_into(self, dst: memoryview) -> int:
        """Copy the parts into ``dst`` and return the xxh3-64 of the concatenation as it landed, in one pass:
        each chunk is hashed from ``dst`` right after it was written, while it is still in cache (vs hashing
        the parts first: a second pass over memory). Hashing the destination also makes the digest describe
        the bytes as stored."""
        hasher = xxhash.xxh3_64()
        at = 0
        for part in self.parts:
            _copy_hashing_into(hasher, dst[at : at + len(part)], part)
            at += len(part)
        return hasher.intdigest()

    def xxh3(self) -> int:
        hasher = xxhash.xxh3_64()
        for part in self.parts:
            hasher.update(part)
        return hasher.intdigest()

    def joined(self) -> memoryview:
        """One contiguous view: the part itself when there is one, else a copy of them all."""
        if len(self.parts) == 1:
            return self.parts[0]
        out = bytearray(self.nbytes)
        self.copy_into(memoryview(out))
        return memoryview(out)


def payload_size(data: object) -> int:
    """Bytes in ``data`` (a buffer or a Payload)."""
    return data.nbytes if isinstance(data, Payload) else as_bytes_view(data).nbytes


@dataclass(frozen=True)
class Deadlines:
    """Deadline policy: ``base_s`` + size / ``floor_rate`` bytes per second; ``connect_s`` for connecting."""

    connect_s: float = 5.0
    base_s: float = 2.0
    floor_rate: float = 100e6

    def for_size(self, size: int) -> float:
        return self.base_s + size / self.floor_rate


DEFAULT_DEADLINES = Deadlines()
HASH_CHUNK = 512 << 10  # receive (and hash) at most this much at a time: the chunk is still in L2
PUT_SEND_CHUNK = 1 << 20  # a tcp put whose checksum is left open is hashed, then sent, this much at a time
RECV_LOWAT = 1 << 20  # a GET's reader is woken once this much of a large payload is queued (SO_RCVLOWAT)
LOWAT_MIN = 256 << 10  # smaller payloads arrive in a few segments: not worth two setsockopt calls
# GET response flag (tcp): the payload is followed by a trailer frame, same op and request id, whose status
# is the node's verdict on the bytes it just streamed (it hashes them chunk by chunk as they leave instead of
# verifying the whole object before the first byte) and whose checksum is the node's digest of them
FLAG_TRAILER = 4


def fill_checksum(meta: common_pb2.ObjectMeta, payload: Payload) -> None:
    """A network put must declare its checksum in the frame: compute it now when it was left to us."""
    if not meta.checksum:
        meta.checksum = payload.xxh3()


def verify_checksum(view: Buffer, expected: int, key: bytes, digest: int | None = None) -> None:
    """``CorruptObjectError`` unless ``view`` hashes to ``expected``; ``digest`` = the xxh3-64 the receiver
    already computed chunk by chunk as the bytes landed (then ``view`` is not read again)."""
    if digest is None:
        digest = xxhash.xxh3_64_intdigest(view)
    if digest != expected:
        raise CorruptObjectError(f"key {key[:8].hex()}… failed its checksum after transfer")


class Transport(ABC):
    """One data-plane backend. Implementations own their connection pools; ``close`` releases them."""

    name: str = "?"

    def __init__(self, deadlines: Deadlines = DEFAULT_DEADLINES) -> None:
        self.deadlines = deadlines
        self.bytes_in = 0
        self.bytes_out = 0

    @abstractmethod
    async def put(
        self, node: common_pb2.NodeEndpoint, put_id: str, meta: common_pb2.ObjectMeta, data: Buffer
    ) -> None:
        """Store ``data`` (``meta.size`` bytes, ``meta.checksum``) on ``node`` under ``put_id``.

        ``meta.checksum == 0``: the checksum is not known yet (the master was told ``checksum_at_commit``);
        the transport computes it, as cheaply as it can (shm: while copying into the pool), and writes it
        into ``meta.checksum`` for the caller's PutCommit. ``batch_put`` does the same per item."""

    @abstractmethod
    async def _get_into(self, location: common_pb2.ObjectLocation, out: memoryview) -> int:
        """Copy the object into ``out`` without verifying; returns its size."""

    async def _get_into_hashed(
        self, location: common_pb2.ObjectLocation, out: memoryview
    ) -> tuple[int, int | None]:
        """``_get_into`` plus the xxh3-64 of the received bytes when the backend hashed them as they landed
        (cache-hot, overlapped with the transfer); None = ``get_into`` hashes ``out`` afterwards."""
        return await self._get_into(location, out), None

    async def get_into(self, location: common_pb2.ObjectLocation, out: Buffer) -> int:
        """Copy the object at ``location`` into ``out`` and verify its checksum; returns the size."""
        view = as_bytes_view(out)
        if len(view) < location.meta.size:
            raise ValueError(f"buffer of {len(view)} B is smaller than the object ({location.meta.size} B)")
        n, digest = await self._get_into_hashed(location, view)
        verify_checksum(view[:n], location.meta.checksum, location.meta.key, digest)
        self.bytes_in += n
        return n

    async def batch_put(
        self, node: common_pb2.NodeEndpoint, items: Sequence[tuple[str, common_pb2.ObjectMeta, Buffer]]
    ) -> list[StoreError | None]:
        """Per-item result: None on success or the typed error. Backends may pipeline."""
        results = await asyncio.gather(*(self.put(node, *item) for item in items), return_exceptions=True)
        return [_as_store_error(r) for r in results]

    async def batch_get_into(
        self, items: Sequence[tuple[common_pb2.ObjectLocation, Buffer]]
    ) -> list[int | StoreError]:
        results = await asyncio.gather(
            *(self.get_into(loc, out) for loc, out in items), return_exceptions=True
        )
        return [r if isinstance(r, int) else _as_store_error(r) for r in results]  # type: ignore[misc]

    async def read_in_place(
        self, locations: Sequence[common_pb2.ObjectLocation], visit: Visit
    ) -> list[Exception | None]:
        """Hand each object's bytes to ``visit(i, view)`` with as few copies as the backend allows; per item
        None, the transport's ``StoreError`` or the exception ``visit`` raised.

        Why: a reader that scatters an object somewhere else (the vLLM connector into paged KV blocks) would
        otherwise copy it twice, once into a buffer here and once out of it. The view is only valid during
        the call, and its bytes are not verified against ``meta.checksum`` first: ``visit`` checks what it
        reads (the connector hashes its payload and compares before copying it anywhere). A backend that
        cannot vouch that the bytes it handed over were the object's for the whole call (shm: the stamp
        changed) reports a ``StaleReadError`` for that item after ``visit`` ran: discard what it wrote.

        This default receives each object into one uninitialised buffer (one copy, the network's), then
        visits it; the shm transport visits the node's pool in place (no copy).
        """
        import numpy as np

        sizes = [loc.meta.size for loc in locations]
        scratch = np.empty(sum(sizes), dtype=np.uint8)  # uninitialised: the receive is its only write
        view = memoryview(scratch)
        outs, offset = [], 0
        for n in sizes:
            outs.append(view[offset : offset + n])
            offset += n
        got = await self.batch_get_into(list(zip(locations, outs, strict=True)))
        results: list[Exception | None] = []
        for i, (r, out) in enumerate(zip(got, outs, strict=True)):
            results.append(r if isinstance(r, StoreError) else visited(visit, i, out))
        return results

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release pooled connections."""


def visited(visit: Visit, i: int, view: memoryview) -> Exception | None:
    """Run one visit; its exception is that item's result."""
    try:
        visit(i, view)
    except Exception as exc:  # the caller's own error, handed back to the caller
        # without its frames: they hold views of the object's bytes (a shm mapping could not close)
        return exc.with_traceback(None)
    return None


def _as_store_error(result: object) -> StoreError | None:
    if result is None:
        return None
    if isinstance(result, StoreError):
        return result
    if isinstance(result, BaseException) and not isinstance(result, Exception):
        raise result
    return StoreError(f"{type(result).__name__}: {result}")


async def recv_exactly_into(loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (``sock_recv_into``, no intermediate copies); EOF → ``ProtocolError``."""
    got = 0
    total = len(view)
    while got < total:
        n = await loop.sock_recv_into(sock, view[got:])
        if n == 0:
            raise ProtocolError(f"connection closed after {got} of {total} bytes")
        got += n


async def recv_hashing_into(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, view: memoryview, lowat: int = 0
) -> int:
    """``recv_exactly_into`` that also returns the xxh3-64 of what landed in ``view``.

    Each chunk is hashed right after it arrives, while it is still in cache and while the kernel keeps
    filling the socket buffer, instead of re-reading the whole object from memory afterwards. Receives are
    capped at ``HASH_CHUNK`` so a chunk is still in L2 when it is hashed.

    ``lowat`` > 0 (a client's GET): a payload of at least ``LOWAT_MIN`` raises the socket's ``SO_RCVLOWAT``
    to ``lowat`` (at most what is still due), so the event loop is woken once per that much queued instead
    of for every few segments; each asyncio wake-up costs tens of microseconds. The watermark goes back to 1
    before returning, so the next frame header wakes the loop as usual.
    """
    hasher = xxhash.xxh3_64()
    got = 0
    total = len(view)
    current = 1
    try:
        while got < total:
            want = min(lowat, total - got) if lowat and total >= LOWAT_MIN else 1
            if want != current:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                current = want
            n = await loop.sock_recv_into(sock, view[got : got + HASH_CHUNK])
            if n == 0:
                raise ProtocolError(f"connection closed after {got} of {total} bytes")
            hasher.update(view[got : got + n])
            got += n
    finally:
        if current != 1:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
    return hasher.intdigest()


async def send_parts(loop: asyncio.AbstractEventLoop, sock: socket.socket, parts: Sequence[Buffer]) -> None:
    """Send ``parts`` back to back, starting with one ``sendmsg`` (writev) of all of them.

    A header and its payload then leave in one system call (and one TCP segment train) instead of two
    ``sock_sendall`` calls; whatever the socket buffer could not take goes out with ``sock_sendall``.
    """
    try:
        sent = sock.sendmsg(parts)
    except (BlockingIOError, InterruptedError):
        sent = 0
    for part in parts:
        size = len(part)
        if sent >= size:
            sent -= size
            continue
        await loop.sock_sendall(sock, memoryview(part)[sent:] if sent else part)
        sent = 0


async def send_hashing(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    head: bytes,
    data: memoryview | Payload,
    chunk: int,
    trailer: Callable[[int], bytes],
) -> int:
    """Send ``head``, then ``data`` ``chunk`` bytes at a time, each hashed right before it leaves (the send
    then copies bytes the hash just pulled into cache, and the first byte does not wait for a whole-object
    hash), then ``trailer(digest)``; returns the digest. The last chunk leaves together with the trailer.
    Both ends of the tcp data plane stream this way: a node's GET reply, a client's PUT whose checksum
    was left open."""
    hasher = xxhash.xxh3_64()
    parts: list[bytes | memoryview] = [head]
    hashed_one = False
    for piece in Payload.of(data).slices(chunk):
        if hashed_one:  # the previous piece leaves now; the last one goes with the trailer
            await send_parts(loop, sock, parts)
            parts = []
        hasher.update(piece)
        parts.append(piece)
        hashed_one = True
    digest = hasher.intdigest()
    parts.append(trailer(digest))
    await send_parts(loop, sock, parts)
    return digest


async def with_deadline(coro, seconds: float, what: str):  # type: ignore[no-untyped-def]
    """Await ``coro`` within ``seconds`` or raise ``TransportTimeoutError`` naming ``what``.

    ``asyncio.timeout`` runs ``coro`` in the caller's task; ``wait_for`` (3.11) wraps it in a new task,
    which costs a task and an extra loop iteration on every transfer."""
    try:
        async with asyncio.timeout(seconds):
            return await coro
    except TimeoutError:
        raise TransportTimeoutError(f"{what}: no progress within {seconds:.1f} s") from None
