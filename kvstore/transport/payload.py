"""An object's bytes as the caller holds them: one buffer, or several parts in order (``Payload``).

Why parts: a cache unit is a header, zero padding and tensors. Gluing them into one buffer before a put is a
full extra copy of every byte a prefill pushes (a K3 request: ~770 MB). A put of a ``Payload`` copies each
part straight into the node's pool (shm) or hands the parts to ``sendmsg`` (tcp), hashing on the way as for
one buffer; only the ucx path joins them. The store checksum is the xxh3-64 of the concatenation either way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import xxhash

Buffer = bytes | bytearray | memoryview
# copy_hashing's step: 6.8 GB/s fused copy+hash of 64 MB at 128-256 KB against 6.2 at 512 KB and 5.9 at
# 1 MB on this box (plain copy 8.7): the chunk must still be in L2 when it is hashed
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


def copy_hashing(dst: memoryview, src: memoryview) -> int:
    """Copy ``src`` into ``dst`` and return the xxh3-64 of what landed, in one pass: each chunk is hashed
    from ``dst`` right after it was written, while it is still in cache (vs hashing ``src`` first: a second
    pass over memory). Hashing the destination also makes the digest describe the bytes as stored."""
    hasher = xxhash.xxh3_64()
    _copy_hashing_into(hasher, dst, src)
    return hasher.intdigest()


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
        """``copy_hashing`` over every part: the xxh3-64 of the concatenation as it landed in ``dst``."""
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
