"""Columnar traces: a kvpool trace as one Parquet file, read back in a second instead of parsed line by line.

Why: a production trace is millions of requests; JSON parses every id of every line into a Python object on
every run (a 1 M-request Mooncake file is ~34 M ids). Parquet stores each field as one column, compressed,
and the ids as Arrow's ``list<int64>``: one offsets column and one integer column, which numpy reads
without a per-id step and which the user's own tools (pandas, polars, DuckDB, Spark) read as they are.

The file is a lossless form of the kvpool JSONL format (``trace``): one row per request, in file order, the
columns of :data:`SCHEMA` (nullable where the record's field is optional) and ``kvpool.format`` =
``kvpool-trace/1`` in the file's metadata. A Mooncake trace converts with its request ids and workload made
explicit, as ``trace convert --to kvpool`` writes them. ``arrival_ms`` is written as int64 when every
arrival is an integer (Mooncake's are), so ints read back as ints.

Reading checks what ``Request.validate`` checks, column-wise (one numpy pass per rule, so a bad row costs
nothing until it is found), and names the file, the 1-based row and the field of the first bad record.
A truncated or foreign file is one ``TraceFormatError`` naming the file. Writing goes to a temporary file
beside the target, renamed over it once complete: nothing half-written is ever at the output path.
"""

from __future__ import annotations

import gc
import itertools
import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from kvpool.workloads.errors import TraceFormatError
from kvpool.workloads.trace_record import KVPOOL_FORMAT, MAX_CACHE_KEY_CHARS, Request

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
    """Write ``requests`` as a Parquet trace at ``path`` (atomically); returns the number of rows."""
    pa, pq = _pa()
    reqs = list(requests)
    integer_arrivals = all(type(r.arrival_ms) is int for r in reqs)
    columns: dict[str, list[Any]] = {
        "request_id": [r.request_id for r in reqs],
        "arrival_ms": [r.arrival_ms for r in reqs],
        "tenant": [r.tenant for r in reqs],
        "workload": [r.workload for r in reqs],
        "conversation_id": [r.conversation_id for r in reqs],
        "session_end": [r.session_end for r in reqs],
        "extra": [json.dumps(r.extra, separators=(",", ":")) if r.extra else None for r in reqs],
    }
    for name in INT_FIELDS:
        columns[name] = [getattr(r, name) for r in reqs]
    for name in ("cache_key", "retention_tier", "prefix_retention_tier"):
        columns[name] = [getattr(r, name) for r in reqs]
    target = Path(path)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        arrays = {name: pa.array(values) for name, values in columns.items()}
        for name in LIST_FIELDS:
            arrays[name] = _list_column(pa, [getattr(r, name) for r in reqs])
        sch = schema(integer_arrivals)
        table = pa.table([arrays[f.name].cast(f.type) for f in sch], schema=sch)
        pq.write_table(table, tmp, row_group_size=row_group, compression="zstd")
        os.replace(tmp, target)
    except (pa.ArrowException, OverflowError) as exc:
        raise TraceFormatError(f"cannot write Parquet: {exc}", str(path)) from None
    finally:
        tmp.unlink(missing_ok=True)
    return len(reqs)


def _list_column(pa: Any, lists: Sequence[list[int] | None]) -> Any:
    """``list<int64>`` built from one offsets array and one values array (not one Python list per row)."""
    lengths = np.fromiter((0 if v is None else len(v) for v in lists), np.int64, len(lists))
    offsets = np.zeros(len(lists) + 1, np.int32 if lengths.sum() < 2**31 else np.int64)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((x for v in lists if v for x in v), np.int64, int(lengths.sum()))
    mask = pa.array([v is None for v in lists])
    offsets_array = pa.array(offsets)
    if offsets.dtype == np.int64:
        return pa.LargeListArray.from_arrays(offsets_array, pa.array(values), mask=mask).cast(
            pa.list_(pa.int64())
        )
    return pa.ListArray.from_arrays(offsets_array, pa.array(values), mask=mask)


def read_parquet(path: str | Path) -> list[Request]:
    """Every record of a Parquet trace, checked column-wise; errors name the file, row and field."""
    pa, pq = _pa()
    where = str(path)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        raise TraceFormatError(f"unreadable Parquet file ({exc})", where) from None
    fmt = (table.schema.metadata or {}).get(FORMAT_KEY)
    if fmt is not None and fmt != KVPOOL_FORMAT.encode():
        raise TraceFormatError(f"unsupported format {fmt.decode(errors='replace')!r}", where)
    cols = _columns(table, where)
    n = table.num_rows
    _check(cols, n, where)
    # Millions of new lists and records trip the cyclic collector every few hundred allocations, and each
    # pass walks everything built so far (40 % of a load measured); nothing built here forms a cycle.
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _requests(cols, n, where)
    finally:
        if was_enabled:
            gc.enable()


def _columns(table: Any, where: str) -> dict[str, Any]:
    """Each known column as Python/numpy values, cast to its schema type (a column that cannot be is an
    error naming it); absent optional columns read as null."""
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
        try:
            column = table.column(field.name).cast(field.type)
        except (pa.ArrowException, ValueError) as exc:
            raise TraceFormatError(f"column {field.name!r} is not {field.type}: {exc}", where) from None
        out[field.name] = column.combine_chunks() if field.name in LIST_FIELDS else column
    return out


def _fail(where: str, row: int, field: str, message: str) -> TraceFormatError:
    return TraceFormatError(f"row {row + 1}: field {field!r}: {message}", where)


def _ints(column: Any, default: int, n: int) -> np.ndarray:
    """An int64 column as numpy, nulls (an optional field left out) read as ``default``."""
    if column is None:
        return np.full(n, default, np.int64)
    if column.null_count:
        column = column.fill_null(default)
    return column.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def _check(cols: dict[str, Any], n: int, where: str) -> None:
    """``Request.validate``'s rules over whole columns; the first failing row is named."""
    for name in ("request_id", "arrival_ms", "input_length", "output_length"):
        if cols[name].null_count:
            row = int(np.flatnonzero(cols[name].is_null().to_numpy(zero_copy_only=False))[0])
            raise _fail(where, row, name, "missing (null)")
    arrival = cols["arrival_ms"].to_numpy(zero_copy_only=False).astype(np.float64)
    bad = ~np.isfinite(arrival) | (arrival < 0)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise _fail(where, row, "arrival_ms", f"must be finite and >= 0, got {arrival[row]!r}")
    ints = {name: _ints(cols[name], 512 if name == "block_size" else 0, n) for name in INT_FIELDS}
    for name, values in ints.items():
        if (values < 0).any():
            row = int(np.flatnonzero(values < 0)[0])
            raise _fail(where, row, name, f"must be a non-negative integer, got {int(values[row])}")
    if (ints["block_size"] == 0).any():
        raise _fail(where, int(np.flatnonzero(ints["block_size"] == 0)[0]), "block_size", "must be positive")
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
            raise _fail(where, row, name, "must hold non-negative integers")
    neither = ~present["hash_ids"] & ~present["tokens"]
    if neither.any():
        row = int(np.flatnonzero(neither)[0])
        raise _fail(where, row, "hash_ids", "a record needs 'tokens' or 'hash_ids'")
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
            raise _fail(where, row, name, f"{int(lengths[name][row])} values, {against} says otherwise")
    if cols["cache_key"] is not None and cols["cache_key"].null_count < n:
        import pyarrow.compute as pc

        sizes = pc.utf8_length(cols["cache_key"]).fill_null(1).to_numpy(zero_copy_only=False)
        bad = (sizes <= 0) | (sizes > MAX_CACHE_KEY_CHARS)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise _fail(where, row, "cache_key", f"must be 1 to {MAX_CACHE_KEY_CHARS} characters")


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


def _requests(cols: dict[str, Any], n: int, where: str) -> list[Request]:
    """The rows as :class:`Request` objects: each field turned into one Python list, then zipped (a row
    costs one constructor call). Rows with hints also pass ``Request.validate`` (their pair rules)."""
    ints = {name: _ints(cols[name], 512 if name == "block_size" else 0, n) for name in INT_FIELDS}
    text = {name: _strings(cols[name], None, n) for name in OPTIONAL_STRINGS}
    ends = [False] * n if cols["session_end"] is None else cols["session_end"].fill_null(False).to_pylist()
    hinted = (ints["retention_ms"] | ints["prefix_retention_ms"]).astype(bool) | np.asarray(ends, bool)
    for name in ("retention_tier", "prefix_retention_tier"):
        hinted |= np.fromiter((v is not None for v in text[name]), bool, n)
    extras: list[dict[str, Any]] = [{} for _ in range(n)]  # one dict per record, as JSONL reading gives
    for i, raw in enumerate(text["extra"]):
        if raw:
            try:
                fields = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise _fail(where, i, "extra", f"not a JSON object ({exc.msg})") from None
            if not isinstance(fields, dict):
                raise _fail(where, i, "extra", "not a JSON object")
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
            raise TraceFormatError(f"row {i + 1}: {exc}", where) from None
    return out
