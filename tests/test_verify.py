"""``kvpool verify``'s argument errors and checks. End to end: `kvpool verify --json` on its own local cluster
in test_model_dsa_verify.py, the default model's run against given workers in test_serving_grpc.py, and
through a gateway in test_gateway_cluster.py."""

from __future__ import annotations

from types import SimpleNamespace

from kvpool.model.loader import load_model

from kvpool.verify import _check_cached


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
