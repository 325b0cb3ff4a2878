"""Helpers for the KV-events tests (tests/test_kv_events.py and the vLLM suite's test_kv_events_vllm.py): a
master child process that publishes, chains put through the master wire with their tokens, and the
master's own match_prefix to compare a consumer's mirror with."""

from __future__ import annotations

import hashlib
import socket
import time
from collections.abc import Callable
from pathlib import Path

from kvpool.kvstore.client.kv_events import KvEventSubscriber
from kvpool.kvstore.keys import kda_key, mla_key
from kvpool.kvstore.protocol.master_wire import put_start_batch_request
from kvpool.proto import common_pb2, master_pb2

from tests.harness.master_proc import MasterProcess

BLOCK = 4  # tokens per block in these tests (the events' block_size)
FAST = ("--heartbeat-ms", "50", "--node-timeout-ms", "400", "--sweep-ms", "50")


def chain(n: int, seed: str) -> list[bytes]:
    out, prev = [], seed.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        out.append(prev)
    return out


def tokens_of(i: int) -> list[int]:
    return list(range(i * BLOCK, (i + 1) * BLOCK))


def put_chain(
    m: MasterProcess,
    hs: list[bytes],
    checkpoints: tuple[int, ...] = (),
    tenant: str = "",
    tokens: bool = True,
) -> list[common_pb2.ObjectMeta]:
    """One PutStartBatch + PutCommitBatch for a chain's MLA blocks (with their tokens) and checkpoints
    (``checkpoints``: usable block counts, i.e. a checkpoint closing block c-1)."""
    metas, token_ids, parent = [], [], b""
    for i, h in enumerate(hs):
        md = common_pb2.ObjectMeta(
            key=mla_key(h), kind=common_pb2.MLA_BLOCK, size=100, checksum=7, tenant=tenant, parent=parent
        )
        metas.append(md)
        token_ids.append(tokens_of(i) if tokens else [])
        parent = mla_key(h)
        if i + 1 in checkpoints:
            ck = common_pb2.ObjectMeta(
                key=kda_key(h), kind=common_pb2.KDA_CHECKPOINT, size=400, checksum=7, tenant=tenant
            )
            metas.append(ck)
            token_ids.append([])
    started = m.call("PutStartBatch", put_start_batch_request(metas, token_ids=token_ids))
    assert all(started.put_ids) and not started.errors
    committed = m.call("PutCommitBatch", master_pb2.PutCommitBatchRequest(put_ids=started.put_ids))
    assert not committed.errors
    return metas


def master_match(m: MasterProcess, hs: list[bytes], require_checkpoint: bool = True) -> tuple[int, int]:
    reply = m.call(
        "MatchPrefix",
        master_pb2.MatchPrefixRequest(
            block_hashes=hs, require_checkpoint=require_checkpoint, counts_only=True
        ),
    )
    return reply.usable_blocks, reply.mla_run_blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_master(
    tmp_path: Path, *extra: str, pub: str = "tcp://127.0.0.1:0", replay: str = "tcp://127.0.0.1:0"
) -> MasterProcess:
    """A master child process publishing KV events (blocks of :data:`BLOCK` tokens) on ``pub``/``replay``."""
    flags = ("--kv-events", pub, "--kv-events-replay", replay, "--kv-events-block-size", str(BLOCK))
    return MasterProcess(tmp_path, *FAST, *flags, *extra)


def endpoints(m: MasterProcess) -> tuple[str, str]:
    ev = m.child.ready["kv_events"]
    return ev["endpoint"], ev["replay"]


def subscriber(m: MasterProcess, **kw: object) -> KvEventSubscriber:
    pub, replay = endpoints(m)
    sub = KvEventSubscriber(pub, replay, **kw)  # type: ignore[arg-type]
    time.sleep(0.2)  # ZMQ's slow joiner: a SUB sees messages only once its connection is up
    return sub


def settle(sub: KvEventSubscriber, until: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``sub`` until ``until()`` holds (AssertionError after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "the stream did not get there"
        sub.poll(0.05)
