"""Trace records and reading their on-disk forms: Mooncake FAST'25 JSONL, kvpool's richer JSONL (writing
them is ``trace_write``) and kvpool's columnar Parquet form (``trace_columnar``, read through here too).

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvpool.workloads.errors import TraceFormatError

MOONCAKE_BLOCK = 512  # tokens per hash id in the FAST'25 traces
DATA_DIR = Path(__file__).resolve().parent / "data"
BUNDLED_TRACES = {"conversation": "conversation_trace.jsonl.gz", "synthetic": "synthetic_trace.jsonl.gz"}
KVPOOL_FORMAT = "kvpool-trace/1"


@dataclass(slots=True)
class Request:
    """One request of a workload, in arrival order.

    ``tokens`` are the prompt ids (what a live replay sends); ``output_tokens`` the reply a later turn
    quotes (generators only, so the simulator can store output blocks as decode would). ``hash_ids`` are
    Mooncake-style block ids of ``block_size`` tokens, the last block possibly partial.
    """

    request_id: str
    arrival_ms: float
    input_length: int
    output_length: int
    tokens: list[int] | None = None
    output_tokens: list[int] | None = None
    hash_ids: list[int] | None = None
    block_size: int = MOONCAKE_BLOCK
    tenant: str = "default"
    workload: str = "trace"
    conversation_id: str | None = None
    turn: int = 0
    # Client retention hints (docs/design/eviction.md §1.3), as an API client states them: absent from
    # Mooncake traces. ``cache_key`` groups a session's chains (OpenAI ``prompt_cache_key``);
    # ``retention_tier`` / ``retention_ms`` ask the store to keep the prompt's chain that long (Anthropic
    # ``cache_control`` ttl "5m" / "1h"), and price its written tokens at that tier; the first
    # ``retained_prefix_tokens`` tokens (a system prompt, a repository) may carry their own, longer tier;
    # ``session_end`` says no turn follows, so the session's pins can go.
    cache_key: str | None = None
    retention_tier: str | None = None
    retention_ms: int = 0
    retained_prefix_tokens: int = 0
    prefix_retention_tier: str | None = None
    prefix_retention_ms: int = 0
    session_end: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def has_hints(self) -> bool:
        """Whether the record carries any retention hint (the simulator skips the rest cheaply)."""
        return bool(self.retention_ms or self.prefix_retention_ms or self.session_end)

    def validate(self) -> Request:
        """Raise ``TraceFormatError`` (no location) if the record is inconsistent; return self."""
        for name in ("input_length", "output_length", "turn", "block_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise TraceFormatError(f"{name} must be a non-negative integer, got {value!r}")
        if self.block_size == 0:
            raise TraceFormatError("block_size must be positive")
        if not isinstance(self.arrival_ms, int | float) or isinstance(self.arrival_ms, bool):
            raise TraceFormatError(f"arrival time must be a number, got {self.arrival_ms!r}")
        if not math.isfinite(self.arrival_ms) or self.arrival_ms < 0:
            raise TraceFormatError(f"arrival time must be finite and >= 0, got {self.arrival_ms!r}")
        if self.tokens is None and self.hash_ids is None:
            raise TraceFormatError("a record needs 'tokens' or 'hash_ids'")
        if self.tokens is not None:
            _check_int_list("tokens", self.tokens)
            if len(self.tokens) != self.input_length:
                raise TraceFormatError(
                    f"input_length {self.input_length} != number of tokens {len(self.tokens)}"
                )
        if self.output_tokens is not None:
            _check_int_list("output_tokens", self.output_tokens)
            if len(self.output_tokens) != self.output_length:
                raise TraceFormatError(
                    f"output_length {self.output_length} != number of output tokens {len(self.output_tokens)}"
                )
        if self.hash_ids is not None:
            _check_int_list("hash_ids", self.hash_ids)
            want = -(-self.input_length // self.block_size)
            if len(self.hash_ids) != want:
                raise TraceFormatError(
                    f"{len(self.hash_ids)} hash_ids for input_length {self.input_length}: expected "
                    f"ceil({self.input_length}/{self.block_size}) = {want}"
                )
        if not isinstance(self.tenant, str) or not isinstance(self.workload, str):
            raise TraceFormatError("tenant and workload must be strings")
        self._validate_hints()
        return self

    def _validate_hints(self) -> None:
        if self.cache_key is not None:
            if not isinstance(self.cache_key, str):
                raise TraceFormatError(f"cache_key must be a string, got {self.cache_key!r}")
            if not 0 < len(self.cache_key) <= MAX_CACHE_KEY_CHARS:
                raise TraceFormatError(
                    f"cache_key must be 1 to {MAX_CACHE_KEY_CHARS} characters, got {len(self.cache_key)}"
                )
        if type(self.session_end) is not bool:
            raise TraceFormatError(f"session_end must be true or false, got {self.session_end!r}")
        for tier_name, ms_name in (
            ("retention_tier", "retention_ms"),
            ("prefix_retention_tier", "prefix_retention_ms"),
        ):
            tier, ms = getattr(self, tier_name), getattr(self, ms_name)
            if type(ms) is not int or ms < 0:
                raise TraceFormatError(f"{ms_name} must be a non-negative integer, got {ms!r}")
            if tier is not None and (not isinstance(tier, str) or not tier):
                raise TraceFormatError(f"{tier_name} must be a non-empty string, got {tier!r}")
            if (tier is None) != (ms == 0):
                raise TraceFormatError(f"{tier_name} and {ms_name} come together (a tier names its TTL)")
        if type(self.retained_prefix_tokens) is not int or self.retained_prefix_tokens < 0:
            raise TraceFormatError(
                f"retained_prefix_tokens must be a non-negative integer, got {self.retained_prefix_tokens!r}"
            )
        if (self.retained_prefix_tokens == 0) != (self.prefix_retention_tier is None):
            raise TraceFormatError("retained_prefix_tokens and prefix_retention_tier come together")
        if self.retained_prefix_tokens > self.input_length:
            raise TraceFormatError(
                f"retained_prefix_tokens {self.retained_prefix_tokens} > input_length {self.input_length}"
            )


# The gateway's bound on a session key (gateway/cache_hints.py MAX_KEY_CHARS, the master's session bound):
# a trace's cache_key must fit it to be replayed live as sent.
MAX_CACHE_KEY_CHARS = 256

# The TTL of each retention tier a client may name (Anthropic's cache_control ttl values; OpenAI's
# ``prompt_cache_retention`` "24h" too). A trace may state another tier with its own ``retention_ms``.
RETENTION_TIERS_MS: dict[str, int] = {"5m": 300_000, "1h": 3_600_000, "24h": 86_400_000}


def tier_ms(tier: str | None, ms: Any = None) -> int:
    """The TTL of ``tier``: ``ms`` when the record states it, else the standard tier's; 0 without a tier.
    A tier that is neither standard nor given a TTL is a ``TraceFormatError`` naming the known ones."""
    if tier is None:
        return 0 if ms is None else ms
    if ms is not None:
        return ms
    try:
        return RETENTION_TIERS_MS[tier]
    except (KeyError, TypeError):
        known = sorted(RETENTION_TIERS_MS)
        raise TraceFormatError(
            f"retention tier {tier!r} has no TTL: give its *_ms, or use one of {known}"
        ) from None


def _check_int_list(name: str, values: object) -> None:
    if not isinstance(values, list):
        raise TraceFormatError(f"{name} must be a list of integers")
    for v in values:
        if type(v) is not int or v < 0:
            raise TraceFormatError(f"{name} must hold non-negative integers, found {v!r}")


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

    if is_parquet(path):
        return read_parquet(path)
    return list(iter_trace(path, workload))


def iter_trace(path: str | Path, workload: str | None = None) -> Iterator[Request]:
    """The records of :func:`read_trace` one at a time, read as they are consumed (a JSONL trace larger
    than memory can be replayed; see :func:`arrival_ordered`). A Parquet trace is read whole (columnar:
    a tenth of the JSONL's memory) and then yielded."""
    from kvpool.workloads.trace_columnar import is_parquet, read_parquet

    if is_parquet(path):
        yield from read_parquet(path)
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
