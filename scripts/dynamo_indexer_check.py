"""Does NVIDIA Dynamo's standalone KV indexer, fed only kvpool's events, agree with kvpool's match_prefix?

A consumer nobody here wrote (``python -m dynamo.indexer`` from the registry's ``ai-dynamo-runtime`` 1.6.1,
run from its own venv) subscribes to a real ``kvpool store master --kv-events ... --kv-events-hashes int64``
(Dynamo takes only integer hashes). The first ``--requests`` requests of the bundled conversation trace are
replayed as a prefill would: each Mooncake block id becomes one block of 64 token ids (the same id, the same
tokens), hashed into kvpool's chain (``cache/hashing.py``); the blocks the master does not have are put with
their tokens, with a checkpoint every 8 blocks and at the prompt's last full block. The node's DRAM is small,
so the master evicts and the stream carries removals too. Every ``--phase`` requests, once the stream is
quiet, the indexer's ``/query`` (token ids) and kvpool's ``MatchPrefix`` answer the same prompts (the phase's
and the next phase's): Dynamo's ``longest_matched`` tokens / 64 must equal kvpool's MLA run (Dynamo drops the
recurrent group, so it answers the run, not the joint rule). The reference subscriber
(``kvstore/client/kv_events.py``) answers the joint rule from the same stream; it is compared too.

    scripts/dynamo_indexer_check.sh            # makes /tmp/dynvenv if needed, then runs this
    .venv/bin/python scripts/dynamo_indexer_check.py --dynamo-python /tmp/dynvenv/bin/python --requests 400

Prints a table and one JSON line; exit status 1 if any answer disagrees.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvpool.cache.hashing import hash_blocks, root_hash  # noqa: E402
from kvpool.kvstore.client.kv_events import KvEventSubscriber  # noqa: E402
from kvpool.kvstore.keys import kda_key, mla_key  # noqa: E402
from kvpool.kvstore.protocol.kv_events_wire import HashFormat, external_hash  # noqa: E402
from kvpool.kvstore.protocol.master_wire import put_start_batch_request  # noqa: E402
from kvpool.proto import common_pb2, master_pb2  # noqa: E402
from kvpool.workloads.trace import bundled_trace, read_mooncake  # noqa: E402

from tests.harness.kv_events import free_port  # noqa: E402
from tests.harness.master_proc import MasterProcess, ProbeNode  # noqa: E402

BLOCK = 64
CKPT_EVERY = 8
MLA_BYTES, KDA_BYTES = 1_000, 4_000


def tokens_of(hash_ids: list[int]) -> list[int]:
    return [(h * 7919 + j * 104729) % 150_000 for h in hash_ids for j in range(BLOCK)]


def http(url: str, body: dict[str, Any] | None = None) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read() or b"null")


def dynamo_run(port: int, tokens: list[int]) -> int:
    got = http(f"http://127.0.0.1:{port}/query", {"token_ids": tokens, "model_name": "default"})
    inst = got.get("instances", {}).get("1")
    return 0 if inst is None else int(inst["longest_matched"]) // BLOCK


def put_missing(m: MasterProcess, hs: list[bytes], tokens: list[int], have: int) -> int:
    metas, token_ids = [], []
    for i in range(have, len(hs)):
        parent = mla_key(hs[i - 1]) if i else b""
        md = common_pb2.ObjectMeta(
            key=mla_key(hs[i]), kind=common_pb2.MLA_BLOCK, size=MLA_BYTES, checksum=7, parent=parent
        )
        metas.append(md)
        token_ids.append(tokens[i * BLOCK : (i + 1) * BLOCK])
        if (i + 1) % CKPT_EVERY == 0 or i == len(hs) - 1:
            ck = common_pb2.ObjectMeta(
                key=kda_key(hs[i]), kind=common_pb2.KDA_CHECKPOINT, size=KDA_BYTES, checksum=7
            )
            metas.append(ck)
            token_ids.append([])
    if not metas:
        return 0
    started = m.call("PutStartBatch", put_start_batch_request(metas, token_ids=token_ids))
    ids = [put_id for put_id in started.put_ids if put_id]
    if ids:
        m.call("PutCommitBatch", master_pb2.PutCommitBatchRequest(put_ids=ids))
    return len(ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dynamo-python", default="/tmp/dynvenv/bin/python")
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--phase", type=int, default=50)
    ap.add_argument("--dram", type=int, default=2_000_000, help="node DRAM bytes (small: evictions happen)")
    ap.add_argument(
        "--late-join",
        action="store_true",
        help="register the indexer only after the first phase, with a replay buffer too short for it: its "
        "catch-up from sequence 0 gets the snapshot",
    )
    args = ap.parse_args(argv)
    reqs = [r for r in read_mooncake(bundled_trace("conversation")) if r.hash_ids][: args.requests]
    root = root_hash(b"\0" * 32, "")
    prompts = []
    for r in reqs:
        ids = r.hash_ids[: max(1, r.input_length // 512)]  # full blocks only
        toks = tokens_of(ids)
        prompts.append((toks, hash_blocks(toks, BLOCK, root)))
    log_dir = Path(tempfile.mkdtemp(prefix="dynamo-check-"))
    pub, replay, http_port = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", free_port()
    master = MasterProcess(
        log_dir,
        "--kv-events", pub, "--kv-events-replay", replay, "--kv-events-hashes", "int64",
        "--kv-events-block-size", str(BLOCK), "--heartbeat-ms", "200", "--node-timeout-ms", "5000",
        *(["--kv-events-buffer", "20", "--kv-events-keep-tokens"] if args.late_join else []),
    )  # fmt: skip
    node = ProbeNode("n0", master, dram=args.dram)
    node.register()
    node.start_heartbeats(0.2)
    dyn_log = open(log_dir / "dynamo.log", "w")  # noqa: SIM115 - lives as long as the indexer
    dynamo = subprocess.Popen(
        [
            args.dynamo_python,
            "-m",
            "dynamo.indexer",
            "--block-size",
            str(BLOCK),
            "--port",
            str(http_port),
            "--threads",
            "1",
        ],
        stdout=dyn_log,
        stderr=subprocess.STDOUT,
    )
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "requests": len(reqs)}
    rows: list[dict[str, Any]] = []
    bad: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                http(f"http://127.0.0.1:{http_port}/health")
                break
            except OSError:
                if time.monotonic() > deadline or dynamo.poll() is not None:
                    raise SystemExit(f"dynamo.indexer did not start; see {log_dir / 'dynamo.log'}") from None
                time.sleep(0.2)
        register = {"instance_id": 1, "endpoint": pub, "replay_endpoint": replay, "model_name": "default"}
        register["block_size"] = BLOCK
        if not args.late_join:
            http(f"http://127.0.0.1:{http_port}/register", register)
        sub = KvEventSubscriber(pub, replay)
        puts = 0
        for start in range(0, len(prompts), args.phase):
            for toks, hs in prompts[start : start + args.phase]:
                run = master.call(
                    "MatchPrefix",
                    master_pb2.MatchPrefixRequest(
                        block_hashes=hs, require_checkpoint=False, counts_only=True
                    ),
                ).mla_run_blocks
                puts += put_missing(master, hs, toks, run)
            if args.late_join and start == 0:
                http(f"http://127.0.0.1:{http_port}/register", register)
                time.sleep(1.5)  # its first batch is a heartbeat: a gap from 0 -> replay -> the snapshot
            time.sleep(1.0)  # quiet: both consumers have taken every batch
            sub.poll(0.5)
            probe = prompts[max(0, start - args.phase) : start + 2 * args.phase]
            agree = agree_joint = nonzero = partial = 0
            for toks, hs in probe:
                m = master.call(
                    "MatchPrefix",
                    master_pb2.MatchPrefixRequest(block_hashes=hs, require_checkpoint=True, counts_only=True),
                )
                d = dynamo_run(http_port, toks)
                mine = sub.match_prefix([external_hash(h, HashFormat.INT64) for h in hs])
                agree += d == m.mla_run_blocks
                nonzero += m.mla_run_blocks > 0
                partial += 0 < m.mla_run_blocks < len(hs)
                agree_joint += mine == (m.usable_blocks, m.mla_run_blocks)
                if d != m.mla_run_blocks or mine != (m.usable_blocks, m.mla_run_blocks):
                    kv = [m.usable_blocks, m.mla_run_blocks]
                    bad.append(
                        {
                            "phase": start,
                            "blocks": len(hs),
                            "kvpool": kv,
                            "dynamo_run": d,
                            "subscriber": list(mine),
                        }
                    )
            st = master.stats()
            rows.append({
                "after_requests": min(start + args.phase, len(prompts)),
                "queries": len(probe), "hits": nonzero, "partial_hits": partial,
                "dynamo_agree": agree, "subscriber_joint_agree": agree_joint,
                "objects": st.objects, "evictions": st.evictions,
                "published_blocks": st.counters.get("kv_events_published_blocks", 0),
            })  # fmt: skip
        sub.close()
        snapshots = master.stats().counters.get("kv_events_snapshots", 0)
        workers = http(f"http://127.0.0.1:{http_port}/workers")
        out["dynamo_listener"] = workers[0]["listeners"] if workers else None
    finally:
        dynamo.terminate()
        dynamo.wait(timeout=10)
        node.close()
        master.kill()
    text = re.sub(r"\x1b\[[0-9;]*m", "", (log_dir / "dynamo.log").read_text())  # its colours
    warnings = [ln for ln in text.splitlines() if " WARN " in ln or " ERROR " in ln]
    cols = (
        "after_requests",
        "queries",
        "hits",
        "partial_hits",
        "dynamo_agree",
        "subscriber_joint_agree",
        "objects",
        "evictions",
    )
    print(" ".join(f"{c:>14}" for c in (*cols, "published_blocks")))
    for r in rows:
        print(" ".join(f"{r[c]!s:>14}" for c in (*cols, "published_blocks")))
    out |= {
        "phases": rows,
        "queries": sum(r["queries"] for r in rows),
        "partial_hits": sum(r["partial_hits"] for r in rows),
        "dynamo_agree": sum(r["dynamo_agree"] for r in rows),
        "subscriber_joint_agree": sum(r["subscriber_joint_agree"] for r in rows),
        "disagreements": bad[:10],
        "dynamo_warnings": [w[28:240] for w in warnings[:5]],
        "dynamo_warning_count": len(warnings),
        "objects_put": puts,
        "late_join": args.late_join,
        "snapshots_served": snapshots,
    }
    print(json.dumps(out))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
