"""Live replay: send a workload to a running OpenAI-compatible gateway with its arrival timing and record
what the server says it cached (``usage.prompt_tokens_details.cached_tokens``) and time to first token.

Wire format (OpenAI ``/v1/completions``; token-id prompts are part of that API): ``prompt`` = token ids,
``max_tokens`` = the record's output length, ``stream: true`` with ``stream_options.include_usage`` so
the last SSE chunk carries usage, ``cache_salt`` = tenant (the simulator salts chains the same way),
``metadata.workload`` / ``x-workload`` and ``metadata.tenant`` for the gateway's per-workload metrics.
A server that ignores streaming and answers one JSON body is accepted (TTFT = full latency).

Tested against an in-process fake server (``httpx.MockTransport``) speaking the same wire format, and
against ``kvpool up`` next to the simulator (tests/test_workloads_live_vs_sim.py; design doc §5).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.stats import percentile
from kvpool.workloads.trace import Request


@dataclass(slots=True)
class LiveOutcome:
    request_id: str
    workload: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_ms: float
    e2e_ms: float
    error: str = ""
    sent_ms: float = 0.0  # when it was sent, ms after the replay started (pacing + waiting for a slot)
    session_end: str = ""  # with hints, a session's last request: "ok" or why its DELETE failed
    retained_tokens: int = 0  # prompt tokens the server says it pinned for the hints (kvpool's extension)
    objects_released: int = 0  # what the session's DELETE released


def summarize(outcomes: Sequence[LiveOutcome]) -> dict[str, Any]:
    """Totals, token hit rate as the server reported it, TTFT percentiles; overall and per workload."""

    def block(items: Sequence[LiveOutcome]) -> dict[str, Any]:
        ok = [o for o in items if not o.error]
        prompt = sum(o.prompt_tokens for o in ok)
        cached = sum(o.cached_tokens for o in ok)
        ttft = [o.ttft_ms for o in ok]
        return {
            "requests": len(items),
            "ok": len(ok),
            "errors": len(items) - len(ok),
            "input_tokens": prompt,
            "cached_tokens": cached,
            "output_tokens": sum(o.output_tokens for o in ok),
            "token_hit_rate": cached / prompt if prompt else 0.0,
            "ttft_ms_p50": percentile(ttft, 0.5),
            "ttft_ms_p90": percentile(ttft, 0.9),
            "ttft_ms_p99": percentile(ttft, 0.99),
            "e2e_ms_p50": percentile([o.e2e_ms for o in ok], 0.5),
        }

    out = block(outcomes)
    ends = [o.session_end for o in outcomes if o.session_end]
    out["sessions_ended"] = ends.count("ok")
    out["session_end_errors"] = len(ends) - ends.count("ok")  # pins then wait for their TTL
    out["objects_released"] = sum(o.objects_released for o in outcomes)
    groups: dict[str, list[LiveOutcome]] = {}
    for o in outcomes:
        groups.setdefault(o.workload, []).append(o)
    out["workloads"] = {w: block(g) for w, g in sorted(groups.items())}
    out["first_errors"] = [f"{o.request_id}: {o.error}" for o in outcomes if o.error][:5]
    out["per_request"] = {
        "workload": [o.workload for o in outcomes],
        "input": [o.prompt_tokens for o in outcomes],
        "cached": [o.cached_tokens for o in outcomes],
        "output": [o.output_tokens for o in outcomes],
        "ttft_ms": [round(o.ttft_ms, 3) for o in outcomes],
        "sent_ms": [round(o.sent_ms, 3) for o in outcomes],
        "retained": [o.retained_tokens for o in outcomes],
    }
    return out


def _retained(obj: dict[str, Any]) -> int:
    """Prompt tokens a kvpool gateway says it pinned for the request's hints (0 elsewhere)."""
    extension = obj.get("kvpool")
    retention = extension.get("retention") if isinstance(extension, dict) else None
    return int(retention.get("retained_tokens", 0)) if isinstance(retention, dict) else 0


def _usage(obj: dict[str, Any]) -> tuple[int, int, int] | None:
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or {}
    return (
        int(usage.get("prompt_tokens", 0)),
        int(details.get("cached_tokens", 0) if isinstance(details, dict) else 0),
        int(usage.get("completion_tokens", 0)),
    )


def _has_text(obj: dict[str, Any]) -> bool:
    for choice in obj.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def _one(
    client: httpx.AsyncClient, url: str, model: str, req: Request, timeout_s: float, hints: bool = False
) -> LiveOutcome:
    body = {
        "model": model,
        "prompt": req.tokens,
        "max_tokens": max(1, req.output_length),
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "cache_salt": req.tenant,
        "user": req.tenant,
        "metadata": {"workload": req.workload, "tenant": req.tenant},  # the gateway's metric labels
    }
    if hints and req.cache_key is not None:
        body["prompt_cache_key"] = req.cache_key
    if hints and req.retention_tier is not None:
        # the whole prompt's tier; a retained prefix needs a chat message's cache_control, which a
        # token-id prompt cannot carry: it is not sent
        body["prompt_cache_retention"] = req.retention_tier
    start = time.perf_counter()
    ttft = -1.0
    usage: tuple[int, int, int] | None = None
    retained = 0
    try:
        headers = {"x-workload": req.workload}
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout_s) as resp:
            if resp.status_code != 200:
                text = (await resp.aread())[:200].decode(errors="replace")
                raise ReplayError(f"HTTP {resp.status_code}: {text}")
            if "text/event-stream" not in resp.headers.get("content-type", ""):
                obj = json.loads(await resp.aread())
                ttft = (time.perf_counter() - start) * 1000
                usage = _usage(obj)
                retained = _retained(obj)
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    obj = json.loads(data)
                    if ttft < 0 and _has_text(obj):
                        ttft = (time.perf_counter() - start) * 1000
                    usage = _usage(obj) or usage
                    retained = _retained(obj) or retained
        e2e = (time.perf_counter() - start) * 1000
        if usage is None:
            raise ReplayError("response carried no usage (is stream_options.include_usage honoured?)")
        first = ttft if ttft >= 0 else e2e
        out = LiveOutcome(req.request_id, req.workload, usage[0], usage[1], usage[2], first, e2e)
        out.retained_tokens = retained
        return out
    except (httpx.HTTPError, ReplayError, json.JSONDecodeError, ValueError, TypeError) as e:
        e2e = (time.perf_counter() - start) * 1000
        return LiveOutcome(req.request_id, req.workload, 0, 0, 0, 0.0, e2e, f"{type(e).__name__}: {e}")


async def replay_live_async(
    requests: Sequence[Request],
    base_url: str,
    model: str = "default",
    speed: float = 1.0,
    concurrency: int = 256,
    timeout_s: float = 600.0,
    api_key: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    progress: Callable[[int, int], None] | None = None,
    hints: bool = False,
) -> list[LiveOutcome]:
    """Send every request at ``arrival / speed`` after the start (``speed`` 0 = as fast as allowed),
    at most ``concurrency`` in flight; outcomes in arrival order. With ``hints`` each request carries its
    client hints (``prompt_cache_key``, ``prompt_cache_retention``), and a session's last request is
    followed by ``DELETE /v1/prompt_cache/{key}``, as a client ends a session."""
    if not base_url.startswith(("http://", "https://")):
        raise ReplayError(f"live URL must start with http:// or https://, got {base_url!r}")
    if speed < 0 or concurrency <= 0 or timeout_s <= 0:
        raise ReplayError("speed must be >= 0, concurrency and timeout > 0")
    missing = [r.request_id for r in requests if r.tokens is None]
    if missing:
        raise ReplayError(f"{len(missing)} records have no tokens (first: {missing[0]}); synthesise them "
                          "with --vocab V or `kvpool trace convert --synth-tokens`")  # fmt: skip
    url = base_url.rstrip("/") + ("" if base_url.rstrip("/").endswith("/v1") else "/v1") + "/completions"
    reqs = sorted(requests, key=lambda r: r.arrival_ms)
    t0_ms = reqs[0].arrival_ms if reqs else 0.0
    sem = asyncio.Semaphore(concurrency)
    done = 0
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async with httpx.AsyncClient(transport=transport, headers=headers) as client:
        start = time.perf_counter()

        async def run(req: Request) -> LiveOutcome:
            nonlocal done
            if speed > 0:
                delay = (req.arrival_ms - t0_ms) / 1000.0 / speed - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
            async with sem:
                sent_ms = (time.perf_counter() - start) * 1000
                out = await _one(client, url, model, req, timeout_s, hints)
                if hints and req.session_end and req.cache_key is not None:
                    out.session_end, out.objects_released = await _end_session(
                        client, url.removesuffix("/completions"), req, timeout_s
                    )
            out.sent_ms = sent_ms
            done += 1
            if progress is not None:
                progress(done, len(reqs))
            return out

        return list(await asyncio.gather(*(run(r) for r in reqs)))


async def _end_session(
    client: httpx.AsyncClient, base: str, req: Request, timeout_s: float
) -> tuple[str, int]:
    """Release the session's retained chains: ("ok", objects released), or why not. A failure only leaves
    the pins to their TTL: the replay goes on (the request itself was served) and counts it."""
    url = f"{base}/prompt_cache/{quote(req.cache_key or '', safe='')}"
    try:
        resp = await client.delete(url, params={"cache_salt": req.tenant}, timeout=timeout_s)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}", 0
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {resp.text[:200]}", 0
    try:
        released = int(resp.json().get("released_objects", 0))
    except (ValueError, AttributeError, TypeError):
        released = 0  # another server's answer: the session ended, the count is unknown
    return "ok", released


def replay_live(requests: Sequence[Request], base_url: str, **kwargs: Any) -> dict[str, Any]:
    """Synchronous wrapper: replay and summarise."""
    return summarize(asyncio.run(replay_live_async(requests, base_url, **kwargs)))
