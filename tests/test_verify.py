"""``kvpool verify`` end to end (its own master + node + workers) and its argument errors."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
from kvpool.model.loader import load_model

from kvpool.verify import _check_cached, prompt_set


def _kvpool(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", "verify", *args], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.slow  # its own master + node + two workers (~15-30 s on 2 busy cores)
def test_verify_json_on_a_local_cluster():
    proc = _kvpool("--json")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    n = len(prompt_set()) + sum(c.follow_up is not None for c in prompt_set())
    assert report["requests"] == n and report["identical"] == n and report["identical_fraction"] == 1.0
    assert report["max_logit_diff"] <= 1e-4 and report["ok"] and report["cached_tokens_verified"]
    assert report["cached_tokens"] > report["prompt_tokens"] // 3
    rows = {r["name"]: r for r in report["rows"]}
    assert all(r["bitwise_logits"] for name, r in rows.items() if not name.endswith("turn2"))
    assert all(r["cached_tokens"] > 0 for name, r in rows.items() if name.endswith("turn2"))


def test_argument_errors_and_a_dead_endpoint(capsys):
    from kvpool.commands.main import main

    assert main(["verify", "--endpoint", "http://127.0.0.1:1/v1"]) == 1
    assert "ConnectError" in capsys.readouterr().err
    assert main(["verify", "--prefill", "127.0.0.1:1"]) == 2
    assert "both --prefill and --decode" in capsys.readouterr().err
    assert main(["verify", "--endpoint", "http://x/v1", "--prefill", "a:1", "--decode", "b:2"]) == 2


def test_cached_tokens_check_needs_the_bytes():
    schema = load_model("tiny").cache_schema(64)
    need = schema.mla_block_bytes() * 2 + schema.kda_checkpoint_bytes()
    usage = SimpleNamespace(prompt_tokens=150, cached_tokens=128, computed_tokens=22, bytes_fetched=need)
    assert _check_cached(usage, schema, 64)
    assert not _check_cached(SimpleNamespace(**{**vars(usage), "bytes_fetched": need - 1}), schema, 64)
    assert not _check_cached(SimpleNamespace(**{**vars(usage), "cached_tokens": 100}), schema, 64)


def test_the_endpoint_table_says_logits_were_not_compared(capsys):
    from kvpool.commands.verify import print_table
    from kvpool.verify import Report, Row

    row = Row("chat", 130, 64, True, None, None, True, "cached")
    report = Report(rows=[row], mode="endpoint").summarize(0.0)
    print_table(report)
    out = capsys.readouterr().out
    assert "None" not in out and "first-token logits not compared" in out
