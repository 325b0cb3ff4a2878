"""``kvpool demo``: the main job on the embedded tiny model, end to end on one machine.

What it shows, in order:
1. the service: ``kvpool up`` starts master, storage node, prefill and decode workers and the gateway as
   separate processes on loopback; multi-turn chats of three workloads go through the official ``openai``
   client; cached tokens per turn and a per-workload hit-rate table are printed; the cluster shuts down;
2. greedy generation from the embedded default model (no download), in-process;
3. the cache contract the whole service rests on: the prompt is cut at a block boundary, the MLA blocks and
   the KDA checkpoint there go through the wire format (bytes, checksummed headers), and resuming from those
   bytes gives *bitwise* the same logits and continuation as the uncut run;
4. what one cache unit costs, for the tiny model (measured from the codec) and at Kimi-Linear-48B / K3 scale.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kvpool.gateway.demo_chats import SCRIPTS, hit_table, run
from kvpool.launch.cluster import Cluster
from kvpool.launch.config import load_config
from kvpool.workloads.progress import StepProgress

DEMO_PROMPT = (
    "The cache is cut into fixed token blocks; each block has a chained prefix hash. Prefill nodes compute "
    "MLA latents and KDA boundary states, a shared store holds them, and decode nodes resume exactly. "
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run the main job on the embedded tiny model")
    p.add_argument("--model", default="tiny", help="embedded model name or a checkpoint directory")
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens to generate per demo answer")
    p.add_argument("--turns", type=int, default=3, help="turns per demo chat")
    p.add_argument("--no-cluster", action="store_true", help="skip the multi-process cluster part")
    p.add_argument("--json", action="store_true", help="also print one JSON summary line")
    p.set_defaults(func=run_demo)


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB" if n >= 2**20 else f"{n / 1024:,.1f} KiB"


def run_local(turns: int = 3, overrides: dict | None = None, progress: bool = False) -> dict:
    """Cluster up (``kvpool.launch.cluster.Cluster``, gateway on a free port) → ``run`` → cluster down; for
    ``make demo``.

    Returns ``{"results", "table", "base_url", "run_dir", "up_s", "chats_s", "down_s"}``.
    """
    merged = {"gateway": {"port": 0}}
    for key, value in (overrides or {}).items():
        merged[key] = {**merged.get(key, {}), **value}
    t0 = time.monotonic()
    cluster = Cluster(load_config(None, merged)).start()
    try:
        t1 = time.monotonic()
        steps = StepProgress(turns * len(SCRIPTS), "chat", enabled=progress)
        results = run(cluster.base_url, turns=turns, on_turn=steps.finished)
        t2 = time.monotonic()
    finally:
        cluster.stop()
    t3 = time.monotonic()
    return {
        "results": results,
        "table": hit_table(results),
        "base_url": cluster.base_url,
        "run_dir": str(cluster.run_dir),
        "up_s": t1 - t0,
        "chats_s": t2 - t1,
        "down_s": t3 - t2,
    }


def run_cluster_part(turns: int) -> dict:
    """Cluster up → chats through the openai client → table → cluster down."""
    print("[cluster] starting master, storage node, 2 prefill, 1 decode and the gateway on 127.0.0.1 ...")
    r = run_local(turns=turns, progress=True)
    print(f"[cluster] up in {r['up_s']:.1f} s at {r['base_url']} (logs in {r['run_dir']})")
    for chat in r["results"]:
        print(f"\n  workload {chat['workload']}:")
        for i, (answer, cached, prompt) in enumerate(
            zip(chat["answers"], chat["cached_tokens"], chat["prompt_tokens"], strict=True)
        ):
            print(f"    turn {i + 1}: prompt {prompt:4d} tok, cached {cached:4d}  answer {answer!r}")
    print("\n[cluster] per-workload cache-hit rate (tokens):")
    print("  " + r["table"].replace("\n", "\n  "))
    print(f"[cluster] chats took {r['chats_s']:.1f} s; shut down cleanly in {r['down_s']:.1f} s\n")
    return r


def run_demo(args: argparse.Namespace) -> int:
    from kvpool.cache import units
    from kvpool.cache.hashing import hash_blocks, root_hash
    from kvpool.kvstore.keys import kda_key, mla_key
    from kvpool.model.decode_state import DecodeState
    from kvpool.model.loader import load_model
    from kvpool.model.state import PrefixState
    from kvpool.model.tokenizer import load_tokenizer
    from kvpool.workloads.specs import SPECS

    t0 = time.perf_counter()
    cluster = None if args.no_cluster else run_cluster_part(args.turns)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    model = load_model(args.model, device=args.device)
    tok = load_tokenizer(args.model, model.config)
    schema = model.cache_schema(block_size=64)
    prompt = tok.encode(DEMO_PROMPT * 2)
    B = schema.block_size
    print(
        f"model {args.model}: {model.config.num_hidden_layers} layers "
        f"(KDA {list(model.config.kda_layers)}, MLA {list(model.config.mla_layers)}), "
        f"fingerprint {model.fingerprint().hex()[:16]}…, device {model.device}"
    )
    print(f"prompt: {len(prompt)} tokens = {len(prompt) // B} full blocks of {B} + {len(prompt) % B}")

    # 1. plain generation (the reference)
    out = model.generate(prompt, args.max_tokens, eos_ids=())
    print(f"\n[generate] {args.max_tokens} tokens: {out}")
    print(f"[generate] text: {tok.decode(out)!r}")

    # 2. cut at the last full block, ship as bytes, resume
    root = root_hash(model.fingerprint(), salt="demo-tenant")
    hashes = hash_blocks(prompt, B, root)
    p = len(hashes) * B if len(prompt) % B else (len(hashes) - 1) * B
    n_blocks = p // B
    head = model.prefill(prompt[:p], boundaries=[p])
    objects: dict[bytes, bytes] = {}
    for i in range(n_blocks):
        rows = {layer: lat[i * B : (i + 1) * B] for layer, lat in head.mla.items()}
        objects[mla_key(hashes[i])] = bytes(units.encode_mla_block(schema, i, rows, block_hash=hashes[i]))
    objects[kda_key(hashes[n_blocks - 1])] = bytes(
        units.encode_kda_checkpoint(schema, head.checkpoints[p], block_hash=hashes[n_blocks - 1])
    )
    print(
        f"\n[store] {n_blocks} MLA blocks + 1 KDA checkpoint at token {p}, "
        f"{sum(map(len, objects.values())):,} bytes, keyed by the hash closing each block"
    )

    blocks = [
        units.decode_mla_block(objects[mla_key(h)], schema, expected_block=i, expected_hash=h)
        for i, h in enumerate(hashes[:n_blocks])
    ]
    ckpt = units.decode_kda_checkpoint(
        objects[kda_key(hashes[n_blocks - 1])],
        schema,
        expected_n_tokens=p,
        expected_hash=hashes[n_blocks - 1],
    )
    mla = {layer: torch.cat([b.latents[layer] for b in blocks]) for layer in schema.mla_layers}
    resumed = model.prefill(prompt[p:], start=PrefixState(p, ckpt, mla))
    full = model.prefill(prompt)
    same_logits = torch.equal(resumed.logits, full.logits)
    state = DecodeState.from_prefill(resumed)
    cont = [int(torch.argmax(resumed.logits))]
    while len(cont) < args.max_tokens:
        logits, state = model.decode_step(cont[-1], state)
        cont.append(int(torch.argmax(logits)))
    print(
        f"[resume] logits bitwise equal to the uncut run: {same_logits}; "
        f"continuation identical: {cont == out}; reused {p}/{len(prompt)} prompt tokens"
    )

    # 3. what the units cost
    print("\n[sizes] one cache unit")
    print(f"{'model':<18}{'MLA block':>14}{'(tokens)':>10}{'KDA checkpoint':>18}{'ckpt / block':>14}")
    tiny_block = units.mla_block_unit_size(schema, 0, block_hash=hashes[0])
    tiny_ckpt = units.kda_checkpoint_unit_size(schema, p, block_hash=hashes[0])
    print(
        f"{'tiny (measured)':<18}{_mib(tiny_block):>14}{B:>10}{_mib(tiny_ckpt):>18}"
        f"{tiny_ckpt / tiny_block:>14.1f}"
    )
    for name in ("kimi-linear-48b", "k3"):
        s = SPECS[name]
        blk = s.mla_block_bytes(s.default_block_size)
        ck = s.kda_bytes_per_checkpoint
        print(f"{name:<18}{_mib(blk):>14}{s.default_block_size:>10}{_mib(ck):>18}{ck / blk:>14.1f}")
    print(f"\ndone in {time.perf_counter() - t0:.1f} s")
    if args.json:
        print(
            json.dumps(
                {
                    "output_ids": out,
                    "resume_bitwise": same_logits,
                    "continuation_identical": cont == out,
                    "reused_tokens": p,
                    "cluster_hit_table": None if cluster is None else cluster["table"],
                    "prompt_tokens": len(prompt),
                }
            )
        )
    return 0 if same_logits and cont == out else 1
