"""The master's KV events decode with vLLM's own classes (``vllm.distributed.kv_events``): every message a
real master publishes (live, replayed and snapshot) goes through vLLM's msgspec decoder of ``KVEventBatch``,
so a consumer written against vLLM's format reads kvpool's pool as it reads an engine's cache.

Covers each event kind and medium (a DRAM pool that demotes to SSD: ``CPU`` and ``STORAGE``), the hybrid
group (``group_idx`` 1, ``kv_cache_spec_kind`` "mamba", vLLM's kind for a recurrent state), tokens, the
tenant salt in ``extra_keys`` and the 64-bit integer hashes of ``--kv-events-hashes int64``.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import zmq
from kvpool.kvstore.keys import kda_key
from kvpool.kvstore.protocol.kv_events_wire import decode_seq, encode_seq
from kvpool.proto import master_pb2
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from tests.harness.kv_events import BLOCK, chain, endpoints, put_chain, start_master, tokens_of
from tests.harness.master_proc import ProbeNode


def _drain(sock: zmq.Socket, decoder: msgspec.msgpack.Decoder, quiet_ms: int = 300) -> list[KVEventBatch]:
    out = []
    while sock.poll(quiet_ms):
        tpc, seq, payload = sock.recv_multipart()
        assert tpc.startswith(b"kvpool/0/") and decode_seq(seq) >= 0
        out.append(decoder.decode(payload))
    return out


def test_every_message_decodes_with_vllms_kv_event_batch(tmp_path: Path) -> None:
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    # DRAM 1,000 B per node with an SSD: past the watermark the oldest blocks are demoted (CPU -> STORAGE)
    master = start_master(tmp_path, "--kv-events-hashes", "int64", "--kv-events-buffer", "2")
    node = ProbeNode("n0", master, dram=1_000, ssd=100_000)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoints(master)[0])
    try:
        node.register()
        node.start_heartbeats()
        # the SUB's subscription is live once a message reaches it: the idle stream's heartbeat (an empty
        # batch every second), which decodes with vLLM's class too (ZMQ drops what a PUB sends before a SUB
        # has joined, so a fixed sleep would race the join)
        assert sub.poll(10_000), "no heartbeat reached the subscriber"
        tpc, _, payload = sub.recv_multipart()
        assert tpc.startswith(b"kvpool/0/") and decoder.decode(payload).events == []
        first = chain(5, "first")
        put_chain(master, first)  # 500 B of DRAM
        hs = chain(5, "vllm")
        put_chain(master, hs, checkpoints=(4,), tenant="salt-a")  # 900 B more: the first chain is demoted
        master.call("Remove", master_pb2.RemoveRequest(keys=[kda_key(hs[3])]))
        live = _drain(sub, decoder)
        events = [ev for batch in live for ev in batch.events]
        assert all(batch.data_parallel_rank == 0 for batch in live)
        stored = [e for e in events if isinstance(e, BlockStored)]
        removed = [e for e in events if isinstance(e, BlockRemoved)]
        assert stored and removed
        ints = {int.from_bytes(h[-8:], "big") for h in first + hs}
        assert all(isinstance(h, int) and h in ints for e in stored + removed for h in e.block_hashes)
        mla = [e for e in stored if e.group_idx == 0 and e.medium == MEDIUM_CPU and e.extra_keys]
        assert mla and mla[0].block_size == BLOCK and mla[0].kv_cache_spec_kind == "mla_attention"
        assert mla[0].token_ids[:BLOCK] == tokens_of(0) and mla[0].extra_keys[0] == ("salt-a",)
        ckpt = [e for e in stored if e.group_idx == 1]
        assert (
            ckpt
            and ckpt[0].kv_cache_spec_kind == "mamba"
            and ckpt[0].block_hashes == [int.from_bytes(hs[3][-8:], "big")]
        )
        assert any(e.medium == MEDIUM_STORAGE for e in stored), "a demotion is stored on STORAGE"
        assert any(e.group_idx == 1 for e in removed), "the removed checkpoint"
        # the replay socket: a stale start (buffer of 2) gets the snapshot, which decodes the same way
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoints(master)[1])
        dealer.send_multipart([b"", encode_seq(0)])
        snap: list[KVEventBatch] = []
        while True:
            assert dealer.poll(5000)
            _, _, seq, payload = dealer.recv_multipart()
            if decode_seq(seq) == -1:
                break
            snap.append(decoder.decode(payload))
        snap_events = [ev for batch in snap for ev in batch.events]
        assert isinstance(snap_events[0], AllBlocksCleared)
        blocks = {
            h for e in snap_events if isinstance(e, BlockStored) and e.group_idx == 0 for h in e.block_hashes
        }
        assert blocks == ints, "the snapshot holds every block still indexed"
        dealer.close(0)
    finally:
        sub.close(0)
        node.close()
        master.kill()
