"""Reading traces in their on-disk forms: Mooncake FAST'25 JSONL, kvpool's richer JSONL (writing them is
``trace_write``) and kvpool's columnar Parquet form (``trace_columnar``, read through here too); the record
itself, :class:`Request`, and its rules are ``trace_record``.

Mooncake lines are ``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}`` with one id
per 512-token block, chained (equal id => equal block *and* equal prefix). They carry no tokens, tenants
or conversations, so they can drive the simulator but not a live model. kvpool lines add what a live
replay and per-workload reporting need (see :class:`Request`); either tokens or hash ids may be present.

Conversion (documented loss, docs/design/workloads.md):

- Mooncake -> kvpool loses nothing; tokens can be *synthesised* from the ids
  (``synthetic_tokens.synthesize_tokens``) so a live gateway sees prompts with exactly the trace's sharing
  structure.
- kvpool -> Mooncake loses tokens, tenant (folded into the ids), workload, conversation/turn, request ids,
  output tokens, retention hints and sub-millisecond arrival; ids are recomputed per ``block_size`` chunk
  (last one partial) from a chained SHA-256 and renumbered 0, 1, 2... in first-seen order, as the
  published traces are.
"""

from __future__ import annotations

import gzip
import heapq
import io
import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from kvpool.workloads.errors import TraceFormatError
from kvpool.workloads.trace_record import KVPOOL_FORMAT, MOONCAKE_BLOCK, Request, collector_paused, tier_ms

DATA_DIR = Path(__file__).resolve().parent / "data"
BUNDLED_TRACES = {"conversation": "conversation_trace.jsonl.gz", "synthetic": "synthetic_trace.jsonl.gz"}


# ----------------------------------------------------------------------------------------------- files


def bundled_trace(name: str) -> Path:
    """Path of a trace shipped in ``workloads/data`` (``conversation`` or ``synthetic``)."""
    try:
        return DATA_DIR / BUNDLED_TRACES[name]
    except KeyError:
        raise TraceFormatError(f"no bundled trace {name!r}; choose one of {sorted(BUNDLED_TRACES)}") from None


def resolve_trace(spec: str) -> Path:
    """A bundled trace name or a file path, checked to exist."""
    if spec in BUNDLED_TRACES:
        return bundled_trace(spec)
    path = Path(spec)
    if not path.is_file():
        names = sorted(BUNDLED_TRACES)
        raise TraceFormatError(f"trace file not found (and not a bundled name {names})", spec)
    return path


def open_text(path: str | Path, mode: str) -> IO[str]:
    """A text handle on ``path``, gzip when it ends in ``.gz`` (reading and writing alike)."""
    p = str(path)
    if p.endswith(".gz"):
        return io.TextIOWrapper(gzip.open(p, mode + "b"), encoding="utf-8")
    return open(p, mode, encoding="utf-8")


def _json_lines(path: str | Path) -> Iterator[tuple[int, dict[str, Any]]]:
    try:
        fh = open_text(path, "r")
    except OSError as e:
        raise TraceFormatError(f"cannot open: {e.strerror or e}", str(path)) from None
    with fh:
        try:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise TraceFormatError(f"not valid JSON ({e.msg})", str(path), lineno) from None
                if not isinstance(obj, dict):
                    raise TraceFormatError("each line must be a JSON object", str(path), lineno)
                yield lineno, obj
        except (UnicodeDecodeError, gzip.BadGzipFile, EOFError) as e:
            raise TraceFormatError(f"unreadable file ({e})", str(path)) from None


def _located(path: str | Path, lineno: int, fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except TraceFormatError as e:
        raise TraceFormatError(str(e), str(path), lineno) from None


def mooncake_record(obj: dict[str, Any], index: int, workload: str = "trace") -> Request:
    """A Mooncake line (already parsed) as a :class:`Request`."""
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        raise TraceFormatError(f"missing Mooncake field(s) {missing}")
    return Request(
        request_id=f"{workload}-{index}",
        arrival_ms=obj["timestamp"],
        input_length=obj["input_length"],
        output_length=obj["output_length"],
        hash_ids=obj["hash_ids"],
        block_size=MOONCAKE_BLOCK,
        workload=workload,
    ).validate()


HINT_FIELDS = (
    "cache_key", "retention_tier", "retention_ms", "retained_prefix_tokens", "prefix_retention_tier",
    "prefix_retention_ms", "session_end",
)  # fmt: skip


def kvpool_record(obj: dict[str, Any]) -> Request:
    """A kvpool line (already parsed) as a :class:`Request`."""
    fmt = obj.get("format", KVPOOL_FORMAT)
    if fmt != KVPOOL_FORMAT:
        raise TraceFormatError(f"unsupported format {fmt!r}; expected {KVPOOL_FORMAT!r}")
    for k in ("request_id", "arrival_ms", "input_length", "output_length"):
        if k not in obj:
            raise TraceFormatError(f"missing field {k!r}")
    known = {
        "format", "request_id", "arrival_ms", "input_length", "output_length", "tokens", "output_tokens",
        "hash_ids", "block_size", "tenant", "workload", "conversation_id", "turn", *HINT_FIELDS,
    }  # fmt: skip
    req = Request(
        request_id=str(obj["request_id"]),
        arrival_ms=obj["arrival_ms"],
        input_length=obj["input_length"],
        output_length=obj["output_length"],
        tokens=obj.get("tokens"),
        output_tokens=obj.get("output_tokens"),
        hash_ids=obj.get("hash_ids"),
        block_size=obj.get("block_size", MOONCAKE_BLOCK),
        tenant=obj.get("tenant", "default"),
        workload=obj.get("workload", "trace"),
        conversation_id=obj.get("conversation_id"),
        turn=obj.get("turn", 0),
        cache_key=obj.get("cache_key"),
        retention_tier=obj.get("retention_tier"),
        retention_ms=tier_ms(obj.get("retention_tier"), obj.get("retention_ms")),
        retained_prefix_tokens=obj.get("retained_prefix_tokens", 0),
        prefix_retention_tier=obj.get("prefix_retention_tier"),
        prefix_retention_ms=tier_ms(obj.get("prefix_retention_tier"), obj.get("prefix_retention_ms")),
        session_end=obj.get("session_end", False),
        extra={k: v for k, v in obj.items() if k not in known},
    )
    return req.validate()


def read_mooncake(path: str | Path, workload: str | None = None) -> list[Request]:
    """All records of a Mooncake JSONL file (``.gz`` allowed); errors name the line."""
    name = workload or _stem(path)
    return [_located(path, n, mooncake_record, obj, i, name) for i, (n, obj) in enumerate(_json_lines(path))]


def read_kvpool(path: str | Path) -> list[Request]:
    """All records of a kvpool JSONL file (``.gz`` allowed); errors name the line."""
    return [_located(path, n, kvpool_record, obj) for n, obj in _json_lines(path)]


def read_trace(path: str | Path, workload: str | None = None) -> list[Request]:
    """Any of the three forms: a Parquet trace (``trace_columnar``, by its first bytes; its records are
    kvpool ones, ``workload`` is theirs), else JSONL of either format, decided per line: a line with
    ``timestamp`` and no ``arrival_ms`` is Mooncake."""
    from kvpool.workloads.trace_columnar import is_parquet, read_parquet

    with collector_paused(freeze=True):
        if is_parquet(path):
            return read_parquet(path)
        return list(iter_trace(path, workload))


def iter_trace(path: str | Path, workload: str | None = None) -> Iterator[Request]:
    """The records of :func:`read_trace` one at a time, read as they are consumed (a trace larger than
    memory can be replayed; see :func:`arrival_ordered`): JSONL line by line, Parquet a batch of rows at
    a time."""
    from kvpool.workloads.trace_columnar import is_parquet, iter_parquet

    if is_parquet(path):
        yield from iter_parquet(path)
        return
    name = workload or _stem(path)
    for i, (n, obj) in enumerate(_json_lines(path)):
        if "timestamp" in obj and "arrival_ms" not in obj:
            yield _located(path, n, mooncake_record, obj, i, name)
        else:
            yield _located(path, n, kvpool_record, obj)


REORDER_WINDOW = 4096


def arrival_ordered(requests: Iterable[Request], window: int = REORDER_WINDOW) -> Iterator[Request]:
    """``requests`` in arrival order (stable), holding at most ``window`` of them: a stream may be out of
    order by up to ``window`` records (traces logged by several frontends are, by a little). A record
    later than that is an error, not a silent reorder: a simulation must see arrivals in order."""
    heap: list[tuple[float, int, Request]] = []
    last = -math.inf
    for seq, req in enumerate(requests):
        if req.arrival_ms < last:
            raise TraceFormatError(
                f"request {req.request_id} arrives at {req.arrival_ms} ms, before {last} ms "
                "already replayed: "
                f"a streamed trace must be in arrival order within {window} records "
                "(sort the file, or load it whole with --limit)"
            )
        heapq.heappush(heap, (req.arrival_ms, seq, req))
        if len(heap) > window:
            last, _, out = heapq.heappop(heap)
            yield out
    while heap:
        yield heapq.heappop(heap)[2]


def _stem(path: str | Path) -> str:
    name = Path(path).name
    for suffix in (".gz", ".parquet", ".jsonl", ".json"):
        name = name.removesuffix(suffix)
    return name.removesuffix("_trace") or "trace"
