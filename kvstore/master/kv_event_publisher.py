"""KvEventPublisher: the master's KV-event stream (vLLM's format, ``kvstore/protocol/kv_events_wire``) on a
ZMQ PUB socket, with a replay ROUTER socket, a replay buffer and snapshots. Off unless ``--kv-events``.

Why a thread and a bounded queue: the master is one event loop serving every call, and a router that reads
slowly (or not at all) must never slow it down. The loop's side (:meth:`submit`, called once per loop pass
by the core's :class:`~kvpool.kvstore.master.kv_event_recorder.KvEventRecorder`) only numbers the pass's items
and puts them on a queue; the publisher thread builds the events, encodes and sends them, keeps the last
``buffer_batches`` encoded batches for replay and answers replay requests. When the queue is full the batch
is dropped and counted (``kv_events_dropped_batches``) but its sequence number stays used, so every consumer
sees a gap and recovers it the one way that works for a batch nobody has: the snapshot. The PUB socket's
high-water mark (``hwm``) drops messages for a subscriber that does not read, per subscriber, inside ZMQ; the
subscriber sees a sequence gap and asks for a replay.

Recovery, for a consumer that missed sequence s (a gap) or joins late:

* it sends ``s`` to the replay socket; if every batch from ``s`` on is still buffered it gets them, then
  ``-1``;
* otherwise (overwritten, dropped, or of an earlier life) it gets the **snapshot**: the whole index as
  stored events, dumped on the loop :data:`SNAPSHOT_SLICE` objects per pass (calls are served in between),
  tagged with the last sequence ``S`` before the dump began and sent on topic ``.../snapshot`` as batches
  that start with ``AllBlocksCleared``; then every batch after ``S`` (they carry whatever changed while the
  dump ran), then ``-1``. A consumer applies all of it in order and continues with live batches;
* the **incarnation** (the core's instance id and HA epoch, in the topic) changes with every new core: a
  restart or a new HA leader. Sequences restart at 0 and batch 0 is ``AllBlocksCleared``, so even a
  consumer that ignores topics starts over;
* an idle stream sends an empty batch every ``heartbeat_ms``: a consumer that missed the new life's batch
  0 (ZMQ's subscriber reconnects after its publisher restarted) or the last batches before a quiet spell
  sees the new topic or the gap within that time.

A replay request that is not ``[identity, b"", 8-byte sequence]`` is ignored and counted
(``kv_events_replay_malformed``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
from kvpool.kvstore.master.kv_event_recorder import Item, KvEventRecorder, items_to_events, snapshot_order
from kvpool.kvstore.master.kv_events_config import KvEventsConfig
from kvpool.kvstore.protocol.kv_events_wire import (
    END_SEQ,
    SNAPSHOT_SUFFIX,
    encode_batch,
    encode_seq,
    topic,
)

if TYPE_CHECKING:
    from kvpool.kvstore.master.core import MasterCore

log = logging.getLogger(__name__)

SNAPSHOT_BLOCKS_PER_MESSAGE = 4096  # one snapshot message's stored blocks (a 1 M-object index: 245 messages)
SNAPSHOT_SLICE = 500  # objects dumped per loop pass (a few ms): calls are served between slices
SNAPSHOT_TRIES = 3  # a dump whose following batches are no longer all buffered is taken again this often
POLL_S = 0.02  # how long the thread waits for work before it looks at the replay socket again
# A busy event loop holds the GIL until the interpreter asks it to switch (5 ms by default): the publisher
# thread, woken by a batch, waits that long per handoff, which is the lag consumers see under load. 1 ms
# keeps that under the lag goal; the loop pays a few more GIL handoffs (docs/measurements/kv_events.md).
SWITCH_INTERVAL_S = float(os.environ.get("KVPOOL_KV_EVENTS_SWITCH_S", "0.001"))


@dataclass(slots=True)
class _Batch:
    topic: bytes
    seq: int
    ts: float
    items: list[Item]


@dataclass(slots=True)
class _Snapshot:
    client: bytes
    start: int  # the sequence the client asked for
    seq: int  # the last sequence before the dump began: batches after it are replayed after the dump
    topic: bytes
    items: list[Item]
    tries: int = 0


@dataclass(slots=True)
class _SnapshotJob:
    client: bytes
    start: int
    seq: int  # the last sequence before the dump began
    recorder: KvEventRecorder
    keys: list[bytes]
    tries: int
    done: int = 0
    items: list[Item] = field(default_factory=list)


@dataclass(slots=True)
class _Reset:
    topic: bytes


class KvEventPublisher:
    """One per master process; :meth:`attach` each core it serves (a new one per HA election)."""

    def __init__(self, config: KvEventsConfig, shard: int = 0) -> None:
        config.validate()
        self.config = config
        self.shard = shard
        self.endpoint = ""  # bound addresses (after start)
        self.replay_endpoint: str | None = None
        self.incarnation = ""
        self._topic = b""
        self._next_seq = 0  # loop side: the next batch's number
        self._seq_at_beat = -1
        self._heartbeat: asyncio.TimerHandle | None = None
        self._queue: queue.SimpleQueue[_Batch | _Snapshot | _Reset | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._recorder: KvEventRecorder | None = None
        self._thread: threading.Thread | None = None
        self._ctx: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.Socket[Any] | None = None
        # thread side
        self._buffer: deque[tuple[int, bytes, bytes]] = deque(
            maxlen=config.buffer_batches
        )  # seq, topic, payload
        self._published_topic = b""
        # counters: each written by one thread only (ints; readers take a consistent-enough copy)
        self._loop_counts = {
            "kv_events_dropped_batches": 0,
            "kv_events_dropped_blocks": 0,
            "kv_events_batches": 0,
        }
        self._thread_counts = {
            "kv_events_published_batches": 0,
            "kv_events_published_blocks": 0,
            "kv_events_replay_requests": 0,
            "kv_events_replayed_batches": 0,
            "kv_events_snapshots": 0,
            "kv_events_snapshot_blocks": 0,
            "kv_events_snapshot_retries": 0,
            "kv_events_replay_malformed": 0,
            "kv_events_publish_errors": 0,
        }

    # -- loop side -------------------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._loop is not None

    @property
    def topic(self) -> str:
        """The current incarnation's topic (``PREFIX/SHARD/INCARNATION``)."""
        return self._topic.decode()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Bind the sockets (raises ``zmq.ZMQError`` if an address is taken) and start the thread."""
        self._loop = loop
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _bind(self._pub, self.config.endpoint)
        if self.config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay answer is never cut short
            self.replay_endpoint = _bind(self._replay, self.config.replay_endpoint)
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        if self.config.heartbeat_ms:
            self._heartbeat = loop.call_later(self.config.heartbeat_ms / 1000.0, self._beat)
        log.info("kv events on %s (replay %s)", self.endpoint, self.replay_endpoint)

    def attach(self, core: MasterCore) -> None:
        """Publish ``core``'s index from now on: a new incarnation, sequences from 0, batch 0 cleared."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("KvEventPublisher.attach before start")
        if self._recorder is not None:
            self._recorder.flush()  # the old core's last changes belong to the old incarnation
        self.incarnation = f"{core.instance}.{core.epoch}"
        self._topic = topic(self.config.topic_prefix, self.shard, self.incarnation)
        self._next_seq = 0
        self._queue.put(_Reset(self._topic))
        self._recorder = KvEventRecorder(
            core.index,
            self.submit,
            loop,
            shared_medium=self.config.shared_medium,
            keep_tokens=self.config.keep_tokens,
            counters=self.counters,
        )
        core.events = self._recorder
        self._recorder.cleared()

    def _beat(self) -> None:
        """An empty batch when nothing was sent for a heartbeat period (liveness, incarnation, last seq)."""
        if self._next_seq == self._seq_at_beat:
            self.submit([])
        self._seq_at_beat = self._next_seq
        assert self._loop is not None
        self._heartbeat = self._loop.call_later(self.config.heartbeat_ms / 1000.0, self._beat)

    def submit(self, items: list[Item]) -> None:
        """One loop pass's items become batch ``seq`` (never blocks: a full queue drops and counts it)."""
        seq = self._next_seq
        self._next_seq += 1
        self._loop_counts["kv_events_batches"] += 1
        if self._queue.qsize() >= self.config.queue_batches:
            self._loop_counts["kv_events_dropped_batches"] += 1
            self._loop_counts["kv_events_dropped_blocks"] += len(items)
            return
        self._queue.put(_Batch(self._topic, seq, time.time(), items))

    def _snapshot_for(self, client: bytes, start: int, tries: int = 0) -> None:
        """On the loop: dump the index for one replay client, :data:`SNAPSHOT_SLICE` objects per loop pass
        so the master keeps serving calls in between (see the module docstring for why that is exact)."""
        recorder = self._recorder
        if recorder is None:
            return
        recorder.flush()  # everything before the dump has a number: the dump starts after ``seq``
        job = _SnapshotJob(client, start, self._next_seq - 1, recorder, recorder.snapshot_keys(), tries)
        self._snapshot_step(job)

    def _snapshot_step(self, job: _SnapshotJob) -> None:
        if job.recorder is not self._recorder:
            return  # a new incarnation began meanwhile: the client sees its topic and starts over
        job.items += job.recorder.dump_items(job.keys[job.done : job.done + SNAPSHOT_SLICE])
        job.done += SNAPSHOT_SLICE
        if job.done < len(job.keys):
            assert self._loop is not None
            self._loop.call_soon(self._snapshot_step, job)
            return
        job.recorder.flush()  # the last slice's pass: its changes are numbered before the snapshot goes out
        self._queue.put(
            _Snapshot(job.client, job.start, job.seq, self._topic, snapshot_order(job.items), job.tries)
        )

    def counters(self) -> dict[str, int]:
        """For the master's Stats: batches and blocks published, dropped, replayed, snapshots, malformed."""
        out = {**self._loop_counts, **self._thread_counts}
        out["kv_events_queue_depth"] = self._queue.qsize()
        return out

    async def close(self, timeout_s: float = 1.0) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._recorder is not None:
            self._recorder.flush()
        if self._thread is not None:
            self._queue.put(None)
            await asyncio.to_thread(self._thread.join, timeout_s)
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        if self._ctx is not None:
            self._ctx.term()

    # -- publisher thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                work = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                work = False
            if work is None:
                return
            try:
                if isinstance(work, _Batch):
                    self._publish(work)
                elif isinstance(work, _Snapshot):
                    self._send_snapshot(work)
                elif isinstance(work, _Reset):
                    self._buffer.clear()
                    self._published_topic = work.topic
                while self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
            except Exception:  # keep publishing: one bad batch must not end the stream
                self._thread_counts["kv_events_publish_errors"] += 1
                log.exception("kv events: publishing failed")

    def _encode(self, ts: float, items: list[Item]) -> tuple[bytes, int]:
        cfg = self.config
        events, blocks = items_to_events(
            items, block_size=cfg.block_size, hash_format=cfg.hash_format, shared_medium=cfg.shared_medium
        )
        return encode_batch(ts, events, self.shard), blocks

    def _publish(self, batch: _Batch) -> None:
        assert self._pub is not None
        payload, blocks = self._encode(batch.ts, batch.items)
        seq = encode_seq(batch.seq)
        self._pub.send_multipart((batch.topic, seq, payload), copy=True)  # never blocks: PUB drops at its hwm
        self._buffer.append((batch.seq, batch.topic, payload))
        self._thread_counts["kv_events_published_batches"] += 1
        self._thread_counts["kv_events_published_blocks"] += blocks

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            self._thread_counts["kv_events_replay_malformed"] += 1
            return
        client, start = frames[0], int.from_bytes(frames[2], "big", signed=True)
        if start < 0:
            self._thread_counts["kv_events_replay_malformed"] += 1
            return
        self._thread_counts["kv_events_replay_requests"] += 1
        buffered = self._buffered_from(start)
        if buffered is None:  # not all of it is here any more: the snapshot, built on the loop
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._snapshot_for, client, start)
            return
        for seq, tpc, payload in buffered:
            self._replay.send_multipart((client, b"", tpc, encode_seq(seq), payload))
        self._thread_counts["kv_events_replayed_batches"] += len(buffered)
        self._replay.send_multipart((client, b"", b"", encode_seq(END_SEQ), b""))

    def _buffered_from(self, start: int) -> list[tuple[int, bytes, bytes]] | None:
        """Every buffered batch from ``start`` on, if they are all there without a gap; else None."""
        buf = self._buffer
        if not buf:
            return None if start > 0 else []
        last = buf[-1][0]
        if start > last:
            return []  # nothing published after it yet: the live stream has the rest
        first = buf[0][0]
        if start < first:
            return None
        out = [b for b in buf if b[0] >= start]
        if out[0][0] != start or out[-1][0] - start + 1 != len(out):
            return None  # a dropped batch in between
        return out

    def _send_snapshot(self, snap: _Snapshot) -> None:
        """The dump (topic ``.../snapshot``, sequence ``snap.seq``), then every batch published after
        ``snap.seq``, then -1. The dump took several loop passes, so objects changed while it ran may appear
        in it as they were before; the batches after ``snap.seq`` carry exactly those changes, and applying
        them in order on top of the dump gives the index as it is (each event sets a block's state)."""
        assert self._replay is not None
        after = [b for b in self._buffer if b[0] > snap.seq and b[1] == snap.topic]
        whole = not after or (after[0][0] == snap.seq + 1 and after[-1][0] - snap.seq == len(after))
        if not whole and snap.tries + 1 < SNAPSHOT_TRIES:  # some were dropped or overwritten: dump again
            assert self._loop is not None
            self._thread_counts["kv_events_snapshot_retries"] += 1
            self._loop.call_soon_threadsafe(self._snapshot_for, snap.client, snap.start, snap.tries + 1)
            return
        stopic = snap.topic + SNAPSHOT_SUFFIX
        seq = encode_seq(snap.seq)
        items = snap.items
        ts = time.time()
        blocks = 0
        step = SNAPSHOT_BLOCKS_PER_MESSAGE
        for i in range(0, max(len(items), 1), step):
            payload, n = self._encode(ts, items[i : i + step])
            blocks += n
            self._replay.send_multipart((snap.client, b"", stopic, seq, payload))
        for s, tpc, payload in after:
            self._replay.send_multipart((snap.client, b"", tpc, encode_seq(s), payload))
        self._replay.send_multipart((snap.client, b"", b"", encode_seq(END_SEQ), b""))
        self._thread_counts["kv_events_snapshots"] += 1
        self._thread_counts["kv_events_snapshot_blocks"] += blocks
        self._thread_counts["kv_events_replayed_batches"] += len(after)


def _bind(sock: zmq.Socket[Any], endpoint: str) -> str:
    """Bind; a tcp port of 0 picks a free one. Returns the bound address (``tcp://*`` reads as 0.0.0.0)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-2] + ":*"
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)
