"""Columnar traces: a kvpool trace as one Parquet file, read back in a second instead of parsed line by line.

Why: a production trace is millions of requests; JSON parses every id of every line into a Python object on
every run (a 1 M-request Mooncake file is ~34 M ids). Parquet stores each field as one column, compressed,
and the ids as Arrow's ``list<int64>``: one offsets column and one integer column, which numpy reads
without a per-id step and which the user's own tools (pandas, polars, DuckDB, Spark) read as they are.

The file is a lossless form of the kvpool JSONL format (``trace``): one row per request, in file order, the
columns of :data:`SCHEMA` (nullable where the record's field is optional) and ``kvpool.format`` =
``kvpool-trace/1`` in the file's metadata. A Mooncake trace converts with its request ids and workload made
explicit, as ``trace convert --to kvpool`` writes them. ``arrival_ms`` is written as int64 when every
arrival is an integer (Mooncake's are), so ints read back as ints; in a trace that mixes integer and
fractional arrivals all read back as floats (equal in value). Ids and names must be strings (a value that
would change type on the way is refused at write). A null is the field left out: an optional field takes
its default, a retention tier without its TTL the tier's standard one (as in JSONL); a null where a value
is required (ids, arrival, lengths, tenant, workload) is an error.

Reading checks each column's own type first (a string "10" is no integer, a bool no number: no parsing or
coercion), then what ``Request.validate`` checks, column-wise (one numpy pass per rule), and names the
file, the 1-based row and the field of the first bad record. It goes a batch of rows at a time, so a
trace larger than memory streams (``iter_parquet``).
A truncated or foreign file is one ``TraceFormatError`` naming the file. Writing goes to a temporary file
beside the target, renamed over it once complete: nothing half-written is ever at the output path.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from kvpool.workloads.errors import TraceFormatError
from kvpool.workloads.trace_record import (
    KVPOOL_FORMAT,
    MAX_CACHE_KEY_CHARS,
    Request,
    collector_paused,
    tier_ms,
)

PARQUET_MAGIC = b"PAR1"
FORMAT_KEY = b"kvpool.format"
LIST_FIELDS = ("hash_ids", "tokens", "output_tokens")
STRING_FIELDS = ("request_id", "tenant", "workload")
OPTIONAL_STRINGS = ("conversation_id", "cache_key", "retention_tier", "prefix_retention_tier", "extra")
# the order of Request's fields, in which _requests passes a row's values positionally
ROW_ORDER = (
    "request_id", "arrival_ms", "input_length", "output_length", "tokens", "output_tokens", "hash_ids",
    "block_size", "tenant", "workload", "conversation_id", "turn", "cache_key", "retention_tier",
    "retention_ms", "retained_prefix_tokens", "prefix_retention_tier", "prefix_retention_ms", "session_end",
    "extra",
)  # fmt: skip
INT_FIELDS = (
    "input_length", "output_length", "block_size", "turn", "retention_ms", "retained_prefix_tokens",
    "prefix_retention_ms",
)  # fmt: skip


def _pa() -> Any:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # a dependency of kvpool; a broken install gets a sentence, not a traceback
        raise TraceFormatError(f"Parquet traces need pyarrow ({exc})") from None
    return pa, pq


def schema(integer_arrivals: bool) -> Any:
    """The columns of a kvpool Parquet trace."""
    pa, _ = _pa()
    ids = pa.list_(pa.int64())
    return pa.schema(
        [
            ("request_id", pa.string()),
            ("arrival_ms", pa.int64() if integer_arrivals else pa.float64()),
            ("input_length", pa.int64()),
            ("output_length", pa.int64()),
            ("block_size", pa.int64()),
            ("tenant", pa.string()),
            ("workload", pa.string()),
            ("conversation_id", pa.string()),
            ("turn", pa.int64()),
            ("hash_ids", ids),
            ("tokens", ids),
            ("output_tokens", ids),
            ("cache_key", pa.string()),
            ("retention_tier", pa.string()),
            ("retention_ms", pa.int64()),
            ("retained_prefix_tokens", pa.int64()),
            ("prefix_retention_tier", pa.string()),
            ("prefix_retention_ms", pa.int64()),
            ("session_end", pa.bool_()),
            ("extra", pa.string()),  # the record's other fields as one JSON object (null: none)
        ],
        metadata={FORMAT_KEY: KVPOOL_FORMAT.encode()},
    )


def is_parquet(path: str | Path) -> bool:
    """Whether ``path`` holds a Parquet file (by its first bytes; the name may say anything)."""
    try:
        with open(path, "rb") as fh:
            return fh.read(4) == PARQUET_MAGIC
    except OSError:
        return False


def write_parquet(requests: Iterable[Request], path: str | Path, row_group: int = 131_072) -> int:
    """Write ``requests`` as a Parquet trace at ``path`` (atomically), ``row_group`` rows at a time (each
    group's id columns built from one offsets and one values array); returns the number of rows."""
    pa, pq = _pa()
    reqs = list(requests)
    for req in reqs:  # a file of typed columns: what would change type on the way is refused, not coerced
        for name in ("request_id", "tenant", "workload", "conversation_id"):
            value = getattr(req, name)
            if value is not None and not isinstance(value, str):
                message = f"request {req.request_id!r}: {name} {value!r} is not a string"
                raise TraceFormatError(message, str(path))
    sch = schema(all(type(r.arrival_ms) is int for r in reqs))
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with pq.ParquetWriter(tmp, sch, compression="zstd") as writer:
            for start in range(0, max(len(reqs), 1), row_group):
                writer.write_table(_table(pa, sch, reqs[start : start + row_group]))
        os.replace(tmp, target)
    except (pa.ArrowException, OverflowError) as exc:
        raise TraceFormatError(f"cannot write Parquet: {exc}", str(path)) from None
    except OSError as exc:
        raise TraceFormatError(f"cannot write: {exc.strerror or exc}", str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return len(reqs)


def _table(pa: Any, sch: Any, reqs: Sequence[Request]) -> Any:
    """One row group of ``reqs`` as an Arrow table of schema ``sch``."""
    arrays: dict[str, Any] = {
        "request_id": pa.array([r.request_id for r in reqs], pa.string()),
        "arrival_ms": pa.array([r.arrival_ms for r in reqs], sch.field("arrival_ms").type),
        "session_end": pa.array([r.session_end for r in reqs], pa.bool_()),
        "extra": pa.array(
            [json.dumps(r.extra, separators=(",", ":")) if r.extra else None for r in reqs], pa.string()
        ),
    }
    for name in ("tenant", "workload", *OPTIONAL_STRINGS[:-1]):
        arrays[name] = pa.array([getattr(r, name) for r in reqs], pa.string())
    for name in INT_FIELDS:
        arrays[name] = pa.array([getattr(r, name) for r in reqs], pa.int64())
    for name in LIST_FIELDS:
        arrays[name] = _list_column(pa, [getattr(r, name) for r in reqs])
    return pa.table([arrays[f.name] for f in sch], schema=sch)


def _list_column(pa: Any, lists: Sequence[list[int] | None]) -> Any:
    """``list<int64>`` built from one offsets array and one values array (not one Python list per row)."""
    lengths = np.fromiter((0 if v is None else len(v) for v in lists), np.int64, len(lists))
    total = int(lengths.sum())
    if total >= 2**31:
        raise TraceFormatError(f"{total} ids in one row group; write smaller row groups")
    offsets = np.zeros(len(lists) + 1, np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((x for v in lists if v for x in v), np.int64, total)
    mask = pa.array([v is None for v in lists], pa.bool_())
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values), mask=mask)


READ_BATCH_ROWS = 65_536


def read_parquet(path: str | Path) -> list[Request]:
    """Every record of a Parquet trace, checked column-wise; errors name the file, row and field."""
    out: list[Request] = []
    for batch in _batches(path):  # a list per batch, not a generator step per record
        out.extend(batch)
    return out


def iter_parquet(path: str | Path) -> Iterator[Request]:
    """The records of a Parquet trace, read :data:`READ_BATCH_ROWS` rows at a time (a trace larger than
    memory streams, as a JSONL one does), each batch checked before any of its records is yielded."""
    for batch in _batches(path):
        yield from batch


def _batches(path: str | Path) -> Iterator[list[Request]]:
    """The records of a Parquet trace, :data:`READ_BATCH_ROWS` rows at a time, each batch checked."""
    pa, pq = _pa()
    where = str(path)
    try:
        pf = pq.ParquetFile(path)
        fmt = (pf.schema_arrow.metadata or {}).get(FORMAT_KEY)
        if fmt is not None and fmt != KVPOOL_FORMAT.encode():
            raise TraceFormatError(f"unsupported format {fmt.decode(errors='replace')!r}", where)
        first = 0
        for batch in pf.iter_batches(batch_size=READ_BATCH_ROWS):
            table = pa.Table.from_batches([batch])
            cols = _columns(table, where)
            _check(cols, table.num_rows, where, first)
            yield _build(cols, table.num_rows, where, first)
            first += table.num_rows
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(f"unreadable Parquet file ({exc})", where) from None


def parquet_memory_estimate(path: str | Path) -> int:
    """Bytes the trace takes once loaded, roughly: Python ints and lists cost ~6x Arrow's uncompressed
    columns (8-byte ids become list slots and int objects)."""
    _, pq = _pa()
    meta = pq.ParquetFile(path).metadata
    return 6 * sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups))


def _build(cols: dict[str, Any], n: int, where: str, first: int) -> list[Request]:
    with collector_paused():  # a streamed batch too is tens of thousands of new records
        return _requests(cols, n, where, first)


_INTEGER, _NUMBER, _STRING, _BOOL, _IDS = "integer", "number", "string", "bool", "list of integers"


def _kind_of(name: str) -> str:
    if name in LIST_FIELDS:
        return _IDS
    if name in INT_FIELDS:
        return _INTEGER
    if name == "arrival_ms":
        return _NUMBER
    return _BOOL if name == "session_end" else _STRING


def _type_is(pa: Any, kind: str, t: Any) -> bool:
    """Whether Arrow type ``t`` holds ``kind`` as it is (no parsing or coercion: a string "10" is not an
    integer, a bool is not one, as ``Request.validate`` says of JSON values)."""
    if pa.types.is_null(t):
        return True  # a column with no value at all: the field left out of every row
    if kind == _INTEGER:
        return pa.types.is_integer(t)
    if kind == _NUMBER:
        return pa.types.is_integer(t) or pa.types.is_floating(t)
    if kind == _STRING:
        return pa.types.is_string(t) or pa.types.is_large_string(t)
    if kind == _BOOL:
        return pa.types.is_boolean(t)
    return (pa.types.is_list(t) or pa.types.is_large_list(t)) and pa.types.is_integer(t.value_type)


def _columns(table: Any, where: str) -> dict[str, Any]:
    """Each known column cast to its schema type once its own type was checked (a column that holds
    something else is an error naming it); absent columns read as None (the field left out)."""
    pa, _ = _pa()
    names = set(table.column_names)
    for need in ("request_id", "arrival_ms", "input_length", "output_length"):
        if need not in names:
            raise TraceFormatError(f"missing column {need!r}", where)
    if "hash_ids" not in names and "tokens" not in names:
        raise TraceFormatError("a trace needs a 'hash_ids' or a 'tokens' column", where)
    integer_arrivals = pa.types.is_integer(table.schema.field("arrival_ms").type)
    out: dict[str, Any] = {}
    for field in schema(integer_arrivals):
        if field.name not in names:
            out[field.name] = None
            continue
        column = table.column(field.name)
        kind = _kind_of(field.name)
        if not _type_is(pa, kind, column.type):
            raise TraceFormatError(f"column {field.name!r} holds {column.type}, not a {kind}", where)
        try:
            column = column.cast(field.type)
        except (pa.ArrowException, ValueError) as exc:
            raise TraceFormatError(f"column {field.name!r} does not fit {field.type}: {exc}", where) from None
        out[field.name] = column.combine_chunks() if field.name in LIST_FIELDS else column
    return out


def _fail(where: str, row: int, field: str, message: str) -> TraceFormatError:
    """The error for 0-based file row ``row``."""
    return TraceFormatError(f"row {row + 1}: field {field!r}: {message}", where)


def _ints(column: Any, default: int, n: int) -> np.ndarray:
    """An int64 column as numpy, nulls (an optional field left out) read as ``default``."""
    if column is None:
        return np.full(n, default, np.int64)
    if column.null_count:
        column = column.fill_null(default)
    return np.array(column.to_numpy(zero_copy_only=False), np.int64)  # a writable copy


def _check(cols: dict[str, Any], n: int, where: str, first: int = 0) -> None:
    """``Request.validate``'s rules over whole columns; the first failing row is named."""
    for name in ("request_id", "arrival_ms", "input_length", "output_length", "tenant", "workload"):
        if cols[name] is not None and cols[name].null_count:
            row = int(np.flatnonzero(cols[name].is_null().to_numpy(zero_copy_only=False))[0])
            raise _fail(where, first + row, name, "missing (null)")
    arrival = cols["arrival_ms"].to_numpy(zero_copy_only=False).astype(np.float64)
    bad = ~np.isfinite(arrival) | (arrival < 0)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise _fail(where, first + row, "arrival_ms", f"must be finite and >= 0, got {arrival[row]!r}")
    ints = {name: _ints(cols[name], 512 if name == "block_size" else 0, n) for name in INT_FIELDS}
    for name, values in ints.items():
        if (values < 0).any():
            row = int(np.flatnonzero(values < 0)[0])
            got = int(values[row])
            raise _fail(where, first + row, name, f"must be a non-negative integer, got {got}")
    if (ints["block_size"] == 0).any():
        row = int(np.flatnonzero(ints["block_size"] == 0)[0])
        raise _fail(where, first + row, "block_size", "must be positive")
    present = {}
    for name in LIST_FIELDS:
        column = cols[name]
        if column is None:
            present[name] = np.zeros(n, bool)
            continue
        present[name] = ~column.is_null().to_numpy(zero_copy_only=False)
        values = column.values.to_numpy(zero_copy_only=False) if len(column.values) else np.zeros(0, np.int64)
        if (values < 0).any():
            offsets = column.offsets.to_numpy(zero_copy_only=False)
            row = int(np.searchsorted(offsets, int(np.flatnonzero(values < 0)[0]), side="right") - 1)
            raise _fail(where, first + row, name, "must hold non-negative integers")
    neither = ~present["hash_ids"] & ~present["tokens"]
    if neither.any():
        row = int(np.flatnonzero(neither)[0])
        raise _fail(where, first + row, "hash_ids", "a record needs 'tokens' or 'hash_ids'")
    lengths = {name: _lengths(cols[name], n) for name in LIST_FIELDS}
    rules = (
        ("tokens", present["tokens"] & (lengths["tokens"] != ints["input_length"]), "input_length"),
        (
            "output_tokens",
            present["output_tokens"] & (lengths["output_tokens"] != ints["output_length"]),
            "output_length",
        ),
        (
            "hash_ids",
            present["hash_ids"] & (lengths["hash_ids"] != -(-ints["input_length"] // ints["block_size"])),
            "ceil(input_length / block_size)",
        ),
    )
    for name, wrong, against in rules:
        if wrong.any():
            row = int(np.flatnonzero(wrong)[0])
            count = int(lengths[name][row])
            raise _fail(where, first + row, name, f"{count} values, {against} says otherwise")
    if cols["cache_key"] is not None and cols["cache_key"].null_count < n:
        import pyarrow.compute as pc

        sizes = pc.utf8_length(cols["cache_key"]).fill_null(1).to_numpy(zero_copy_only=False)
        bad = (sizes <= 0) | (sizes > MAX_CACHE_KEY_CHARS)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise _fail(where, first + row, "cache_key", f"must be 1 to {MAX_CACHE_KEY_CHARS} characters")


def _lengths(column: Any, n: int) -> np.ndarray:
    if column is None:
        return np.zeros(n, np.int64)
    return np.diff(column.offsets.to_numpy(zero_copy_only=False)).astype(np.int64)


def _split(column: Any, n: int) -> list[list[int] | None]:
    """One Python list per row from the offsets and values columns (None where the row has none)."""
    if column is None or column.null_count == n:
        return [None] * n
    offsets = column.offsets.to_numpy(zero_copy_only=False).tolist()
    values = column.values.to_numpy(zero_copy_only=False).tolist()
    rows = [values[a:b] for a, b in itertools.pairwise(offsets)]
    if column.null_count:
        for i in np.flatnonzero(column.is_null().to_numpy(zero_copy_only=False)).tolist():
            rows[i] = None
    return rows


def _strings(column: Any, default: str | None, n: int) -> list[Any]:
    if column is None or column.null_count == n:
        return [default] * n
    values = column.to_pylist()
    if default is None or not column.null_count:
        return values
    return [default if v is None else v for v in values]


def _requests(cols: dict[str, Any], n: int, where: str, first: int = 0) -> list[Request]:
    """The rows as :class:`Request` objects: each field turned into one Python list, then zipped (a row
    costs one constructor call). Rows with hints also pass ``Request.validate`` (their pair rules)."""
    ints = {name: _ints(cols[name], 512 if name == "block_size" else 0, n) for name in INT_FIELDS}
    text = {name: _strings(cols[name], None, n) for name in OPTIONAL_STRINGS}
    ends = [False] * n if cols["session_end"] is None else cols["session_end"].fill_null(False).to_pylist()
    tiers = (("retention_tier", "retention_ms"), ("prefix_retention_tier", "prefix_retention_ms"))
    for tier_name, ms_name in tiers:
        # a tier whose TTL is left out (null) names its standard TTL, as in JSONL (``tier_ms``)
        ms_column = cols[ms_name]
        if ms_column is None:
            left_out = np.ones(n, bool)
        else:
            left_out = ms_column.is_null().to_numpy(zero_copy_only=False)
        for i in np.flatnonzero(left_out).tolist():
            tier = text[tier_name][i]
            if tier is not None:
                try:
                    ints[ms_name][i] = tier_ms(tier)
                except TraceFormatError as exc:
                    raise _fail(where, first + i, tier_name, str(exc)) from None
    hinted = (ints["retention_ms"] | ints["prefix_retention_ms"] | ints["retained_prefix_tokens"]).astype(
        bool
    ) | np.asarray(ends, bool)
    for name in ("retention_tier", "prefix_retention_tier"):
        hinted |= np.fromiter((v is not None for v in text[name]), bool, n)
    extras: list[dict[str, Any]] = [{} for _ in range(n)]  # one dict per record, as JSONL reading gives
    for i, raw in enumerate(text["extra"]):
        if raw:
            try:
                fields = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise _fail(where, first + i, "extra", f"not a JSON object ({exc.msg})") from None
            if not isinstance(fields, dict):
                raise _fail(where, first + i, "extra", "not a JSON object")
            extras[i] = fields
    rows = zip(
        _strings(cols["request_id"], None, n),
        cols["arrival_ms"].to_pylist(),
        ints["input_length"].tolist(),
        ints["output_length"].tolist(),
        _split(cols["tokens"], n),
        _split(cols["output_tokens"], n),
        _split(cols["hash_ids"], n),
        ints["block_size"].tolist(),
        _strings(cols["tenant"], "default", n),
        _strings(cols["workload"], "trace", n),
        text["conversation_id"],
        ints["turn"].tolist(),
        text["cache_key"],
        text["retention_tier"],
        ints["retention_ms"].tolist(),
        ints["retained_prefix_tokens"].tolist(),
        text["prefix_retention_tier"],
        ints["prefix_retention_ms"].tolist(),
        ends,
        extras,
        strict=True,
    )
    out = [Request(*row) for row in rows]  # in the dataclass's field order (ROW_ORDER, checked by a test)
    for i in np.flatnonzero(hinted).tolist():  # the hint rules (pairs of fields): rare rows, full check
        try:
            out[i].validate()
        except TraceFormatError as exc:
            raise TraceFormatError(f"row {first + i + 1}: {exc}", where) from None
    return out
