"""Streaming TTFT through the gateway, as a user's stock ``openai`` client sees it, for this tree and
(optionally) a baseline tree side by side in one run.

Each tree is started as a user starts it, ``<tree>/.venv/bin/kvpool up``, on its own port; the two clusters
run at the same time and requests alternate between them, so both see the same box. Per prompt length and hit
level (0 / 50 / 90 / 100 % of the prompt cached) the bench measures the time from sending a streamed chat
request to its first content chunk. A hit level h is made by first sending a prompt that shares its first h
of the text (not measured; twice for a partial hit, since the first one to diverge is what stores the KDA
checkpoint at the junction, exactly as a second chat turn would), then the measured prompt; ``cached_tokens``
from the usage chunk is reported, so
the table shows the hit the cache really gave.

    .venv/bin/python bench/gateway_ttft_bench.py                          # this tree only
    git worktree add /tmp/kvpool-before <ref> && (cd /tmp/kvpool-before && make venv)
    .venv/bin/python bench/gateway_ttft_bench.py --baseline /tmp/kvpool-before --reps 7

Output: a table (tree x length x hit: p50 / min / max TTFT ms, cached share), then one JSON line with every
cell and, with a baseline, the ratios after/before of the hit TTFT as a share of the same run's cold TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai

HITS = (0.0, 0.5, 0.9, 1.0)
START_DEADLINE_S = 180.0
REQUEST_TIMEOUT_S = 120.0
VOCABULARY = (
    "block hash chain prefix store decode prefill latent state cache memory tenant node master lease "
    "checkpoint recurrent attention token stream gateway route shard eviction admission quota pin"
)
WORDS = VOCABULARY.split()


@dataclass
class Tree:
    name: str
    root: Path
    port: int
    proc: subprocess.Popen | None = None
    run_dir: Path | None = None
    cells: dict[str, list[tuple[float, float, int]]] = field(default_factory=dict)  # [(ms, cached, tokens)]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(tree: Tree) -> None:
    kvpool = tree.root / ".venv" / "bin" / "kvpool"
    if not kvpool.exists():
        raise SystemExit(f"{tree.name}: {kvpool} is missing (run `make venv` in {tree.root})")
    tree.run_dir = Path(tempfile.mkdtemp(prefix=f"gw-ttft-{tree.name}-"))
    log = open(tree.run_dir / "up.log", "w")  # noqa: SIM115 - lives as long as the cluster
    tree.proc = subprocess.Popen(
        [str(kvpool), "up", "--port", str(tree.port), "--run-dir", str(tree.run_dir / "run")],
        cwd=tree.root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def wait_ready(tree: Tree) -> None:
    deadline = time.monotonic() + START_DEADLINE_S
    while time.monotonic() < deadline:
        if tree.proc is not None and tree.proc.poll() is not None:
            raise SystemExit(f"{tree.name}: kvpool up exited; see {tree.run_dir}/up.log")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{tree.port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{tree.name}: gateway not ready within {START_DEADLINE_S:.0f} s; see {tree.run_dir}")


def stop(tree: Tree) -> None:
    if tree.proc is None or tree.proc.poll() is not None:
        return
    os.killpg(tree.proc.pid, signal.SIGTERM)
    try:
        tree.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(tree.proc.pid, signal.SIGKILL)


def text(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def stream_ttft(client: openai.OpenAI, prompt: str, salt: str) -> tuple[float, float, int]:
    """Milliseconds to the first content chunk, the cached share of the prompt and its length in tokens."""
    t0 = time.perf_counter()
    ttft = None
    cached = prompt_tokens = 0
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=4, stream=True,
        temperature=0, stream_options={"include_usage": True}, extra_body={"cache_salt": salt},
    )  # fmt: skip
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - t0
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
            details = chunk.usage.prompt_tokens_details
            cached = (details.cached_tokens or 0) if details is not None else 0
    if ttft is None:
        raise RuntimeError("the stream carried no content")
    return 1000 * ttft, cached / max(prompt_tokens, 1), prompt_tokens


def run(trees: list[Tree], lengths: list[int], reps: int, seed: int) -> None:
    clients = {
        t.name: openai.OpenAI(base_url=t.base_url, api_key="none", timeout=REQUEST_TIMEOUT_S) for t in trees
    }
    rng = random.Random(seed)
    for words in lengths:
        for rep in range(reps):
            for hit in HITS:
                prefix_words = int(words * hit)
                prefix = text(prefix_words, rng)
                tail = text(words - prefix_words, rng) if prefix_words < words else ""
                measured = f"{prefix} {tail}".strip()
                partial = 0 < hit < 1
                warm = (
                    [f"{prefix} {text(words - prefix_words, rng)}".strip() for _ in range(2)]
                    if partial
                    else [measured]
                )
                order = trees if rep % 2 == 0 else list(reversed(trees))  # alternate who goes first
                for t in order:
                    salt = f"bench-{seed}-{words}-{rep}-{hit}"
                    for w in warm if hit > 0 else []:
                        stream_ttft(clients[t.name], w, salt)  # the shared prefix and its checkpoint
                    cell = t.cells.setdefault(f"{words}w/{int(hit * 100)}%", [])
                    cell.append(stream_ttft(clients[t.name], measured, salt))


def summary(trees: list[Tree]) -> dict:
    out: dict = {}
    print(f"{'tree':<8} {'cell':<12} {'p50 ms':>8} {'min':>8} {'max':>8} {'cached':>7} {'tokens':>7}")
    for t in trees:
        out[t.name] = {}
        for key, rows in t.cells.items():
            ms = [r[0] for r in rows]
            cell = {
                "p50_ms": round(statistics.median(ms), 1), "min_ms": round(min(ms), 1),
                "max_ms": round(max(ms), 1), "cached_share": round(statistics.mean(r[1] for r in rows), 3),
                "prompt_tokens": round(statistics.mean(r[2] for r in rows)),
            }  # fmt: skip
            out[t.name][key] = cell
            print(f"{t.name:<8} {key:<12} {cell['p50_ms']:>8} {cell['min_ms']:>8} {cell['max_ms']:>8} "
                  f"{cell['cached_share']:>7} {cell['prompt_tokens']:>7}")  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, default=None, help="a baseline tree with its own .venv")
    ap.add_argument("--lengths", default="450", help="prompt lengths in words (~1.5 tokens each), comma list")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    here = Path(__file__).resolve().parent.parent
    trees = [Tree("after", here, free_port())]
    if args.baseline is not None:
        trees.insert(0, Tree("before", args.baseline.resolve(), free_port()))
    try:
        for t in trees:
            start(t)
        for t in trees:
            wait_ready(t)
        run(trees, [int(x) for x in args.lengths.split(",")], args.reps, args.seed)
    finally:
        for t in trees:
            stop(t)
    cells = summary(trees)
    result: dict = {"cells": cells, "reps": args.reps}
    if args.baseline is not None:
        ratios = {}
        for words in args.lengths.split(","):

            def share(name: str, hit: int, w: str = words) -> float:
                return cells[name][f"{w}w/{hit}%"]["p50_ms"] / cells[name][f"{w}w/0%"]["p50_ms"]

            for hit in (50, 90, 100):
                ratios[f"{words}w/{hit}%_share_after_over_before"] = round(
                    share("after", hit) / share("before", hit), 3
                )
        result["ratios"] = ratios
    print(json.dumps(result))


if __name__ == "__main__":
    sys.exit(main())
