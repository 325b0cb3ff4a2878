"""Trace I/O: the shipped traces load with their documented shape, both formats round-trip, conversion
keeps the sharing structure, and malformed input names its line."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import pytest
from kvpool.workloads.errors import TraceFormatError
from kvpool.workloads.synthetic_tokens import synthesize_tokens, with_synthetic_tokens
from kvpool.workloads.trace import (
    DATA_DIR,
    Request,
    bundled_trace,
    read_kvpool,
    read_mooncake,
    read_trace,
)
from kvpool.workloads.trace_write import write_kvpool, write_mooncake

from kvpool.commands.main import main


def test_shipped_traces_are_the_published_files_with_licence() -> None:
    sums = {
        "conversation": "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df",
        "synthetic": "bd070915a98fc0ed264d7cfef2ce746002eb3076a695ec31ba2674c0111ec131",
    }
    for name, digest in sums.items():
        assert hashlib.sha256(gzip.decompress(bundled_trace(name).read_bytes())).hexdigest() == digest
    assert "Apache License" in (DATA_DIR / "LICENSE-MOONCAKE-TRACES").read_text()
    assert "Mooncake" in (DATA_DIR / "NOTICE").read_text()


def test_shipped_trace_shape() -> None:
    conv = read_mooncake(bundled_trace("conversation"))
    syn = read_mooncake(bundled_trace("synthetic"))
    assert (len(conv), len(syn)) == (12_031, 3_993)
    assert sum(r.input_length for r in conv) == 144_793_823
    assert all(len(r.hash_ids or []) == -(-r.input_length // 512) for r in conv)
    assert [r.arrival_ms for r in conv] == sorted(r.arrival_ms for r in conv)
    assert conv[0].workload == "conversation" and conv[0].tokens is None


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"timestamp": 5, "input_length": 600, "output_length": 1}', "missing Mooncake field"),
        ('{"timestamp": 5, "input_length": -1, "output_length": 1, "hash_ids": []}', "non-negative"),
        ('{"timestamp": 5, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "expected ceil"),
        (
            '{"timestamp": 5, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}',
            "non-negative integers",
        ),
        ("[1, 2]", "JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, bad: str, message: str) -> None:
    good = json.dumps({"timestamp": 0, "input_length": 700, "output_length": 3, "hash_ids": [1, 2]})
    path = _write(tmp_path / "t.jsonl", [good, "", bad])
    with pytest.raises(TraceFormatError, match=message) as err:
        read_trace(path)
    assert err.value.line == 3 and f"{path}:3:" in str(err.value)


def test_kvpool_round_trip_and_errors(tmp_path: Path) -> None:
    reqs = [
        Request("a", 0.5, 3, 2, tokens=[1, 2, 3], output_tokens=[4, 5], tenant="t1", workload="chat",
                conversation_id="c", turn=1),
        Request("b", 7.0, 600, 0, hash_ids=[0, 1], workload="trace"),
    ]  # fmt: skip
    for name in ("r.jsonl", "r.jsonl.gz"):
        write_kvpool(reqs, tmp_path / name)
        assert read_kvpool(tmp_path / name) == reqs
    bad = tmp_path / "bad.jsonl"
    _write(bad, [json.dumps({"request_id": "x", "arrival_ms": 0, "input_length": 2, "output_length": 0,
                             "tokens": [1]})])  # fmt: skip
    with pytest.raises(TraceFormatError, match=r"bad.jsonl:1: input_length 2 != number of tokens 1"):
        read_kvpool(bad)
    _write(bad, [json.dumps({"request_id": "x", "arrival_ms": 0, "input_length": 0, "output_length": 0})])
    with pytest.raises(TraceFormatError, match="needs 'tokens' or 'hash_ids'"):
        read_kvpool(bad)


def test_mooncake_round_trip_is_exact(tmp_path: Path) -> None:
    src = gzip.decompress(bundled_trace("synthetic").read_bytes()).decode().splitlines()[:300]
    path = _write(tmp_path / "in.jsonl", src)
    reqs = read_mooncake(path)
    write_kvpool(reqs, tmp_path / "mid.jsonl")
    write_mooncake(read_trace(tmp_path / "mid.jsonl"), tmp_path / "out.jsonl")
    out = (tmp_path / "out.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in out] == [json.loads(x) for x in src]


def test_tokens_to_mooncake_ids_keep_sharing(tmp_path: Path) -> None:
    shared = list(range(1024))
    reqs = [
        Request("a", 0, 1100, 1, tokens=shared + [7] * 76),
        Request("b", 1, 1600, 1, tokens=shared + [8] * 576),
        Request("c", 2, 1024, 1, tokens=shared, tenant="other"),
    ]
    write_mooncake(reqs, tmp_path / "m.jsonl")
    ids = [json.loads(x)["hash_ids"] for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert ids[0] == [0, 1, 2]  # renumbered in first-seen order, last block partial
    assert ids[1][:2] == [0, 1] and ids[1][2] != 2 and len(ids[1]) == 4
    assert set(ids[2]).isdisjoint(ids[0])  # another tenant never shares blocks


def test_synthetic_tokens_reproduce_sharing() -> None:
    a = synthesize_tokens([3, 4, 5], 1200, vocab=1000)
    b = synthesize_tokens([3, 4, 9], 1100, vocab=1000)
    assert len(a) == 1200 and len(b) == 1100 and max(a) < 1000
    assert a[:1024] == b[:1024] and a[1024:1100] != b[1024:1100]
    assert synthesize_tokens([3], 512, vocab=1000) != synthesize_tokens([3], 512, vocab=1000, seed=1)
    reqs = list(with_synthetic_tokens(read_mooncake(bundled_trace("synthetic"))[:5], vocab=1024))
    assert all(r.tokens is not None and len(r.tokens) == r.input_length for r in reqs)


def test_cli_trace_convert_and_stats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = gzip.decompress(bundled_trace("conversation").read_bytes()).decode().splitlines()[:50]
    path = _write(tmp_path / "in.jsonl", src)
    out = tmp_path / "o.jsonl"
    assert (
        main(["trace", "convert", str(path), str(out), "--to", "kvpool", "--synth-tokens", "--vocab", "500"])
        == 0
    )
    reqs = read_kvpool(out)
    assert len(reqs) == 50 and all(r.tokens is not None for r in reqs)
    assert main(["trace", "stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["requests"] == 50 and 0 <= stats["infinite_block_hit_rate"] <= 1
    assert main(["trace", "stats", "conversation", "--json", "--limit", "100"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 100


def test_cli_bad_trace_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}'
    bad = _write(tmp_path / "bad.jsonl", [good, '{"timestamp": 1, "input_length": 5}'])
    assert main(["trace", "stats", str(bad)]) == 2
    assert f"{bad}:2: missing Mooncake field" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "absent.jsonl"), "--json"]) == 2
    assert "trace file not found" in capsys.readouterr().err


def test_a_pause_that_loaded_a_trace_ends_frozen_a_small_or_streamed_one_does_not() -> None:
    """``collector_paused``: the collector is on again after every pause; what a large ``freeze`` pause built
    is frozen (so the first collection after it does not walk it all) and still freed by reference counting;
    a small one, or one without ``freeze`` (a streamed batch), freezes nothing."""
    import gc
    import weakref

    from kvpool.workloads.trace_record import FREEZE_AFTER_OBJECTS, collector_paused

    class Record:
        pass

    gc.unfreeze()
    with collector_paused(freeze=True):
        small = [[i] for i in range(1000)]
    with collector_paused():
        streamed = [[i] for i in range(FREEZE_AFTER_OBJECTS + 1000)]
    assert gc.isenabled() and gc.get_freeze_count() == 0 and small and streamed
    try:
        with collector_paused(freeze=True):
            built = [[i] for i in range(FREEZE_AFTER_OBJECTS + 1000)]
            probe = Record()
        assert gc.isenabled() and gc.get_freeze_count() >= len(built)
        gone = weakref.ref(probe)
        del probe
        assert gone() is None  # frozen, yet freed when its last reference goes
    finally:
        gc.unfreeze()  # the rest of the suite collects as before
