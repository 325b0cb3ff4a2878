"""Multi-turn chats of three workloads through the official ``openai`` client (used by ``make demo``).

``run(base_url)`` talks to a running gateway (``kvpool up`` or ``kvpool.launch.cluster.Cluster``) exactly as a
user would: the chat workload is a conversation with a system prompt; the agent workload repeats a long tool
manifest and appends tool results turn after turn; the rag workload asks different questions about one
retrieved document. Each run uses a fresh ``cache_salt`` so earlier runs cannot inflate its hit rate, and
labels requests with ``metadata.workload`` so the gateway's metrics split the same way. Returns per-chat
answers and ``usage.prompt_tokens_details.cached_tokens`` per turn; ``hit_table`` renders the hit rates.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

SYSTEM = "You are kvpool's assistant. Answer briefly and precisely about disaggregated KV caching. "
TOOLS = (
    "Tools available: search(query) returns documents; read(path) returns a file; run(cmd) executes a shell "
    "command; each call returns JSON with fields status and output. Think, then call exactly one tool. "
)
DOCUMENT = (
    "Document: Mooncake separates prefill and decode clusters and keeps KV blocks in a shared store. "
    "Blocks are identified by chained prefix hashes; a hybrid model also needs recurrent-state "
    "checkpoints at block boundaries, so the usable prefix is the longest run of blocks "
    "that ends at a checkpoint. "
)
SCRIPTS: dict[str, tuple[str, list[str]]] = {
    "chat": (
        SYSTEM * 2,
        ["What does the shared store hold?", "Why chain the hashes?", "And the salt?", "Summarise."],
    ),
    "agent": (
        TOOLS * 3,
        [
            "Task: find the eviction policy.",
            "Tool result: {status: ok, output: lru}",
            "Tool result: {status: ok, output: watermark 0.9}",
            "Finish the task.",
        ],
    ),
    "rag": (
        DOCUMENT * 2,
        [
            "Question: what is a usable prefix?",
            "Question: what does decode fetch?",
            "Question: why checkpoints?",
            "Question: what is Mooncake?",
        ],
    ),
}


def run(
    base_url: str,
    api_key: str = "none",
    turns: int = 3,
    max_tokens: int = 12,
    model: str | None = None,
    timeout_s: float = 60.0,
    on_turn: Callable[[str], None] | None = None,
) -> list[dict]:
    """One chat per workload, ``turns`` turns each; returns answers and cached tokens per turn.

    ``on_turn`` hears one line per finished turn (the demo prints progress with it)."""
    import openai

    client = openai.OpenAI(
        base_url=base_url.rstrip("/") + "/v1", api_key=api_key, timeout=timeout_s, max_retries=0
    )
    model = model or client.models.list().data[0].id
    salt = f"demo-{uuid.uuid4().hex[:12]}"
    results = []
    for workload, (system, users) in SCRIPTS.items():
        messages: list[dict] = [{"role": "system", "content": system}]
        record: dict = {"workload": workload, "answers": [], "cached_tokens": [], "prompt_tokens": []}
        for turn in range(turns):
            question = users[turn % len(users)]
            if workload == "rag":  # independent questions about one document: shared prefix, no history
                messages = messages[:1]
            messages.append({"role": "user", "content": question})
            r = client.chat.completions.create(
                model=model,
                messages=messages,
                max_tokens=max_tokens,
                temperature=0,
                extra_body={"cache_salt": salt, "metadata": {"workload": workload}},
            )
            answer = r.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": answer})
            record["answers"].append(answer)
            record["cached_tokens"].append(r.usage.prompt_tokens_details.cached_tokens)
            record["prompt_tokens"].append(r.usage.prompt_tokens)
            if on_turn is not None:
                cached = r.usage.prompt_tokens_details.cached_tokens
                on_turn(f"{workload} turn {turn + 1}, {cached}/{r.usage.prompt_tokens} tokens cached")
        results.append(record)
    return results


def hit_table(results: list[dict]) -> str:
    """Per-workload hit rate in tokens (cached / prompt), plus the per-turn cached counts."""
    rows = [
        f"{'workload':<8} {'turns':>5} {'prompt tok':>10} {'cached tok':>10} {'hit rate':>8}  cached per turn"
    ]
    total_p = total_c = 0
    for r in results:
        p, c = sum(r["prompt_tokens"]), sum(r["cached_tokens"])
        total_p, total_c = total_p + p, total_c + c
        rows.append(
            f"{r['workload']:<8} {len(r['prompt_tokens']):>5} {p:>10} {c:>10} {c / max(p, 1):>7.1%}  "
            f"{r['cached_tokens']}"
        )
    rows.append(f"{'all':<8} {'':>5} {total_p:>10} {total_c:>10} {total_c / max(total_p, 1):>7.1%}")
    return "\n".join(rows)
