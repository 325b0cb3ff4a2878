"""Columnar (Parquet) traces: lossless against JSONL, read by every command, bad files named precisely."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from kvpool.workloads.errors import TraceFormatError
from kvpool.workloads.generators import generate
from kvpool.workloads.trace import bundled_trace, read_trace
from kvpool.workloads.trace_columnar import read_parquet, write_parquet
from kvpool.workloads.trace_write import write_kvpool


def test_rows_are_built_in_the_request_field_order() -> None:
    from kvpool.workloads.trace import Request
    from kvpool.workloads.trace_columnar import ROW_ORDER

    assert tuple(f.name for f in dataclasses.fields(Request)) == ROW_ORDER


def _kvpool_records():
    reqs = generate("chat", 60, 2.0, seed=3, vocab=1000)
    # hints, extra fields and a request without tokens: every optional column has rows with and without
    reqs[0] = dataclasses.replace(reqs[0], cache_key="sess-1", retention_tier="1h", retention_ms=3_600_000)
    reqs[1] = dataclasses.replace(reqs[1], session_end=True, extra={"note": "x", "n": [1, 2]})
    reqs[2] = dataclasses.replace(reqs[2], tokens=None, hash_ids=[7] * -(-reqs[2].input_length // 512))
    return reqs


@pytest.mark.parametrize("name", ["conversation", "synthetic"])
def test_a_bundled_trace_reads_back_identical_from_parquet(name: str, tmp_path: Path) -> None:
    original = read_trace(bundled_trace(name))
    out = tmp_path / f"{name}.parquet"
    assert write_parquet(original, out) == len(original)
    again = read_trace(out)
    assert again == original
    assert all(type(r.arrival_ms) is type(o.arrival_ms) for r, o in zip(again, original, strict=True))
    table = pq.read_table(out)
    assert table.schema.field("hash_ids").type == pa.list_(pa.int64())  # one offsets + one int column


def test_a_kvpool_trace_with_tokens_hints_and_extra_fields_round_trips(tmp_path: Path) -> None:
    reqs = _kvpool_records()
    jsonl = tmp_path / "t.jsonl"
    write_kvpool(reqs, jsonl)
    from_json = read_trace(jsonl)
    write_parquet(from_json, tmp_path / "t.parquet")
    assert read_trace(tmp_path / "t.parquet") == from_json
    assert from_json[1].extra == {"note": "x", "n": [1, 2]}


def test_the_commands_read_parquet_with_the_same_numbers(tmp_path: Path) -> None:
    out = tmp_path / "conv.parquet"
    kv = [sys.executable, "-m", "kvpool"]
    subprocess.run([*kv, "trace", "convert", "conversation", str(out)], check=True, capture_output=True)

    def replay(trace: str) -> dict:
        argv = [*kv, "replay", trace, "--sim", "--pure-mla", "--policy", "lru", "--capacity-blocks", "3000",
                "--limit", "2000", "--json"]  # fmt: skip
        done = subprocess.run(argv, check=True, capture_output=True, text=True)
        return json.loads(done.stdout)

    a, b = replay("conversation"), replay(str(out))
    keys = ("requests", "input_blocks", "hit_blocks", "cached_tokens", "input_tokens", "bytes_evicted")
    assert [a[k] for k in keys] == [b[k] for k in keys] and a["hit_blocks"] > 0


def _write_table(path: Path, **columns) -> None:
    pq.write_table(pa.table(columns), path)


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        (dict(request_id=["a"], arrival_ms=[1.0], input_length=[10], output_length=[1]),
         "needs a 'hash_ids' or a 'tokens' column"),
        (dict(request_id=["a"], input_length=[10], output_length=[1], hash_ids=[[1]]),
         "missing column 'arrival_ms'"),
        (dict(request_id=["a", "b"], arrival_ms=[1.0, -2.0], input_length=[10, 10], output_length=[1, 1],
              hash_ids=[[1], [2]]), "row 2: field 'arrival_ms'"),
        (dict(request_id=["a", "b"], arrival_ms=[1, 2], input_length=[10, 600], output_length=[1, 1],
              hash_ids=[[1], [2]]), "row 2: field 'hash_ids': 1 values"),
        (dict(request_id=["a", "b"], arrival_ms=[1, 2], input_length=[10, 10], output_length=[1, 1],
              hash_ids=[[1], [2, -5][1:]]), "row 2: field 'hash_ids': must hold non-negative"),
        (dict(request_id=["a"], arrival_ms=["soon"], input_length=[10], output_length=[1], hash_ids=[[1]]),
         "column 'arrival_ms' holds string, not a number"),
        (dict(request_id=["a"], arrival_ms=[1], input_length=["10"], output_length=[1], hash_ids=[[1]]),
         "column 'input_length' holds string, not a integer"),
        (dict(request_id=["a"], arrival_ms=[1], input_length=[True], output_length=[1], hash_ids=[[1]]),
         "column 'input_length' holds bool"),
        (dict(request_id=["a", "b"], arrival_ms=[1, 2], input_length=[10, 10], output_length=[1, 1],
              hash_ids=[[1], [2]], tenant=["t", None]), "row 2: field 'tenant': missing (null)"),
        (dict(request_id=["a"], arrival_ms=[1], input_length=[10], output_length=[1], hash_ids=[[1]],
              retention_tier=["7d"]), "row 1: field 'retention_tier'"),
        (dict(request_id=["a"], arrival_ms=[1], input_length=[10], output_length=[1], hash_ids=[[1]],
              retained_prefix_tokens=[999]), "row 1: "),
    ],
)  # fmt: skip
def test_a_bad_parquet_trace_names_the_file_row_and_field(tmp_path: Path, columns, message) -> None:
    path = tmp_path / "bad.parquet"
    _write_table(path, **columns)
    with pytest.raises(TraceFormatError) as err:
        read_parquet(path)
    assert str(path) in str(err.value) and message in str(err.value), str(err.value)


def test_a_truncated_parquet_file_is_one_clear_error(tmp_path: Path) -> None:
    good = tmp_path / "good.parquet"
    write_parquet(read_trace(bundled_trace("synthetic")), good)
    cut = tmp_path / "cut.parquet"
    data = good.read_bytes()
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceFormatError) as err:
        read_trace(cut)
    assert str(cut) in str(err.value) and "unreadable Parquet file" in str(err.value)


def test_convert_leaves_nothing_half_written_at_the_output(tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n{"oops": 1}\n')
    out = tmp_path / "out.parquet"
    argv = [sys.executable, "-m", "kvpool", "trace", "convert", str(bad), str(out)]
    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 2 and f"{bad}:2:" in done.stderr
    assert list(tmp_path.iterdir()) == [bad]
    # a write that fails part-way (after its first row group went to disk) leaves no file either
    calls = []
    real = pq.ParquetWriter.write_table

    def failing(self, table, *args, **kwargs):
        calls.append(table.num_rows)
        if len(calls) == 2:
            raise pa.ArrowIOError("disk full (simulated)")
        return real(self, table, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetWriter, "write_table", failing)
    with pytest.raises(TraceFormatError, match="disk full"):
        write_parquet(read_trace(bundled_trace("synthetic"))[:5], out, row_group=2)
    assert calls == [2, 2] and list(tmp_path.iterdir()) == [bad]


def test_an_empty_trace_and_typed_ids(tmp_path: Path) -> None:
    out = tmp_path / "empty.parquet"
    assert write_parquet([], out) == 0 and read_trace(out) == []
    req = read_trace(bundled_trace("synthetic"))[0]
    with pytest.raises(TraceFormatError, match="conversation_id 5 is not a string"):
        write_parquet([dataclasses.replace(req, conversation_id=5)], out)  # type: ignore[arg-type]


def test_a_tier_without_its_ttl_reads_as_jsonl_does(tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    _write_table(path, request_id=["a"], arrival_ms=[1], input_length=[10], output_length=[1],
                 hash_ids=[[1]], retention_tier=["5m"])  # fmt: skip
    assert read_trace(path)[0].retention_ms == 300_000


def test_a_parquet_trace_streams_in_batches_and_names_rows_across_them(tmp_path: Path, monkeypatch) -> None:
    from kvpool.workloads import trace_columnar

    reqs = read_trace(bundled_trace("synthetic"))[:10]
    path = tmp_path / "t.parquet"
    write_parquet(reqs, path)
    monkeypatch.setattr(trace_columnar, "READ_BATCH_ROWS", 3)
    assert list(trace_columnar.iter_parquet(path)) == reqs
    table = pq.read_table(path)
    lengths = table.column("input_length").to_pylist()
    lengths[7] = -1
    pq.write_table(table.set_column(table.schema.get_field_index("input_length"), "input_length",
                                    pa.array(lengths, pa.int64())), path)  # fmt: skip
    with pytest.raises(TraceFormatError, match="row 8: field 'input_length'"):
        read_trace(path)
