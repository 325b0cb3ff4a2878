"""Gateway logic without processes: chat template prefix property, answer memo, router choice and admission,
request guard. The cluster tests cover the same code end to end; these pin the rules down exactly."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from fastapi import FastAPI
from kvpool.gateway.chat_template import AnswerMemo, TextCodec, render_chat
from kvpool.gateway.errors import BackendUnavailable, InvalidRequest, Overloaded
from kvpool.gateway.guard import Guard
from kvpool.gateway.metrics import LabelCap, tenant_label
from kvpool.gateway.router import CostModel, Lookup, PrefixProbe, Router
from kvpool.gateway.schemas import ChatMessage
from kvpool.gateway.workers import Worker, WorkerPool
from kvpool.model.tiny import tiny_config
from kvpool.model.tokenizer import ByteTokenizer


@pytest.fixture
def codec() -> TextCodec:
    cfg = tiny_config()
    return TextCodec(ByteTokenizer(cfg.vocab_size, cfg.bos_token_id), cfg.vocab_size, cfg.eos_token_id)


def msgs(*pairs: tuple[str, str]) -> list[ChatMessage]:
    return [ChatMessage(role=r, content=c) for r, c in pairs]  # type: ignore[arg-type]


def test_turn_two_prompt_starts_with_turn_one_prompt_plus_answer_tokens(codec: TextCodec) -> None:
    memo = AnswerMemo()
    turn1 = render_chat(codec, msgs(("system", "be brief"), ("user", "hi")), "t", memo)
    answer_ids = [700, 5, 900, 2]  # ids past the byte range decode to nothing: text is lossy
    answer_text = codec.decode(answer_ids)
    memo.put("t", answer_text, answer_ids)
    turn2 = render_chat(
        codec,
        msgs(("system", "be brief"), ("user", "hi"), ("assistant", answer_text), ("user", "more")),
        "t",
        memo,
    )
    assert turn2[: len(turn1) + len(answer_ids)] == turn1 + answer_ids
    other_tenant = render_chat(
        codec,
        msgs(("system", "be brief"), ("user", "hi"), ("assistant", answer_text), ("user", "more")),
        "u",
        memo,
    )
    assert other_tenant[len(turn1) : len(turn1) + len(answer_ids)] != answer_ids  # memo is per tenant
    assert turn1[0] == codec.bos_id and codec.decode(turn1).endswith("<|assistant|>")


def test_template_answers_a_trailing_assistant_and_rejects_bad_unicode(codec: TextCodec) -> None:
    head = render_chat(codec, msgs(("user", "hi")), "")
    tail = render_chat(codec, msgs(("user", "hi"), ("assistant", "x")), "")
    assert tail[: len(head)] == head  # the assistant message extends the conversation...
    assert codec.decode(tail).endswith("<|assistant|>")  # ...and is answered by another assistant turn
    with pytest.raises(InvalidRequest):
        render_chat(codec, msgs(("user", "bad \ud800 surrogate")), "")
    with pytest.raises(InvalidRequest):
        codec.check_ids([1, 2, 5000])


def test_answer_memo_is_a_bounded_lru() -> None:
    memo = AnswerMemo(capacity=2)
    memo.put("", "a", [1])
    memo.put("", "b", [2])
    assert memo.get("", "a") == [1]  # refreshes a
    memo.put("", "c", [3])
    assert memo.get("", "b") is None and memo.get("", "a") == [1] and len(memo) == 2


def _pool(prefill_queued: list[int], decode_queued: list[int]) -> WorkerPool:
    pool = WorkerPool([], [])
    pool.prefill = [
        Worker("prefill", f"p{i}", None, None, None, queued_tokens=q) for i, q in enumerate(prefill_queued)
    ]  # type: ignore[arg-type]
    pool.decode = [
        Worker("decode", f"d{i}", None, None, None, queued_tokens=q) for i, q in enumerate(decode_queued)
    ]  # type: ignore[arg-type]
    return pool


class FixedProbe(PrefixProbe):
    """The router's only dependency on the master, answering a fixed lookup (master tested elsewhere)."""

    def __init__(self, look: Lookup) -> None:
        super().__init__(None, b"\0" * 32, 64)
        self.look = look

    async def lookup(self, prompt: list[int], tenant: str) -> Lookup:
        return self.look


def test_cache_policy_picks_the_cheapest_prefill_and_least_loaded_decode() -> None:
    router = Router(_pool([5000, 100, 3000], [64, 8]), FixedProbe(Lookup(cached_tokens=960)), "cache")
    plan, _ = asyncio.run(router.plan(list(range(1000)), "", 16))
    assert plan.prefill.address == "p1" and plan.decode.address == "d1"
    assert plan.predicted_cached == 960 and plan.dispatched_tokens == 40
    cost = CostModel()
    assert plan.estimated_ttft_s == pytest.approx(cost.estimate(100, 1000, 960, 0))
    # SSD hits cost more than DRAM hits, both far less than compute
    assert cost.estimate(0, 1000, 960, 0) < cost.estimate(0, 1000, 960, 960) < cost.estimate(0, 1000, 0, 0)


def test_admission_refuses_past_the_ttft_slo_only_when_the_worker_is_busy() -> None:
    pool = _pool([20000], [0])
    router = Router(pool, FixedProbe(Lookup()), "cache", ttft_slo_s=1.0)
    pool.prefill[0].inflight = 1
    with pytest.raises(Overloaded, match="SLO"):
        asyncio.run(router.plan(list(range(100)), "", 16))
    pool.prefill[0].inflight = 0  # an idle worker always takes the request
    asyncio.run(router.plan(list(range(100)), "", 16))


def test_round_robin_and_failed_workers() -> None:
    pool = _pool([0, 0], [0])
    router = Router(pool, FixedProbe(Lookup()), "rr")
    picks = [asyncio.run(router.plan([1, 2, 3], "", 4))[0].prefill.address for _ in range(4)]
    assert picks == ["p0", "p1", "p0", "p1"]
    pool.prefill[0].mark_failed()
    assert {asyncio.run(router.plan([1], "", 4))[0].prefill.address for _ in range(3)} == {"p1"}
    pool.prefill[1].healthy = False
    with pytest.raises(BackendUnavailable):
        asyncio.run(router.plan([1], "", 4))


def test_cost_model_learns_compute_speed() -> None:
    cost = CostModel(compute_s=1e-3, alpha=0.5)
    cost.observe(1000, 0.1)
    assert cost.compute_s == pytest.approx(5.5e-4)
    cost.observe(10, 5.0)  # too few tokens to tell anything: ignored
    assert cost.compute_s == pytest.approx(5.5e-4)


def test_guard_checks_key_before_body_and_limits_size() -> None:
    app = FastAPI()

    @app.post("/v1/echo")
    async def echo(body: dict) -> dict:
        return body

    guarded = Guard(app, api_keys=["k1"], max_body_bytes=100, body_timeout_s=0.3)

    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(guarded), base_url="http://t") as c:
            ok = await c.post("/v1/echo", json={"a": 1}, headers={"Authorization": "Bearer k1"})
            bad_key = await c.post("/v1/echo", content=b"{broken", headers={"Authorization": "Bearer k2"})
            big = await c.post("/v1/echo", json={"a": "x" * 200}, headers={"Authorization": "Bearer k1"})

            async def chunks():
                yield b'{"a": "' + b"y" * 150 + b'"}'

            chunked = await c.post("/v1/echo", content=chunks(), headers={"Authorization": "Bearer k1"})
            return [ok, bad_key, big, chunked]

    ok, bad_key, big, chunked = asyncio.run(go())
    assert ok.status_code == 200 and ok.json() == {"a": 1}
    assert bad_key.status_code == 401 and bad_key.json()["error"]["code"] == "invalid_api_key"
    assert big.status_code == 413 and chunked.status_code == 413


def test_guard_answers_408_to_a_body_that_stalls_and_keeps_streams_listening() -> None:
    """A client that stops sending mid-body gets a 408 within the guard's deadline (the server sets none on a
    body); a body the guard read is handed on, and after it the server's own messages (a streaming response
    listens for the client's disconnect there: an invented one would end every stream at once)."""
    seen: list[object] = []

    async def app(scope: dict, receive: object, send: object) -> None:  # type: ignore[type-arg]
        seen.append(await receive())  # type: ignore[operator]
        seen.append(await receive())  # type: ignore[operator]

    guarded = Guard(app, api_keys=[], max_body_bytes=100, body_timeout_s=0.3)
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-length", b"50")]}  # fmt: skip

    async def stalled() -> tuple[list[dict], float]:  # type: ignore[type-arg]
        sent: list[dict] = []  # type: ignore[type-arg]
        stuck = asyncio.Event()
        first = True

        async def receive() -> dict:  # type: ignore[type-arg]
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": b'{"model": ', "more_body": True}
            await stuck.wait()  # the rest never comes
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:  # type: ignore[type-arg]
            sent.append(message)

        t0 = time.monotonic()
        await asyncio.wait_for(guarded(dict(scope), receive, send), 10)
        return sent, time.monotonic() - t0

    sent, took = asyncio.run(stalled())
    assert sent[0]["status"] == 408 and b"request_timeout" in sent[1]["body"] and took < 3.0
    assert (b"connection", b"close") in sent[0]["headers"]  # the body was not read to its end
    assert seen == []  # the app never saw the request

    async def gone() -> list[dict]:  # type: ignore[type-arg]
        messages = [
            {"type": "http.request", "body": b'{"a": 1}', "more_body": True},
            {"type": "http.disconnect"},
        ]
        sent: list[dict] = []  # type: ignore[type-arg]

        async def receive() -> dict:  # type: ignore[type-arg]
            return messages.pop(0)

        async def send(message: dict) -> None:  # type: ignore[type-arg]
            sent.append(message)

        await guarded(dict(scope), receive, send)
        return sent

    assert asyncio.run(gone()) == [] and seen == []  # a client that left mid-body: its part is never run

    async def whole() -> None:
        server_says = {"type": "http.disconnect", "from": "the server"}
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}, server_says]

        async def receive() -> dict:  # type: ignore[type-arg]
            return messages.pop(0)

        async def send(message: dict) -> None:  # type: ignore[type-arg]
            pass

        await guarded(dict(scope), receive, send)

    asyncio.run(whole())
    assert seen == [
        {"type": "http.request", "body": b"{}", "more_body": False},
        {"type": "http.disconnect", "from": "the server"},  # the server's message, not one made up
    ]


def test_metric_labels_are_capped_and_salts_hashed() -> None:
    cap = LabelCap(limit=2)
    assert [cap(v, "default") for v in ("a", "b", "c", "a", None, "bad label!")] == [
        "a",
        "b",
        "other",
        "a",
        "default",
        "other",
    ]
    assert (
        tenant_label("secret") != "secret" and len(tenant_label("secret")) == 8 and tenant_label("") == "none"
    )


def test_dns_specs_become_one_worker_per_address(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpool.gateway import workers

    # under load 2 s is not always enough for `localhost`; the bad spec fails before any lookup
    monkeypatch.setattr(workers, "DNS_TIMEOUT_S", 15.0)

    async def go() -> tuple[list[str], list[str]]:
        pool = WorkerPool(["127.0.0.1:1", "dns:localhost:50061"], ["dns:no-such-host.invalid:notaport"])
        await pool.refresh_dns()
        found = sorted(w.address for w in pool.prefill)
        decode = [w.address for w in pool.decode]
        await pool.close()
        return found, decode

    found, decode = asyncio.run(go())
    assert "127.0.0.1:50061" in found
    assert all(w.endswith(":50061") for w in found) and decode == []


def test_a_hung_resolver_neither_blocks_refresh_nor_shutdown(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resolver that never answers (no DNS server reachable) costs one DNS deadline per refresh, and
    ``asyncio.run`` still returns at once: the lookup thread is abandoned, not joined."""
    import socket as socket_module
    import threading

    from kvpool.gateway import workers

    release = threading.Event()

    def hung_getaddrinfo(*args: object, **kwargs: object) -> list:
        release.wait(30)
        raise OSError("resolver gave up")

    monkeypatch.setattr(socket_module, "getaddrinfo", hung_getaddrinfo)
    monkeypatch.setattr(workers, "DNS_TIMEOUT_S", 0.3)

    async def go() -> list[str]:
        pool = WorkerPool(["dns:prefill.example:50061"], [])
        await pool.refresh_dns()
        addresses = [w.address for w in pool.prefill]
        await pool.close()
        return addresses

    t0 = time.monotonic()
    try:
        assert asyncio.run(go()) == []
        assert time.monotonic() - t0 < 3.0  # one 0.3 s deadline; the default executor would wait 30 s
    finally:
        release.set()


def test_concurrency_limit_answers_429_and_slots_release_once(codec: TextCodec) -> None:
    from kvpool.gateway.gateway import Gateway
    from kvpool.gateway.model_info import ModelInfo
    from kvpool.gateway.settings import GatewaySettings

    gw = Gateway(GatewaySettings(prefill=[], decode=[], max_concurrent=1), ModelInfo(codec, b"\0" * 32, None))  # type: ignore[arg-type]
    slot = gw.acquire()
    with pytest.raises(Overloaded, match="in flight"):
        gw.acquire()
    slot.release()
    slot.release()  # a second cleanup path must not free a slot twice
    assert gw.inflight == 0
    gw.acquire()
    assert gw.inflight == 1


def test_a_stream_whose_client_stops_reading_is_given_up_at_its_deadline(codec: TextCodec) -> None:
    """A client that stays connected but stops reading blocks the server's send for ever (Starlette ends a
    stream only on a disconnect): the ASGI ``send`` below never returns after the first body chunk, and
    ``receive`` never reports a disconnect. The slot must come back by the deadline."""
    from kvpool.gateway.gateway import Gateway, GuardedStream
    from kvpool.gateway.model_info import ModelInfo
    from kvpool.gateway.settings import GatewaySettings

    gw = Gateway(GatewaySettings(prefill=[], decode=[], max_concurrent=1), ModelInfo(codec, b"\0" * 32, None))  # type: ignore[arg-type]
    slot = gw.acquire()
    produced: list[int] = []

    async def body():  # type: ignore[no-untyped-def]
        for i in range(1000):
            produced.append(i)
            yield f"data: {i}\n\n"

    async def go() -> float:
        stuck = asyncio.Event()  # never set: the client's window stays shut
        sent: list[str] = []

        async def send(message: dict) -> None:  # type: ignore[type-arg]
            sent.append(message["type"])
            if sent.count("http.response.body") > 1:
                await stuck.wait()

        async def receive() -> dict:  # type: ignore[type-arg]
            await stuck.wait()  # connected, silent
            return {"type": "http.disconnect"}

        response = GuardedStream(body(), slot.release, time.monotonic() + 0.3, media_type="text/event-stream")
        t0 = time.monotonic()
        # (spec 2.3, as uvicorn says: the response also listens for a disconnect on ``receive``)
        await asyncio.wait_for(response({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send), 10)
        return time.monotonic() - t0

    took = asyncio.run(go())
    assert 0.25 <= took < 3.0 and gw.inflight == 0  # given up at its 0.3 s deadline, the slot back
    assert len(produced) < 10  # the body stopped with the client, it was not drained into the void
