"""``kvpool replay`` / ``kvpool report`` from the command line, and the live client against a fake
OpenAI-compatible server speaking the real wire format (SSE + usage.prompt_tokens_details)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import httpx
import pytest
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.live import replay_live_async, summarize
from kvpool.workloads.trace import Request

from kvpool.commands.main import main


def _json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_replay_sim_json(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    d = _json(
        capsys,
        [
            "replay",
            "conversation",
            "--sim",
            "--limit",
            "400",
            "--capacity-bytes",
            "300GiB",
            "--json",
            "--out",
            str(out),
        ],
    )
    assert d["requests"] == 400
    for key in (
        "block_hit_rate",
        "token_hit_rate",
        "lost_token_fraction",
        "bytes_evicted",
        "mla_bytes_written",
    ):
        assert key in d
    assert 0 < d["token_hit_rate"] <= d["mla_token_hit_rate"] <= 1
    assert d["config"]["capacity"] == 300 * 2**30 and d["workloads"]["conversation"]["requests"] == 400
    priced = _json(capsys, ["price", "--result", str(out), "--profile", "moonshot-k3", "--json"])
    assert priced["input_tokens"] == d["input_tokens"] and priced["cached_tokens"] == d["cached_tokens"]
    assert priced["savings_usd"] == pytest.approx(d["cached_tokens"] * (3.00 - 0.30) / 1e6)


def test_replay_sweep_writes_csv_and_png(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    d = _json(
        capsys,
        [
            "replay",
            "synthetic",
            "--limit",
            "300",
            "--pure-mla",
            "--capacity-blocks",
            "200,2000",
            "--policy",
            "lru,optimum",
            "--out-dir",
            str(tmp_path),
            "--json",
        ],
    )
    rows = {(r["policy"], r["capacity"]): r for r in d["rows"]}
    assert set(rows) == {("lru", 200), ("lru", 2000), ("optimum", 200), ("optimum", 2000)}
    for cap in (200, 2000):
        assert rows[("optimum", cap)]["block_hit_rate"] >= rows[("lru", cap)]["block_hit_rate"]
    assert (tmp_path / "policy_sweep.csv").read_text().startswith("spec,policy")
    assert (tmp_path / "policy_sweep.png").read_bytes()[:4] == b"\x89PNG"
    argv = ["price", "--provider", "--sweep-csv", str(tmp_path / "policy_sweep.csv"), "--sweep-policy", "lru"]
    prov = _json(capsys, [*argv, "--input-tokens", "1", "--json"])["provider"]
    totals = [c["total_cost_usd"] for c in prov["candidates"]]
    assert len(totals) == 2 and prov["best"]["total_cost_usd"] == min(totals)
    d = _json(
        capsys,
        [
            "replay",
            "synthetic",
            "--limit",
            "200",
            "--capacity-bytes",
            "100GiB,400GiB",
            "--checkpoint-sweep",
            "prompt;prompt,junction",
            "--out-dir",
            str(tmp_path),
            "--json",
        ],
    )
    assert {r["checkpoints"] for r in d["rows"]} == {"prompt", "prompt,junction"}
    assert (tmp_path / "checkpoint_sweep.png").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "fifo"], "unknown eviction policy 'fifo'"),
        (["--capacity-blocks", "10", "--capacity-bytes", "1GiB"], "not both"),
        (["--capacity-bytes", "lots"], "not a size"),
        (["--capacity-blocks", "-4"], "must be > 0"),
        (["--checkpoints", "sometimes"], "checkpoint policy part"),
        (["--policy", "lru,lfu"], "a sweep needs capacities"),
        (["--pure-mla", "--checkpoint-sweep", "prompt", "--capacity-blocks", "5,10"], "no KDA layers"),
        (["--limit", "0"], "--limit must be > 0"),
        (["--block-size", "64"], "the trace's blocks are 512 tokens"),
        (["--live", "ftp://x"], "must start with http"),
        (["--live", "http://127.0.0.1:9", "--sim"], "not both"),
        (["--live", "http://127.0.0.1:9"], "have no tokens"),
    ],
)
def test_replay_bad_input_exits_2(capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    assert main(["replay", "synthetic", "--limit", "20", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool replay: error:") and message in err


# --------------------------------------------------------------------------------------------- live


def _fake_server(log: list[tuple[float, dict]]) -> httpx.MockTransport:
    """Caches every prompt it sees; reports the longest previously seen prefix in 64-token steps."""
    seen: list[list[int]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        log.append((time.perf_counter(), body))
        if request.url.path != "/v1/completions":
            return httpx.Response(404, text="no such route")
        prompt = body["prompt"]
        best = 0
        for old in seen:
            n = 0
            while n < min(len(old), len(prompt)) and old[n] == prompt[n]:
                n += 1
            best = max(best, n // 64 * 64)
        seen.append(prompt)
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": body["max_tokens"],
            "prompt_tokens_details": {"cached_tokens": best},
        }
        chunks = [{"choices": [{"text": "x", "index": 0}]}, {"choices": [], "usage": usage}]
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def _req(rid: str, t_ms: float, tokens: list[int], tenant: str = "a") -> Request:
    return Request(rid, t_ms, len(tokens), 4, tokens=tokens, tenant=tenant, workload="w")


def test_live_replay_records_cached_tokens_and_keeps_timing() -> None:
    log: list[tuple[float, dict]] = []
    base = list(range(200))
    reqs = [_req("r0", 0, base), _req("r1", 150, [*base, 1, 2, 3]), _req("r2", 300, [5] * 70)]
    start = time.perf_counter()
    outcomes = asyncio.run(replay_live_async(reqs, "http://fake", transport=_fake_server(log)))
    assert [o.cached_tokens for o in outcomes] == [0, 192, 0]
    assert all(not o.error and o.ttft_ms >= 0 for o in outcomes)
    sent = [t - start for t, _ in log]
    assert sent[1] >= 0.14 and sent[2] >= 0.29  # arrival offsets honoured
    body = log[1][1]
    assert body["prompt"] == [*base, 1, 2, 3] and body["stream"] is True and body["cache_salt"] == "a"
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 4
    assert body["metadata"] == {"workload": "w", "tenant": "a"}
    s = summarize(outcomes)
    assert s["token_hit_rate"] == pytest.approx(192 / (200 + 203 + 70))
    assert s["errors"] == 0 and s["workloads"]["w"]["requests"] == 3


def test_live_replay_counts_http_errors() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, text="overloaded")

    outcomes = asyncio.run(
        replay_live_async(
            [_req("r0", 0, [1, 2])], "http://fake/v1", speed=0, transport=httpx.MockTransport(handler)
        )
    )
    assert "HTTP 503" in outcomes[0].error and summarize(outcomes)["errors"] == 1


def test_live_replay_rejects_records_without_tokens() -> None:
    with pytest.raises(ReplayError, match="no tokens"):
        asyncio.run(replay_live_async([Request("x", 0, 10, 1, hash_ids=[1])], "http://fake"))


@pytest.mark.slow
def test_report_is_self_contained_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rep" / "report.html"
    argv = [
        "report",
        "--trace",
        "synthetic",
        "--trace",
        "conversation",  # a second trace: every per-trace variable must be fresh
        "--limit",
        "200",
        "--points",
        "2",
        "--policies",
        "lru,optimum",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    page = out.read_text()
    # per trace: policies, the sampled band, checkpoints, price vs capacity
    assert page.count("data:image/png;base64,") == 8
    needles = ("optimum", "moonshot-k3", "openai-style", "Provider view", "prompt,junction",
               "<h2>Summary</h2>", "Price vs capacity", "saved $ deepseek-style", "not swept",
               "Sampled LRU curve (R = 0.1, 3 salts)", "Token-hit error over")  # fmt: skip
    for needle in needles:
        assert needle in page, needle
    assert page.index("<h2>Summary</h2>") < page.index("<h2>synthetic</h2>")  # the report opens with it
    assert (tmp_path / "rep" / "synthetic_policy.csv").exists()


def test_report_tables_fold_when_long_and_replay_prints_capacity_in_gib(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvpool.workloads.report import FOLD_ROWS, _table

    assert "<details>" in _table(["a"], [[i] for i in range(FOLD_ROWS + 1)])
    assert "<details>" not in _table(["a"], [[i] for i in range(FOLD_ROWS)])
    assert (
        main(["replay", "conversation", "--limit", "50", "--capacity-bytes", "60GiB", "--ssd-bytes", "1TiB"])
        == 0
    )
    out = capsys.readouterr().out
    assert "capacity 60.0 GiB + SSD 1.0 TiB" in out and "64424509440" not in out
