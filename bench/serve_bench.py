"""Serving benchmark: N concurrent multi-turn clients for a fixed time against ``kvpool up``, per routing
policy.

Each client runs conversations: one of a few shared system prompts (so prefixes repeat across clients),
then ``--turns`` user turns, each turn's prompt carrying the previous answer (the cache should serve
everything but the new message). Requests stream through the official ``openai`` client with
``stream_options.include_usage``, so TTFT is measured at the client (first chunk carrying text or the
role) and cached tokens come from ``usage.prompt_tokens_details.cached_tokens``.

By default it starts a fresh cluster (2 prefill workers, 1 decode) for each policy in ``--routing`` so both
start cold, and prints a table, the cache/rr ratios and one JSON line. ``--url`` benches a running gateway.

    .venv/bin/python bench/serve_bench.py --duration 20 --clients 6
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid
from dataclasses import dataclass, field

from kvpool.workloads.progress import StepProgress

SYSTEMS = [
    ("You are a support agent for a GPU cloud. Policies: refunds within 30 days; escalate outages. " * 6),
    ("You are a coding assistant. Repository conventions: flat modules, typed errors, tests first. " * 6),
    ("You answer questions about one retrieved document on KV caches and block hashing strategies. " * 6),
    ("You are a planning agent with tools search, read and run; think step by step, one tool call. " * 6),
]
QUESTIONS = [
    "How do I start?",
    "What about errors?",
    "Give an example.",
    "Why is that?",
    "Anything else?",
    "Summarise please.",
    "And the next step?",
    "Is it safe?",
]


@dataclass
class Sample:
    ttft_s: float
    e2e_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class Result:
    policy: str
    duration_s: float
    samples: list[Sample] = field(default_factory=list)
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)
    predicted_hit: float = 0.0
    delivered_hit: float = 0.0

    def summary(self) -> dict:
        s = self.samples
        ttft = sorted(x.ttft_s for x in s) or [float("nan")]
        prompt = sum(x.prompt_tokens for x in s)
        return {
            "policy": self.policy,
            "requests": len(s),
            "errors": self.errors,
            "req_per_s": round(len(s) / self.duration_s, 3),
            "output_tok_per_s": round(sum(x.completion_tokens for x in s) / self.duration_s, 1),
            "ttft_p50_s": round(statistics.median(ttft), 4),
            "ttft_p99_s": round(ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))], 4),
            "hit_rate": round(sum(x.cached_tokens for x in s) / max(prompt, 1), 4),
            "prompt_tokens": prompt,
            "router_predicted_hit_tokens": self.predicted_hit,
            "router_delivered_hit_tokens": self.delivered_hit,
            "error_kinds": self.error_kinds,
        }


async def one_request(
    client: object, model: str, messages: list[dict], max_tokens: int, salt: str
) -> tuple[Sample, str]:
    t0 = time.perf_counter()
    ttft = None
    text: list[str] = []
    usage = None
    stream = await client.chat.completions.create(  # type: ignore[attr-defined]
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_salt": salt, "metadata": {"workload": "bench"}},
    )
    async for chunk in stream:
        if ttft is None and chunk.choices:
            ttft = time.perf_counter() - t0
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            usage = chunk.usage
    e2e = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError("stream ended without usage")
    return Sample(
        ttft or e2e,
        e2e,
        usage.prompt_tokens,
        usage.prompt_tokens_details.cached_tokens,
        usage.completion_tokens,
    ), "".join(text)


def cold_document(rng: random.Random, tokens: int) -> str:
    """A unique document (never cached): random words, about one byte-token per character."""
    words = ["cache", "block", "prefix", "tenant", "decode", "prefill", "store", "node", "hash", "chunk"]
    out: list[str] = []
    while sum(len(w) + 1 for w in out) < tokens:
        out.append(rng.choice(words) + str(rng.randrange(1000)))
    return " ".join(out)


async def client_loop(
    idx: int,
    url: str,
    api_key: str,
    model: str,
    stop_at: float,
    turns: int,
    max_tokens: int,
    salt: str,
    result: Result,
    cold_fraction: float = 0.0,
    cold_tokens: int = 1500,
) -> None:
    import openai

    rng = random.Random(idx)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, timeout=60, max_retries=0)
    try:
        while time.monotonic() < stop_at:
            messages = [{"role": "system", "content": rng.choice(SYSTEMS)}]
            cold = rng.random() < cold_fraction  # a one-shot request over a fresh long document
            if cold:
                messages = [{"role": "system", "content": cold_document(rng, cold_tokens)}]
            for _ in range(1 if cold else turns):
                if time.monotonic() >= stop_at:
                    break
                messages.append({"role": "user", "content": f"[{idx}] " + rng.choice(QUESTIONS)})
                try:
                    sample, answer = await one_request(client, model, messages, max_tokens, salt)
                except Exception as exc:  # counted, reported by kind; the bench keeps going
                    result.errors += 1
                    kind = type(exc).__name__
                    result.error_kinds[kind] = result.error_kinds.get(kind, 0) + 1
                    break
                result.samples.append(sample)
                messages.append({"role": "assistant", "content": answer})
    finally:
        await client.close()


def scrape_router_hits(url: str) -> tuple[float, float]:
    import httpx

    pred = deliv = 0.0
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("kvpool_router_predicted_hit_tokens_total{"):
            pred += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvpool_router_delivered_hit_tokens_total{"):
            deliv += float(line.rsplit(" ", 1)[1])
    return pred, deliv


async def run_load(url: str, api_key: str, policy: str, args: argparse.Namespace) -> Result:
    import openai

    model = (await openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key).models.list()).data[0].id
    salt = f"bench-{uuid.uuid4().hex[:8]}"
    result = Result(policy, args.duration)
    stop_at = time.monotonic() + args.duration
    t0 = time.monotonic()
    await asyncio.gather(
        *(
            client_loop(
                i,
                url,
                api_key,
                model,
                stop_at,
                args.turns,
                args.max_tokens,
                salt,
                result,
                args.cold_fraction,
                args.cold_tokens,
            )
            for i in range(args.clients)
        )
    )
    result.duration_s = time.monotonic() - t0
    result.predicted_hit, result.delivered_hit = scrape_router_hits(url)
    return result


def bench_policy(policy: str, args: argparse.Namespace) -> Result:
    from kvpool.launch.cluster import Cluster
    from kvpool.launch.config import load_config

    overrides = {
        "gateway": {"port": 0, "routing": policy, "max_concurrent": 4 * args.clients},
        "prefill": {"count": args.prefill},
        "decode": {"count": args.decode},
    }
    with Cluster(load_config(None, overrides)) as cluster:
        return asyncio.run(run_load(cluster.base_url, "none", policy, args))


def table(rows: list[dict]) -> str:
    head = (
        f"{'policy':<7} {'req':>5} {'err':>4} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'hit':>6}"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['policy']:<7} {r['requests']:>5} {r['errors']:>4} {r['req_per_s']:>7.2f} "
            f"{r['output_tok_per_s']:>9.1f} {r['ttft_p50_s'] * 1e3:>7.1f}ms {r['ttft_p99_s'] * 1e3:>7.1f}ms "
            f"{r['hit_rate']:>6.1%}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=20.0, help="seconds of load per policy")
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--turns", type=int, default=4, help="turns per conversation")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--cold-fraction",
        type=float,
        default=0.0,
        help="share of conversations replaced by one cold request over a fresh long document",
    )
    p.add_argument("--cold-tokens", type=int, default=1500, help="length of those documents")
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--routing", default="cache,rr", help="comma list of policies (fresh cluster each)")
    p.add_argument("--url", default=None, help="bench a running gateway instead (one pass, its policy)")
    p.add_argument("--api-key", default="none")
    args = p.parse_args(argv)
    if args.url:
        rows = [asyncio.run(run_load(args.url.rstrip("/"), args.api_key, "running", args)).summary()]
    else:
        policies = args.routing.split(",")
        progress = StepProgress(len(policies), "serve_bench")
        rows = []
        for policy in policies:
            rows.append(bench_policy(policy, args).summary())
            progress.finished(f"routing {policy}")
    print(table(rows))
    out: dict = {
        "bench": "serve",
        "cold_fraction": args.cold_fraction,
        "cold_tokens": args.cold_tokens,
        "clients": args.clients,
        "duration_s": args.duration,
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "prefill": args.prefill,
        "decode": args.decode,
        "results": rows,
    }
    by = {r["policy"]: r for r in rows}
    if "cache" in by and "rr" in by:
        c, r = by["cache"], by["rr"]
        out["ratios_cache_over_rr"] = {
            "ttft_p50": round(c["ttft_p50_s"] / max(r["ttft_p50_s"], 1e-9), 3),
            "ttft_p99": round(c["ttft_p99_s"] / max(r["ttft_p99_s"], 1e-9), 3),
            "hit_rate": round(c["hit_rate"] / max(r["hit_rate"], 1e-9), 3),
            "req_per_s": round(c["req_per_s"] / max(r["req_per_s"], 1e-9), 3),
        }
        print("cache/rr: " + ", ".join(f"{k} x{v}" for k, v in out["ratios_cache_over_rr"].items()))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
