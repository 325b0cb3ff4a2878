"""The gateway against a real ``kvpool up`` cluster (master, node, 2 prefill, 1 decode, gateway processes),
driven with the official ``openai`` client. One cluster for the whole module: it is started by the
``kvpool up`` CLI itself, so the launcher's readiness, state file, ``kvpool status`` and SIGTERM shutdown
(children gone, shared memory unlinked) are tested by the same run. The dead-worker test runs last.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from kvpool.kvstore.protocol import master_wire
from kvpool.proto import master_pb2
from kvpool.runtime import cluster_auth

from tests.harness.clusters import start_up

API_KEY = "test-key"
MODEL = "tiny"
CONFIG = """
[cluster]
ready_timeout_s = 120
[master]
pin_budget_step = 0.0  # a fixed pin budget: the cases below check its arithmetic (what pins earn: unit tests)
[prefill]
count = 2
[decode]
count = 1
[gateway]
port = 0
api_keys = ["test-key", "acme-key=acme", "beta-key=beta"]
max_prompt_tokens = 2048
max_output_tokens = 64
max_body_bytes = 65536
request_timeout_s = 30.0
"""
UP_TIMEOUT_S = 150


class UpProcess:
    def __init__(self, popen: subprocess.Popen, run_dir: Path, runs_root: Path) -> None:
        self.popen, self.run_dir, self.runs_root = popen, run_dir, runs_root
        self.state = json.loads((run_dir / "state.json").read_text())
        self.url = self.state["gateway_url"]

    def service(self, name: str) -> dict:
        return next(s for s in self.state["services"] if s["name"] == name)

    def status(self) -> tuple[int, dict]:
        env = dict(os.environ, KVPOOL_RUNS=str(self.runs_root))
        r = subprocess.run(
            [sys.executable, "-m", "kvpool", "status", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        return r.returncode, json.loads(r.stdout) if r.stdout.strip() else {}


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> UpProcess:
    base = tmp_path_factory.mktemp("up")
    popen, run_dir = start_up(base, CONFIG, timeout_s=UP_TIMEOUT_S)
    cluster = UpProcess(popen, run_dir, base / "runs")
    yield cluster
    pids = [s["pid"] for s in cluster.state["services"]]
    shm = cluster.service("node-0")["ready"].get("shm_name")
    popen.send_signal(signal.SIGTERM)
    assert popen.wait(40) == 0, (base / "up.log").read_text()[-3000:]
    assert "kvpool up: stopped" in (base / "up.log").read_text()  # shutdown says it finished
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    if shm:
        assert not Path(f"/dev/shm/{shm.lstrip('/')}").exists()
    assert not ((base / "runs") / "current.json").exists()


@pytest.fixture(scope="module")
def client(up: UpProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=up.url + "/v1", api_key=API_KEY, timeout=60, max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict], **kw: object):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=kw.pop("max_tokens", 16), **kw
    )


def test_launcher_wrote_state_and_status_reports_every_service_up(up: UpProcess) -> None:
    names = {s["name"] for s in up.state["services"]}
    assert names == {"master", "node-0", "prefill-0", "prefill-1", "decode-0", "gateway"}
    assert all((up.run_dir / f"{n}.log").exists() for n in names)
    rc, status = up.status()
    assert rc == 0, status
    assert {s["name"]: s["health"] for s in status["services"]} == dict.fromkeys(names, "up")


def test_models_and_health(up: UpProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(up.url + "/health", timeout=5).json()
    assert health["status"] == "ok" and len(health["workers"]["prefill"]) == 2
    client.completions.create(model=MODEL, prompt="count me", max_tokens=2)
    workers = httpx.get(up.url + "/health", timeout=5).json()["workers"]
    assert sum(w["served"] for w in workers["decode"]) >= 1, workers  # decode is counted, not only prefill


def test_the_readme_snippet_shows_a_hit_on_its_second_call(up: UpProcess) -> None:
    """The README's first Python snippet, pasted after `kvpool up`, prints 0 cached tokens, then a hit."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = readme.split("python - <<'PY'", 1)[1].split("\n", 1)[1].split("\nPY\n", 1)[0]
    code = code.replace("http://127.0.0.1:8000/v1", up.url + "/v1").replace(
        'api_key="none"', f'api_key="{API_KEY}"'
    )
    code = code.replace('"tenant-a"', '"readme-snippet-tenant"')  # fresh tenant: cold on its first call
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    lines = [ln.split() for ln in run.stdout.strip().splitlines()]
    (p1, _, _, c1, _), (p2, _, _, c2, _) = lines
    assert int(c1) == 0 and int(p2) == int(p1) > 128
    assert int(c2) == (int(p2) - 1) // 64 * 64 > 0, run.stdout
    log = Path(up.service("gateway")["log"]).read_text()
    hits = [ln for ln in log.splitlines() if " access " in ln and f"cached_tokens={c2} " in ln]
    assert hits and "status=200" in hits[-1] and "request_id=" in hits[-1]
    assert f"prompt_tokens={p2}" in hits[-1]


def test_up_on_a_busy_port_says_so_before_starting_anything(up: UpProcess, tmp_path: Path) -> None:
    port = up.url.rsplit(":", 1)[1]
    argv = [sys.executable, "-m", "kvpool", "up", "--port", port, "--run-dir", str(tmp_path / "r")]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 1 and f"port {port}" in run.stderr and "--port" in run.stderr, run.stderr
    assert not (tmp_path / "r" / "state.json").exists()  # nothing was started


def test_chat_uses_max_completion_tokens_and_checks_max_tokens_too(up: UpProcess) -> None:
    msgs = [{"role": "user", "content": "count"}]
    body = {
        "model": MODEL,
        "messages": msgs,
        "max_completion_tokens": 3,
        "max_tokens": 50,
        "ignore_eos": True,
    }
    r = _raw(up, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = _raw(up, "/v1/chat/completions", {**body, "max_tokens": 5000})
    assert r.status_code == 400 and "max_tokens is 5000" in r.json()["error"]["message"]


def test_streaming_and_non_streaming_give_the_same_text_and_usage(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Explain block hashing in one line. " * 4}]
    full = chat(client, messages, max_tokens=32, temperature=0)
    pieces, usage, finish = [], None, None
    stream = chat(
        client, messages, max_tokens=32, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert full.choices[0].message.content == "".join(pieces)
    assert full.choices[0].finish_reason == finish
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens is not None

    prompt = "The store keeps MLA blocks and KDA checkpoints. " * 3
    a = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
    b = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True
        )
        if c.choices
    )
    assert a.choices[0].text == b
    assert a.usage.prompt_tokens_details.cached_tokens is not None


def test_cached_tokens_grow_over_a_conversation(client: openai.OpenAI) -> None:
    """Turn k+1's prompt starts with turn k's prompt + answer tokens, so it reuses every full block of them
    (decode pushed the answer's blocks and an end-of-output checkpoint before the reply ended)."""
    messages = [
        {"role": "system", "content": "You are a terse assistant for the kvpool project. " * 4},
        {"role": "user", "content": "What is a KDA checkpoint?"},
    ]
    usage = []
    for turn in range(3):
        r = chat(client, messages, max_tokens=40, metadata={"workload": "chat"})
        usage.append(r.usage)
        messages += [
            {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": f"And turn {turn + 2}?"},
        ]
    cached = [u.prompt_tokens_details.cached_tokens for u in usage]
    assert cached[0] == 0
    for prev, cur in itertools.pairwise(usage):
        expected = (
            min((prev.prompt_tokens + prev.completion_tokens) // 64, (cur.prompt_tokens - 1) // 64) * 64
        )
        assert cur.prompt_tokens_details.cached_tokens == expected, (cached, usage)
    assert cached[1] > 0 and cached[2] > cached[1], cached
    again = chat(client, messages[:-2], max_tokens=4)  # turn 3's prompt once more
    assert again.usage.prompt_tokens_details.cached_tokens >= cached[2]


def test_cache_salt_isolates_tenants(client: openai.OpenAI) -> None:
    prompt = "Tenant isolation: this document is private to one tenant only. " * 5
    first = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "A"}
    )
    second = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "A"}
    )
    other = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "B"}
    )
    unsalted = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (second.usage.prompt_tokens - 1) // 64 * 64 > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0


def test_keys_bound_to_tenants_never_share_even_with_a_stolen_salt(up: UpProcess) -> None:
    """acme's key and beta's key send the same prompt with the same client salt: beta finds nothing of acme's
    (the salt is derived from the key's tenant server-side), acme finds its own, and the metrics name them."""
    prompt = "A confidential contract between acme and its supplier, clause by clause. " * 5
    acme = openai.OpenAI(base_url=up.url + "/v1", api_key="acme-key", timeout=60, max_retries=0)
    beta = openai.OpenAI(base_url=up.url + "/v1", api_key="beta-key", timeout=60, max_retries=0)

    def cached(c: openai.OpenAI) -> int:
        r = c.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_body={"cache_salt": "shared"}
        )
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(acme) == 0
    assert cached(beta) == 0  # the stolen salt: another tenant's chain
    assert cached(acme) > 0 and cached(beta) > 0  # each tenant hits its own
    plain = openai.OpenAI(base_url=up.url + "/v1", api_key=API_KEY, timeout=60, max_retries=0)
    assert cached(plain) == 0  # a bare key keeps the client's salt: neither tenant's chain
    text = httpx.get(up.url + "/metrics", timeout=5).text
    assert 'tenant="acme"' in text and 'tenant="beta"' in text


def _raw(up: UpProcess, path: str, body: bytes | dict, key: str = API_KEY) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        up.url + path,
        content=content,
        timeout=30,
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (b"{not json", 400, "Invalid JSON"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "x" * 3000}, 400, "maximum context length"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 1000}, 400, "at most 64"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400, "at most 64"),  # one limit, one message
        ({"model": MODEL, "prompt": [5] * 2040, "max_tokens": 20}, 400, "you requested 2060 tokens (2040 in"),
        ({"model": MODEL, "prompt": [5000]}, 400, "vocabulary"),
        ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": "x" * 70000}, 413, "exceeds"),
    ],
)
def test_bad_requests_get_openai_style_4xx(up: UpProcess, body: object, status: int, needle: str) -> None:
    r = _raw(up, "/v1/completions", body)  # type: ignore[arg-type]
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"]


def test_openai_client_maps_errors(up: UpProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=up.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, [{"role": "user", "content": "y" * 4000}])
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        chat(client, [{"role": "wizard", "content": "hi"}])
    assert _raw(up, "/v1/chat/completions", {"model": MODEL, "messages": []}, key="bad").status_code == 401
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(up.url + "/v1/nowhere", headers=auth).status_code == 404
    r = httpx.post(up.url + "/v1/completions", data={"model": MODEL}, headers=auth)  # a form, not JSON
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx.delete(up.url + "/v1/completions", headers=auth)
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"  # RFC 9110: a 405 names what is allowed
    doc = httpx.get(up.url + "/openapi.json", timeout=10).json()
    ops = doc["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "401", "404", "413", "429", "503"} <= set(ops) and "422" not in ops
    assert "text/event-stream" in ops["200"]["content"]
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == [
        "text/plain; version=0.0.4; charset=utf-8"
    ]


def test_metrics_by_workload_and_tenant(up: UpProcess, client: openai.OpenAI) -> None:
    prompt = "Retrieval-augmented context chunk about shared prefixes. " * 4
    for _ in range(2):
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=2,
            extra_headers={"X-Workload": "rag"},
            extra_body={"cache_salt": "metrics-tenant"},
        )
    deadline = time.monotonic() + 10  # store gauges refresh every 2 s: awaited, not slept on
    while True:
        text = httpx.get(up.url + "/metrics", timeout=5).text
        samples = {}
        for line in text.splitlines():
            if line.startswith("kvpool_") and " " in line:
                name, value = line.rsplit(" ", 1)
                samples[name] = float(value)
        store_bytes = [v for k, v in samples.items() if k.startswith("kvpool_store_bytes{")]
        if (samples.get("kvpool_store_up") == 1.0 and any(v > 0 for v in store_bytes)) or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(0.2)
    tenant = next(k for k in samples if k.startswith("kvpool_prompt_tokens_total{") and 'workload="rag"' in k)
    assert samples[tenant] > 0
    cached = tenant.replace("kvpool_prompt_tokens_total", "kvpool_cached_tokens_total")
    assert 0 < samples[cached] < samples[tenant]
    assert "metrics-tenant" not in text  # the salt itself never leaks
    assert any(k.startswith("kvpool_ttft_seconds_count") and 'workload="rag"' in k for k in samples)
    assert any(k.startswith("kvpool_router_predicted_hit_tokens_total") for k in samples)
    assert any(k.startswith("kvpool_store_bytes{") and v > 0 for k, v in samples.items())
    assert samples.get("kvpool_store_up") == 1.0


def test_cache_hints_pin_the_chain_refuse_over_budget_and_an_ended_session_releases(
    up: UpProcess, client: openai.OpenAI
) -> None:
    """A chat turn with ``prompt_cache_key``, ``prompt_cache_retention`` and a ``cache_control`` breakpoint
    pins its chain in the store (the master's pinned bytes grow, the usage says how many prompt tokens);
    ``DELETE /v1/prompt_cache/{key}`` releases them; a tenant whose quota cannot hold the pin is refused
    politely (200, ``refused``, counted) and still served."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    system = "You answer questions about retention hints, briefly and exactly. " * 6  # ~190 tokens
    messages = [
        {"role": "system", "content": system, "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"role": "user", "content": "What does a pin keep?"},
    ]
    hints = {"prompt_cache_key": "conv-hints", "prompt_cache_retention": "in_memory"}
    master = up.service("master")["address"]
    previous = cluster_auth.secret()
    cluster_auth.configure(cluster_auth.read_secret_file(up.state["secret_file"]))  # the run's secret

    def stats() -> master_pb2.StatsReply:
        return master_wire.call_blocking(master, "Stats", master_pb2.StatsRequest(), 5.0)

    try:
        argv = Path(f"/proc/{up.service('master')['pid']}/cmdline").read_bytes().split(b"\0")
        assert argv[argv.index(b"--pin-budget-step") + 1] == b"0.0"  # the config's fixed budget reached it
        first = stats()
        before = first.pinned_bytes
        r = chat(client, messages, max_tokens=2, extra_body={"cache_salt": "hints-a", **hints})
        retention = r.model_extra["kvpool"]["retention"]
        assert retention["tier"] == "1h" and not retention["refused"]
        assert retention["retained_tokens"] == r.usage.prompt_tokens // 64 * 64, retention  # the whole prompt
        st = stats()
        assert st.pinned_bytes > before
        # decode read the chain prefill had just written and pinned as a resume, not a writer's lookup: it
        # would credit every fresh pin with a read (what pins earn is learned from writers' lookups only)
        assert st.counters["match_prefix_resume"] - first.counters.get("match_prefix_resume", 0) == 1
        held = st.bytes_per_tenant["hints-a"]
        # another tenant's key naming the same key and salt reaches nothing; a salt posing as one is a 400
        other = httpx.delete(
            up.url + "/v1/prompt_cache/conv-hints", params={"cache_salt": "hints-a"},
            headers={"Authorization": "Bearer beta-key"},
        )  # fmt: skip
        assert other.json() == {
            "id": "conv-hints", "object": "prompt_cache.deleted", "deleted": False, "released_objects": 0
        }  # fmt: skip
        posing = httpx.delete(
            up.url + "/v1/prompt_cache/conv-hints", params={"cache_salt": "tenant:beta/hints-a"}, headers=auth
        )
        assert posing.status_code == 400 and "reserved" in posing.json()["error"]["message"]
        assert stats().pinned_bytes == st.pinned_bytes
        gone = httpx.delete(
            up.url + "/v1/prompt_cache/conv-hints", params={"cache_salt": "hints-a"}, headers=auth
        )
        assert gone.status_code == 200 and gone.json()["released_objects"] > 0, gone.text
        assert stats().pinned_bytes == before
        # another tenant, quota 3x what one such turn holds: its first conversation is retained (pins take at
        # most half the quota), the second one's pin would pass that half: refused, and served anyway
        quota = master_pb2.SetQuotaRequest(tenant="hints-b", max_bytes=held * 3)
        master_wire.call_blocking(master, "SetQuota", quota, 5.0)
        for n, refused in ((1, False), (2, True)):
            turn = [{**messages[0], "content": f"Conversation {n}. " + system}, messages[1]]
            extra = {"cache_salt": "hints-b", **hints, "prompt_cache_key": f"conv-b{n}"}
            r = chat(client, turn, max_tokens=2, extra_body=extra)
            retention = r.model_extra["kvpool"]["retention"]
            assert retention["refused"] is refused and r.choices[0].message.content is not None, retention
        assert stats().pins_refused >= 1
    finally:
        cluster_auth.configure(previous)
    bad = _raw(
        up, "/v1/chat/completions", {"model": MODEL, "messages": messages, "prompt_cache_retention": "7d"}
    )
    assert (
        bad.status_code == 400 and "allowed values: in_memory, 5m, 1h, 24h" in bad.json()["error"]["message"]
    )
    metrics = httpx.get(up.url + "/metrics", timeout=5).text
    assert 'kvpool_retention_requests_total{outcome="refused",tier="1h"}' in metrics


def test_decodes_pin_of_its_answer_is_in_the_usage_and_so_is_its_refusal(
    up: UpProcess, client: openai.OpenAI
) -> None:
    """Whole-prompt retention with an answer that crosses a block boundary: decode pins the chain up to its
    end-of-output checkpoint, and the usage's ``retained_tokens`` is that, past prefill's prompt. A tenant
    whose pin budget holds prefill's pin but not decode's longer one is told ``refused`` (decode's), with
    prefill's tokens retained."""
    system = "Decode pins the answer it writes back after the prompt, when the client asks it to. " * 3
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Go on, please: what does that pin keep, and for how long?"},
    ]
    master = up.service("master")["address"]
    previous = cluster_auth.secret()
    cluster_auth.configure(cluster_auth.read_secret_file(up.state["secret_file"]))

    def pinned() -> int:
        return master_wire.call_blocking(master, "Stats", master_pb2.StatsRequest(), 5.0).pinned_bytes

    def turn(salt: str, key: str, max_tokens: int) -> tuple[int, dict]:
        body = {"cache_salt": salt, "prompt_cache_key": key, "prompt_cache_retention": "in_memory"}
        r = chat(client, messages, max_tokens=max_tokens, extra_body={**body, "ignore_eos": True})
        assert r.usage.completion_tokens == max_tokens
        return r.usage.prompt_tokens, r.model_extra["kvpool"]["retention"]

    def end(salt: str, key: str) -> None:
        request = master_pb2.PinRequest(session=key, end_session=True, tenant=salt)
        assert master_wire.call_blocking(master, "Pin", request, 5.0).pinned > 0

    try:
        before = pinned()
        n, short = turn("dec-a", "dec-short", 2)  # the answer ends in the prompt's last block: prefill's pin
        prompt_only = pinned() - before
        answered = (n + 32 - 1) // 64 * 64  # the end-of-output checkpoint of a 32-token answer
        assert n // 64 * 64 < answered, n  # the premise: the answer closes a block
        assert short == {"tier": "5m", "retained_tokens": n // 64 * 64, "refused": False}  # in_memory: 5m
        end("dec-a", "dec-short")
        _, long = turn("dec-a", "dec-long", 32)
        assert long["retained_tokens"] == answered and not long["refused"], long
        whole = pinned() - before
        assert whole > prompt_only > 0
        end("dec-a", "dec-long")
        # pins may take half a tenant's quota: this one's half holds the prompt's chain, not the answer's
        quota = master_pb2.SetQuotaRequest(tenant="dec-q", max_bytes=prompt_only + whole)
        master_wire.call_blocking(master, "SetQuota", quota, 5.0)
        _, refused = turn("dec-q", "dec-refused", 32)
        assert refused["refused"] and refused["retained_tokens"] == n // 64 * 64, refused
        end("dec-q", "dec-refused")
    finally:
        cluster_auth.configure(previous)


def test_a_pure_mla_model_pins_its_blocks_without_checkpoints(up: UpProcess) -> None:
    """A pure-MLA spec (no KDA layer: a prefix is usable at any block) through prefill and decode engines on
    this cluster's store: each span pins its MLA blocks, decode pins its answer's whole chain, and no
    checkpoint is written or needed; the usage fields say so and the session's end releases those blocks."""
    from dataclasses import replace

    from kvpool.decode.server import final_chunk
    from kvpool.kvstore.client.async_client import AsyncStoreClient
    from kvpool.kvstore.keys import kda_key, mla_key
    from kvpool.model.config import MLA
    from kvpool.model.tiny import build_tiny, tiny_config
    from kvpool.worker.handoff import PrefillRequest, RetainSpan
    from kvpool.worker.sampling import SamplingParams

    from kvpool.colocated import Colocated

    model = build_tiny(config=replace(tiny_config(), layer_types=(MLA,) * 4))
    assert not model.cache_schema(64).kda_layers
    prompt = [(i * 37) % 1000 + 3 for i in range(150)]  # 2 full blocks
    retain = (RetainSpan(100, 3_600_000), RetainSpan(0, 300_000))  # a breakpoint in block 1, the whole prompt
    sampling = SamplingParams(max_tokens=60, ignore_eos=True)  # 150 + 59 consumed: the answer closes block 3
    master = up.service("master")["address"]
    previous = cluster_auth.secret()
    cluster_auth.configure(cluster_auth.read_secret_file(up.state["secret_file"]))

    async def go():
        async with AsyncStoreClient(master, "tcp") as store:
            colo = Colocated(model, store)
            request = PrefillRequest("mla-1", prompt, "mla-t", sampling, session="mla-conv", retain=retain)
            try:
                done = await colo.complete(request)
                chain = [bytes(h) for h in done.prefill.handoff.block_hashes]
                exists = await store.batch_exists([*map(kda_key, chain), *map(mla_key, chain)])
                return done, exists
            finally:
                colo.close()

    try:
        done, exists = asyncio.run(go())
        assert done.prefill.checkpoints_pushed == [] and done.decode.checkpoint_pushed == 0
        assert exists == [False, False, True, True]  # the prompt's blocks, no checkpoint
        assert (done.prefill.retained.tokens, done.prefill.retained.refused) == (128, False)
        assert done.decode.blocks_pushed == 1 and done.decode.retained.tokens == 192
        usage = final_chunk(done.decode).usage
        assert (usage.retained_tokens, usage.retention_refused) == (192, False)
        request = master_pb2.PinRequest(session="mla-conv", end_session=True, tenant="mla-t")
        assert master_wire.call_blocking(master, "Pin", request, 5.0).pinned == 3  # blocks 0-2, nothing else
    finally:
        cluster_auth.configure(previous)


def _schemathesis(up: UpProcess, phases: str, examples: int) -> list[str]:
    """``schemathesis run`` of ``phases`` with every check (``--max-examples`` bounds fuzzing only: coverage
    runs every case the schema defines), as two processes side by side: chat completions in one, every
    other operation in the other (about half the requests each; the server's workers then generate for
    both at once). Processes, not ``--workers``: schemathesis' threads race in hypothesis' lambda
    descriptions on Python 3.11 (``SystemError: AST constructor recursion depth mismatch``). Fails the
    test on any failure; returns each run's output."""
    exe = Path(sys.executable).with_name("schemathesis")
    chat = "/v1/chat/completions"
    common = [
        str(exe),
        "run",
        up.url + "/openapi.json",
        "--checks",
        "all",  # no 5xx, and every answer as the OpenAPI document declares it
        "--max-examples",
        str(examples),
        "--header",
        f"Authorization: Bearer {API_KEY}",
        "--request-timeout",
        "30",
        "--seed",
        "1",
        "--phases",
        phases,
        "--suppress-health-check",
        "all",
    ]
    runs = [
        subprocess.Popen([*common, flag, chat], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for flag in ("--include-path", "--exclude-path")
    ]
    try:
        finished = [run.communicate(timeout=240) for run in runs]
    finally:
        for run in runs:  # a failed or late run never leaves the other one fuzzing the module's cluster
            run.kill()
            run.wait()
    for run, (out, err) in zip(runs, finished, strict=True):
        assert run.returncode == 0, out[-4000:] + err[-2000:]
        assert " passed" in out and "failed" not in out.split("SUMMARY")[-1], out[-2000:]
    return [out for out, _ in finished]


@pytest.mark.slow
def test_schemathesis_coverage_and_fuzzing_find_no_5xx_or_contract_violations(up: UpProcess) -> None:
    """Both phases in each run (one schema load): coverage's boundary and negative cases derived from the
    schema (~630 requests, most of the time the server generating), then 25 fuzzed examples per operation
    (~100 requests)."""
    for out in _schemathesis(up, "coverage,fuzzing", 25):
        phases = out.split("SUMMARY")[0]
        assert "Coverage (in" in phases and "Fuzzing (in" in phases, phases[-2000:]


def test_demo_chats(up: UpProcess) -> None:
    from kvpool.gateway import demo_chats

    results = demo_chats.run(up.url, api_key=API_KEY, turns=3)
    workloads = {r["workload"] for r in results}
    assert workloads == {"chat", "agent", "rag"}
    for r in results:
        assert r["cached_tokens"][0] == 0 or r["workload"] == "rag"
        assert r["cached_tokens"][-1] > 0
    table = demo_chats.hit_table(results)
    assert "chat" in table and "%" in table


def test_verify_through_the_openai_gateway(up: UpProcess) -> None:
    """``kvpool verify --endpoint``'s path (``run_verify_endpoint``) against this module's ``kvpool up``: the
    fixed prompt set through the gateway, every answer the reference's, cached tokens block-aligned. (It had
    its own cluster of the same shape in test_verify.py; a fresh salt per run keeps its first turns cold.)"""
    import asyncio

    from kvpool.verify import prompt_set, run_verify_endpoint

    report = asyncio.run(run_verify_endpoint(up.url + "/v1", MODEL, api_key=API_KEY))
    assert report.mode == "endpoint" and report.ok, [r for r in report.rows if not r.identical]
    assert report.identical == report.requests == len(prompt_set()) + 3
    assert report.max_logit_diff is None and report.cached_tokens > report.prompt_tokens // 3


def test_a_client_leaving_mid_stream_frees_its_slot_and_the_decode_worker(up: UpProcess) -> None:
    body = {
        "model": MODEL,
        "prompt": "leave early " * 20,
        "max_tokens": 64,
        "stream": True,
        "ignore_eos": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for _ in range(3):
        with httpx.stream("POST", up.url + "/v1/completions", json=body, headers=headers, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # first event, then hang up
    deadline = time.monotonic() + 10
    while True:
        health = httpx.get(up.url + "/health", timeout=5).json()
        busy = health["inflight"] + sum(w["inflight"] for w in health["workers"]["decode"])
        if busy == 0:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.1)


def test_second_gateway_with_a_ttft_slo_answers_429_when_every_worker_is_busy(up: UpProcess) -> None:
    """``kvpool gateway`` started on its own in front of the same workers, with an SLO no busy worker meets:
    the first two concurrent long prompts take the two idle prefill workers, the third is refused."""
    import concurrent.futures

    workers = [s for s in up.state["services"] if s["role"] in ("prefill", "decode")]
    argv = [
        sys.executable,
        "-m",
        "kvpool.gateway.cli",
        "--port",
        "0",
        "--ttft-slo-s",
        "0.01",
        "--master",
        up.service("master")["address"],
        "--fingerprint",
        workers[0]["ready"]["fingerprint"],
    ]
    for w in workers:
        argv += [f"--{w['role']}", w["address"]]
    secret = {"KVPOOL_CLUSTER_SECRET_FILE": up.state["secret_file"]}  # the run's cluster secret
    gw = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env={**os.environ, **secret})
    try:
        ready = json.loads(gw.stdout.readline())  # type: ignore[union-attr]
        url = ready["url"]
        deadline = time.monotonic() + 10
        while httpx.get(url + "/health", timeout=2).status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)

        def one(i: int) -> str:
            try:
                client.completions.create(model=MODEL, prompt=f"{i} cold prompt " * 300, max_tokens=1)
            except openai.RateLimitError as exc:
                assert "SLO" in exc.message
                return "429"
            return "ok"

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outcomes = sorted(pool.map(one, range(4)))
        assert "ok" in outcomes and "429" in outcomes, outcomes
        assert 'kvpool_admission_rejected_total{reason="ttft_slo"}' in httpx.get(url + "/metrics").text
    finally:
        gw.terminate()
        assert gw.wait(15) == 0


def _prefill_health(up: UpProcess) -> dict[str, bool]:
    workers = httpx.get(up.url + "/health", timeout=5).json()["workers"]["prefill"]
    return {w["address"]: w["healthy"] for w in workers}


def test_a_stuck_prefill_worker_is_routed_around_then_readmitted(
    up: UpProcess, client: openai.OpenAI
) -> None:
    """SIGSTOP: the process exists but answers nothing. The 1 s health deadline takes it out of rotation."""
    stuck = up.service("prefill-0")
    os.kill(stuck["pid"], signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 6
        while _prefill_health(up)[stuck["address"]]:
            assert time.monotonic() < deadline, "stuck worker still marked healthy"
            time.sleep(0.1)
        t0 = time.monotonic()
        for i in range(3):
            r = client.completions.create(model=MODEL, prompt=f"while one is stuck {i} " * 8, max_tokens=4)
            assert r.model_extra["kvpool"]["prefill_worker"] != stuck["address"]
        assert time.monotonic() - t0 < 10
    finally:
        os.kill(stuck["pid"], signal.SIGCONT)
    deadline = time.monotonic() + 6
    while not _prefill_health(up)[stuck["address"]]:
        assert time.monotonic() < deadline, "worker not readmitted after SIGCONT"
        time.sleep(0.1)


def test_a_dead_prefill_worker_degrades_to_the_other(up: UpProcess, client: openai.OpenAI) -> None:
    victim = up.service("prefill-1")
    os.kill(victim["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    for i in range(4):
        r = client.completions.create(model=MODEL, prompt=f"after the crash {i} " * 10, max_tokens=4)
        assert r.model_extra["kvpool"]["prefill_worker"] != victim["address"]
    assert time.monotonic() - t0 < 20
    assert httpx.get(up.url + "/health", timeout=5).status_code == 200
    rc, status = up.status()
    assert rc == 3
    assert {s["name"]: s["health"] for s in status["services"]}["prefill-1"] == "down"


def test_without_any_decode_worker_requests_fail_fast_with_503(up: UpProcess, client: openai.OpenAI) -> None:
    """Runs last: kills the only decode worker. A clear error within seconds, never a hang."""
    os.kill(up.service("decode-0")["pid"], signal.SIGKILL)
    t0 = time.monotonic()
    for _ in range(2):
        with pytest.raises(openai.APIStatusError) as exc:
            client.completions.create(model=MODEL, prompt="no decoder left " * 8, max_tokens=4)
        assert exc.value.status_code == 503 and "decode" in exc.value.message
    assert time.monotonic() - t0 < 15
    deadline = time.monotonic() + 5
    while httpx.get(up.url + "/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.2)
