"""Batched two-phase puts: a whole push (one prefill's MLA blocks and checkpoint) in one control exchange
each way instead of one per object.

Each item gets exactly what the single call would answer (same core method, same order), or its own
``ItemError``: one bad item (too big, a tenant over quota, an unknown kind) never fails the others. A key that
appears twice in one batch is refused on its second appearance with ObjectExistsError, so the writer learns
that one of its own items was dropped instead of mistaking it for another writer's put in progress.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from kvpool.kvstore.errors import BadRequestError, ObjectExistsError, StoreError
from kvpool.proto import master_pb2

R = TypeVar("R")


class MasterCore(Protocol):
    """What a batch needs of ``kvpool.kvstore.master.core.MasterCore`` (which calls in here)."""

    def put_start(self, req: master_pb2.PutStartRequest) -> master_pb2.PutStartReply: ...

    def put_commit(self, req: master_pb2.PutCommitRequest) -> master_pb2.PutCommitReply: ...

    def count(self, name: str, n: int = 1) -> None: ...


_OK = master_pb2.ItemError()


def _each(call: Callable[[], R]) -> tuple[R | None, master_pb2.ItemError]:
    try:
        return call(), _OK
    except StoreError as exc:
        return None, master_pb2.ItemError(code=exc.code, message=f"{type(exc).__name__}: {exc}")


def put_start_batch(core: MasterCore, req: master_pb2.PutStartBatchRequest) -> master_pb2.PutStartBatchReply:
    out = master_pb2.PutStartBatchReply()
    seen: set[bytes] = set()
    for item in req.items:
        if item.meta.key in seen:
            reply, err = (
                None,
                master_pb2.ItemError(code=ObjectExistsError.code, message="key appears twice in one batch"),
            )
        else:
            seen.add(item.meta.key)
            reply, err = _each(lambda item=item: core.put_start(item))
        out.items.append(reply if reply is not None else master_pb2.PutStartReply())
        out.errors.append(err)
    core.count("put_batches")
    return out


def put_commit_batch(
    core: MasterCore, req: master_pb2.PutCommitBatchRequest
) -> master_pb2.PutCommitBatchReply:
    out = master_pb2.PutCommitBatchReply()
    if req.checksums and len(req.checksums) != len(req.put_ids):
        raise BadRequestError(f"{len(req.checksums)} checksums for {len(req.put_ids)} put ids")
    sums = list(req.checksums) or [0] * len(req.put_ids)
    for put_id, checksum in zip(req.put_ids, sums, strict=True):
        commit = master_pb2.PutCommitRequest(put_id=put_id, checksum=checksum)
        _, err = _each(lambda commit=commit: core.put_commit(commit))
        out.errors.append(err)
    return out
