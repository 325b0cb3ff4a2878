"""KvEventSubscriber: a reference consumer of the master's KV-event stream (``--kv-events``).

What an outside router has to do to mirror kvpool's pool from the stream, written once so the tests, the
bench and the Dynamo check use the same logic (and so the docs' recovery protocol is code, not prose):

* subscribe to the PUB address; track the topic (``PREFIX/SHARD/INCARNATION``) and the sequence;
* a new topic is a new master life: forget everything, expect sequence 0 (a replay from 0 if it was missed);
* a sequence gap: ask the replay socket for the first missing one; the answer is either the missing batches
  or a snapshot (topic ``.../snapshot``, tagged with the sequence it reflects), then ``-1``;
* apply events: ``BlockStored`` adds its hashes to its group, ``BlockRemoved`` drops them,
  ``AllBlocksCleared`` empties the mirror;
* answer :meth:`match_prefix` with the joint rule (an MLA run is usable up to the last checkpoint in it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import zmq
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.protocol.kv_events_wire import (
    END_SEQ,
    GROUP_CHECKPOINT,
    GROUP_MLA,
    SNAPSHOT_SUFFIX,
    decode_batch,
    decode_seq,
    encode_seq,
)


class KvEventsReplayTimeoutError(StoreError):
    """The replay socket did not finish its answer in time."""


@dataclass(slots=True)
class SubscriberStats:
    messages: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0
    snapshots: int = 0
    incarnations: int = 0
    lags_s: list[float] = field(default_factory=list)  # receive time - batch ts, live messages only


class KvEventSubscriber:
    """Mirror of one master's (shard's) blocks, kept from its event stream. Not thread-safe."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic_prefix: str = "kvpool",
        record_lag: bool = False,
        rcvhwm: int = 100_000,
    ) -> None:
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, rcvhwm)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic_prefix.encode())
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._replay = self._replay_socket() if replay_endpoint is not None else None
        self.record_lag = record_lag
        self.topic: bytes | None = None
        self.last_seq = -1
        self.blocks: dict[int, dict[bytes | int, str | None]] = {GROUP_MLA: {}, GROUP_CHECKPOINT: {}}
        self.block_index: dict[bytes | int, int] = {}  # MLA hash -> its logical block index, when published
        self.token_ids: dict[bytes | int, list[int]] = {}  # MLA hash -> its tokens, when published
        self.stats = SubscriberStats()

    def _replay_socket(self) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._replay_endpoint)
        return sock

    def _renew_replay_socket(self) -> None:
        """A replay that did not read its whole answer (given up, or ended by an error) loses its socket, so
        that the rest of that answer (or a request still queued to a peer that is not reading) is never
        taken for the next replay's. The new socket is made before the old one goes."""
        fresh = self._replay_socket()
        assert self._replay is not None
        self._replay.close(0)
        self._replay = fresh

    def close(self) -> None:
        self._sub.close(0)
        if self._replay is not None:
            self._replay.close(0)
        self._ctx.term()

    # -- receiving -------------------------------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.1, max_messages: int = 1_000_000) -> int:
        """Receive and apply what arrives within ``timeout_s`` (returns after the first idle gap of it);
        recovers gaps through the replay socket. Returns the messages applied."""
        done = 0
        deadline = time.monotonic() + timeout_s
        while done < max_messages:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sub.poll(max(1, int(left * 1000))):
                break
            while done < max_messages:
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_live(frames)
                done += 1
        return done

    def _on_live(self, frames: list[bytes]) -> None:
        now = time.time()
        tpc, seq = frames[0], decode_seq(frames[1])
        if tpc != self.topic:  # a new master life (or the first message we see)
            self._reset(tpc)
            if seq != 0:  # its beginning was missed
                self.stats.gaps += 1
                self.replay(0)
                if seq <= self.last_seq:
                    return
        if seq <= self.last_seq:
            return  # already had it (a replay covered it)
        if seq != self.last_seq + 1:
            self.stats.gaps += 1
            self.replay(self.last_seq + 1)
            if seq <= self.last_seq:
                return  # the replay covered it; else (no replay socket) take what comes
        batch = decode_batch(frames[2])
        if self.record_lag:
            self.stats.lags_s.append(now - batch.ts)
        self._apply(batch.events)
        self.last_seq = seq
        self.stats.messages += 1

    def _reset(self, tpc: bytes) -> None:
        self.topic = tpc
        self.last_seq = -1
        self._clear()
        self.stats.incarnations += 1

    def _clear(self) -> None:
        for group in self.blocks.values():
            group.clear()
        self.block_index.clear()
        self.token_ids.clear()

    def replay(self, start: int, timeout_s: float = 10.0) -> None:
        """Ask for every batch from ``start`` (or the snapshot) and apply the answer."""
        if self._replay is None:
            return
        self.stats.replays += 1
        try:
            self._replay_answer(start, timeout_s)
        except BaseException:  # a timeout, a malformed answer, an interrupt: the rest must not linger
            self._renew_replay_socket()
            raise

    def _replay_answer(self, start: int, timeout_s: float) -> None:
        """One replay's request and its whole answer, applied as it arrives."""
        assert self._replay is not None
        # never blocks: a socket carries at most this one request, since one whose answer was not read
        # whole is replaced (``replay``)
        self._replay.send_multipart((b"", encode_seq(start)))
        deadline = time.monotonic() + timeout_s
        in_snapshot = False
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._replay.poll(max(1, int(left * 1000))):
                raise KvEventsReplayTimeoutError(f"replay from {start}: no complete answer in {timeout_s}s")
            frames = self._replay.recv_multipart()
            _, tpc, seq_frame, payload = frames
            seq = decode_seq(seq_frame)
            if seq == END_SEQ:
                return
            events = decode_batch(payload).events
            if tpc.endswith(SNAPSHOT_SUFFIX):
                if not in_snapshot:
                    in_snapshot = True
                    self.stats.snapshots += 1
                    self.topic = tpc[: -len(SNAPSHOT_SUFFIX)]
                self._apply(events)  # begins with AllBlocksCleared
                self.last_seq = seq
                continue
            if tpc == self.topic and seq == self.last_seq + 1:
                self._apply(events)
                self.last_seq = seq

    def _apply(self, events: list[dict[str, Any]]) -> None:
        self.stats.events += len(events)
        for ev in events:
            kind = ev["type"]
            if kind == "BlockStored":
                group = self.blocks.setdefault(ev.get("group_idx") or 0, {})
                hashes = ev["block_hashes"]
                for h in hashes:
                    group[h] = ev["medium"]
                if ev.get("group_idx", 0) == GROUP_MLA:
                    first = ev.get("block_index")
                    tokens, size = ev["token_ids"], ev["block_size"]
                    for i, h in enumerate(hashes):
                        if first is not None:
                            self.block_index[h] = first + i
                        if tokens:
                            self.token_ids[h] = tokens[i * size : (i + 1) * size]
            elif kind == "BlockRemoved":
                group = self.blocks.setdefault(ev.get("group_idx") or 0, {})
                for h in ev["block_hashes"]:
                    group.pop(h, None)
                    if ev.get("group_idx", 0) == GROUP_MLA:
                        self.block_index.pop(h, None)
                        self.token_ids.pop(h, None)
            else:
                self._clear()

    # -- answering -------------------------------------------------------------------------------------------
    def match_prefix(self, hashes: list[bytes | int], require_checkpoint: bool = True) -> tuple[int, int]:
        """``(usable_blocks, mla_run_blocks)`` by the joint rule, from the mirror alone."""
        mla, ckpt = self.blocks[GROUP_MLA], self.blocks[GROUP_CHECKPOINT]
        run = 0
        usable = 0
        for h in hashes:
            if h not in mla:
                break
            run += 1
            if h in ckpt:
                usable = run
        return (usable if require_checkpoint else run), run
