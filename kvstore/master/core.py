"""MasterCore: the master's state and every call's semantics: node membership and recovery, two-phase puts,
prefix matching with read leases, pins, quotas and the background sweep, over one
:class:`~kvpool.kvstore.index.prefix_index.PrefixIndex`.

Transport-free on purpose: every call is a plain method taking and returning the proto messages and raising
a typed store error (``kvpool.kvstore.errors``, carried to the caller as its class), so the wire server is
a thin adapter and the logic can be driven with a fake clock. Not thread-safe: the server calls it from one
event loop.

What the nodes must do as a consequence of a call (delete evicted/expired/aborted objects, demote to SSD,
promote on a hit) is queued per node and collected by :meth:`MasterCore.take_actions`; the server sends
it with deadlines and never waits for it while answering clients, with one exception: a put placed on a node
that still has a delete of the same key to receive (removed, evicted or corrupt a moment ago) is answered
once that delete was sent, so the old order can neither refuse nor erase the new bytes (the wire server does
this; see ``NodeNotifier.delete_pending``).

Its tunables (:class:`MasterConfig`) and the limits on requests are defined here; the durable quotas and
pins live in ``state``. After a bulk adoption it hands freed C-heap pages back to the OS (the end of this
module says why).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kvpool.kvstore.errors import (
    BadRequestError,
    CapacityExceededError,
    ObjectExistsError,
    ObjectNotFoundError,
    StoreError,
)
from kvpool.kvstore.index.admission import AdmissionConfig
from kvpool.kvstore.index.eviction import make_policy
from kvpool.kvstore.index.prefix_index import PrefixIndex
from kvpool.kvstore.index.records import (
    MAX_KEY_BYTES,
    BadObjectError,
    CapacityError,
    DuplicateKeyError,
    LocationRow,
    NotAdmittedError,
    ObjectInfo,
    ObjectKind,
    QuotaExceededError,
    Removal,
    StoreIndexError,
    Tier,
    UnknownKeyError,
    UnknownNodeError,
)
from kvpool.kvstore.master.process_heap import process_rss_bytes, release_free_heap
from kvpool.kvstore.master.state import StateStore
from kvpool.kvstore.shards import ShardSet
from kvpool.proto import common_pb2, master_pb2
from kvpool.runtime import cluster_auth

if TYPE_CHECKING:
    from kvpool.kvstore.master.kv_event_recorder import KvEventRecorder

log = logging.getLogger(__name__)

T = TypeVar("T")
_KINDS = frozenset(ObjectKind)
_check_object = PrefixIndex.check_object
_SSD = common_pb2.SSD
_CHECKSUM_TWICE = "checksum_at_commit: the checksum comes with PutCommit, not PutStart"
_STARTED = master_pb2.PutStartReply.STARTED
_EXISTS = master_pb2.PutStartReply.EXISTS
_IN_PROGRESS = master_pb2.PutStartReply.IN_PROGRESS
_NOT_ADMITTED = master_pb2.PutStartReply.NOT_ADMITTED
# One object's PutStart fields, in this order: key, kind, size, checksum, tenant, parent, ttl_ms, tier,
# replace_if_corrupt, route, token ids (None: not kept), retain (a PutStartBatch's columns, zipped)
StartRow = tuple[bytes, int, int, int, str, bytes, int, int, bool, bytes, list[int] | None, bool]
# the event counter of each answer a put start can get
_START_COUNTERS = {
    _STARTED: "puts_started",
    _EXISTS: "puts_exist",
    _IN_PROGRESS: "puts_in_progress",
    _NOT_ADMITTED: "puts_not_admitted",
}

MAX_KEYS_PER_CALL = 100_000
MAX_BLOCKS_PER_MATCH = 1 << 16  # 65,536 blocks x 512 tokens: far beyond any context
MAX_TENANT_CHARS = 256
MAX_PIN_MS = 24 * 3600 * 1000
MAX_SESSION_CHARS = 256  # a client's prompt_cache_key (the gateway checks the same bound)
# An inventory this large is a bulk load: the index is sized for it up front and the freed request memory
# is returned to the OS afterwards (smaller ones grow the index as puts do; their garbage is noise).
BULK_ADOPTION_OBJECTS = 4096
# Sweeps that trim after a bulk load: the request is freed only after its reply went out, which a sweep
# can precede; a trim with nothing to release is cheap.
TRIM_SWEEPS_AFTER_BULK = 3


@dataclass(frozen=True, slots=True)
class MasterConfig:
    """Tunables; the CLI flags map one to one."""

    policy: str = "hybrid"
    depth_weight: float = 0.5  # hybrid: how much a deeper checkpoint outweighs age (eviction.HybridPolicy)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)  # hybrid's admission control
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    heartbeat_ms: int = 1000
    node_timeout_ms: int = 5000
    lease_ms: int = 5000
    max_lease_ms: int = 60_000
    put_deadline_ms: int = 30_000
    node_call_timeout_ms: int = 2000
    sweep_ms: int = 100  # how often sweep() runs; a longer gap is treated as a master stall
    state_path: Path | None = None  # quotas and pins persisted here (JSON), None = not persisted
    max_objects: int = 0  # object cap of the index (0 = none): bounds the master's memory under churn
    # clients' pinned bytes <= this share x what pins earned (0..1) of DRAM and of each tenant's quota
    pin_share: float = 0.5
    pin_budget_step: float = 0.02  # how fast pins earn or lose that share; 0: fixed (pin_budget.py)
    shards: ShardSet = field(default_factory=ShardSet)  # the fleet's master shards (kvstore/shards.py)
    shard: int = 0  # the one this master serves

    def validate(self) -> None:
        self.admission.check()
        if not (0.0 <= self.depth_weight < float("inf")):
            raise ValueError("depth_weight must be finite and >= 0")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        for name in ("heartbeat_ms", "node_timeout_ms", "lease_ms", "max_lease_ms", "put_deadline_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.node_timeout_ms <= self.heartbeat_ms:
            raise ValueError("node_timeout_ms must exceed heartbeat_ms")
        if not 0 < self.sweep_ms * 2 <= self.node_timeout_ms:
            raise ValueError("sweep_ms must be at most half of node_timeout_ms")
        if self.max_objects < 0:
            raise ValueError("max_objects must be >= 0 (0 = no cap)")
        if not 0.0 <= self.pin_share <= 1.0:
            raise ValueError(f"pin_share must be in [0, 1], got {self.pin_share}")
        if not 0.0 <= self.pin_budget_step <= 1.0:
            raise ValueError(f"pin_budget_step must be in [0, 1], got {self.pin_budget_step}")
        if not 0 <= self.shard < self.shards.count:
            raise ValueError(
                f"shard {self.shard} is not one of {self.shards.describe()} (0..{self.shards.count - 1})"
            )


class NodeAction(StrEnum):
    """What a node is told to do with a key (sent by the server's node notifier)."""

    DELETE = "delete"
    DEMOTE = "demote"
    PROMOTE = "promote"


@dataclass(slots=True)
class NodeRecord:
    """A registered node: where to reach it, and when it last said it is alive."""

    endpoint: common_pb2.NodeEndpoint
    last_heartbeat: float


@dataclass(slots=True)
class OpenPut:
    """A put between PutStart and PutCommit/PutAbort: its bytes are on their way to ``node_id``."""

    put_id: str
    key: bytes
    node_id: str
    deadline: float
    checksum_at_commit: bool = False  # the writer declares the checksum in PutCommit (hashed while copying)
    token_ids: list[int] | None = None  # KV events: the block's tokens, if the writer sent them


@dataclass(slots=True)
class PendingActions:
    """Keys a node must act on, per action, in the order they were decided."""

    node: common_pb2.NodeEndpoint
    epoch: int = 0  # HA: the leadership epoch of the master that decided them (nodes fence older ones)
    keys: dict[NodeAction, list[bytes]] = field(default_factory=dict)


class MasterCore:
    """All master state and call semantics. See the module docstring."""

    def __init__(
        self,
        config: MasterConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        state: StateStore | None = None,
        epoch: int = 0,
    ) -> None:
        self.config = config or MasterConfig()
        self.config.validate()
        self._clock = clock
        self.index = PrefixIndex(
            make_policy(self.config.policy, depth_weight=self.config.depth_weight),
            admission=self.config.admission if self.config.policy == "hybrid" else None,
            high_watermark=self.config.high_watermark,
            low_watermark=self.config.low_watermark,
            lease_ms=self.config.lease_ms,
            clock=clock,
            max_objects=self.config.max_objects,
            pin_share=self.config.pin_share,
            pin_budget_step=self.config.pin_budget_step,
        )
        self.instance = secrets.token_hex(4)  # lease/put ids of an earlier master life never match
        self._nodes: dict[str, NodeRecord] = {}
        self._puts: dict[str, OpenPut] = {}
        self._put_of_key: dict[bytes, str] = {}
        self._put_seq = 0
        self._shard_set_text = str(self.config.shards)  # how clients spell this master's shard set
        self._outbox: dict[str, dict[bytes, NodeAction]] = {}
        self._last_sweep = clock()
        self.counters: dict[str, int] = {}
        self._trim_sweeps_left = 0  # after a bulk adoption: sweeps that return freed memory to the OS
        # StateFileError if unreadable: refuse to start. With HA the caller passes the state read from etcd.
        self.state = state if state is not None else StateStore(self.config.state_path)
        self.epoch = epoch  # HA leadership epoch (0 = no HA): on every put placement and node order
        # KV events (--kv-events): told of every block stored, moved or dropped; None = not published
        self.events: KvEventRecorder | None = None
        for tenant, max_bytes in self.state.state.quotas.items():
            self.index.set_quota(tenant, max_bytes)

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the event counter ``name`` (Stats ``counters``); the server counts node calls here."""
        if n:
            self.counters[name] = self.counters.get(name, 0) + n

    def register_node(self, req: master_pb2.RegisterNodeRequest) -> master_pb2.RegisterNodeReply:
        """(Re)join a node and adopt its inventory: how a restarted master rebuilds its index, and how a
        restarted node's surviving (SSD) objects become visible again. Whatever the index believed about
        this node before is replaced by what the node says it holds."""
        ep = req.node
        if not ep.node_id or not ep.host or not 0 < ep.grpc_port < 65536:
            raise BadRequestError("node needs node_id, host and a grpc_port in 1..65535")
        if req.dram_capacity_bytes == 0 and req.ssd_capacity_bytes == 0:
            raise BadRequestError("node must offer DRAM or SSD capacity")
        self._check_shard_set(req.shard_set, f"node {ep.node_id}")
        if ep.node_id in self._nodes:
            self._forget_node(ep.node_id, reason="reregistered")
        self.index.add_node(ep.node_id, req.dram_capacity_bytes, req.ssd_capacity_bytes)
        self._nodes[ep.node_id] = NodeRecord(_copy_endpoint(ep), self._clock())
        inventory = req.inventory
        bulk = len(inventory) >= BULK_ADOPTION_OBJECTS
        if bulk:
            self._prepare_bulk_adoption(len(inventory))
        adopted = 0
        for meta in inventory:
            if self._adopt(ep.node_id, meta):
                adopted += 1
        self.index.evict()  # once everything is linked: leaf-first is only meaningful on a complete forest
        self._absorb_index_events()
        if bulk:  # not now: the request still lives (the caller holds it), trimming would keep its pages
            self._trim_sweeps_left = TRIM_SWEEPS_AFTER_BULK
        self.count("nodes_registered")
        self.count("objects_adopted", adopted)
        log.info("node %s registered: %d objects adopted of %d", ep.node_id, adopted, len(req.inventory))
        return master_pb2.RegisterNodeReply(
            heartbeat_interval_ms=self.config.heartbeat_ms,
            node_timeout_ms=self.config.node_timeout_ms,
            adopted_objects=adopted,
            epoch=self.epoch,
        )

    def _adopt(self, node_id: str, meta: common_pb2.ObjectMeta) -> bool:
        tier = Tier.SSD if meta.tier == common_pb2.SSD else Tier.DRAM
        try:
            self.index.insert(
                meta.key,
                meta.kind if meta.kind in _KINDS else ObjectKind.BLOB,  # a newer node's kind: a blob
                meta.size,
                node_id=node_id,
                tier=tier,
                tenant=meta.tenant,
                parent=meta.parent,
                checksum=meta.checksum,
                ttl_ms=meta.ttl_ms,
                evict=False,
            )
        except DuplicateKeyError:
            # already indexed elsewhere (one replica is tracked): this copy is unreachable bytes on the node
            self.count("adopt_duplicates")
            self._queue(node_id, NodeAction.DELETE, meta.key)
            return False
        except StoreIndexError as exc:
            self.count("adopt_rejected")
            log.warning("node %s: cannot adopt %s: %s", node_id, meta.key[:9].hex(), exc)
            self._queue(node_id, NodeAction.DELETE, meta.key)
            return False
        self._restore_pin(meta.key)
        if self.events is not None:
            self.events.stored(meta.key)
        return True

    def _prepare_bulk_adoption(self, objects: int) -> None:
        """Before adopting a large inventory: size the index for it once (the master process pinned the
        mmap threshold at start, so the request's big blocks go back to the OS when freed)."""
        self.index.reserve(objects)

    def _release_adoption_garbage(self) -> None:
        """Run by the sweep for a few rounds after a bulk adoption, by when its request has been freed: hand
        the pages it occupied back to the OS (:func:`release_free_heap`). Never on a put/get path."""
        if not self._trim_sweeps_left:
            return
        self._trim_sweeps_left -= 1
        if release_free_heap():
            self.count("heap_trims")

    def _restore_pin(self, key: bytes) -> None:
        """Re-apply a pin that outlived an earlier master (or an earlier copy of the object)."""
        remaining = self.state.pin_remaining_ms(key)
        if remaining:
            self.index.pin([key], remaining)
            self.count("pins_restored")

    def _check_shard_set(self, claimed: str, who: str) -> None:
        """A caller that names its shard set ("COUNTxDEPTH") must agree with this master's; empty = unchecked
        (a caller that routes nothing by chain, e.g. a probe). Every routed call names it: parsed (~2 us, a
        sixth of a lookup) only when it is not spelled as this master spells its own."""
        if claimed and claimed != self._shard_set_text:
            self.config.shards.require_same(ShardSet.parse(claimed), f"master shard {self.config.shard}", who)

    def heartbeat(self, req: master_pb2.HeartbeatRequest) -> master_pb2.HeartbeatReply:
        if not req.node_id:
            raise BadRequestError("heartbeat without node_id")
        rec = self._nodes.get(req.node_id)
        if rec is None:
            self.count("heartbeats_unknown")
            return master_pb2.HeartbeatReply(reregister=True, epoch=self.epoch)
        rec.last_heartbeat = self._clock()
        return master_pb2.HeartbeatReply(reregister=False, epoch=self.epoch)

    def _forget_node(self, node_id: str, reason: str) -> int:
        """Drop a node and everything indexed on it (dead, or about to re-adopt its inventory)."""
        self._nodes.pop(node_id, None)
        self._outbox.pop(node_id, None)
        pending: set[bytes] = set()
        for put_id in [p.put_id for p in self._puts.values() if p.node_id == node_id]:
            put = self._puts.pop(put_id)
            if self._put_of_key.get(put.key) == put_id:
                del self._put_of_key[put.key]
                pending.add(put.key)
        try:
            dropped = self.index.remove_node(node_id)
        except UnknownNodeError:
            return 0
        if self.events is not None:
            for gone in dropped:
                if gone.key not in pending:
                    self.events.removed(gone.key, gone.tier)
        self.count(f"objects_dropped_{reason}", len(dropped))
        if len(dropped) >= BULK_ADOPTION_OBJECTS:  # their memory goes back to the OS over the next sweeps
            self._trim_sweeps_left = TRIM_SWEEPS_AFTER_BULK
        return len(dropped)

    def put_start(self, req: master_pb2.PutStartRequest) -> master_pb2.PutStartReply:
        """One object's put, started: a batch of one (:meth:`_start_rows`), so both calls share one path."""
        meta = req.meta
        tokens = list(req.token_ids) if self.events is not None and req.token_ids else None
        row = (
            meta.key, meta.kind, meta.size, meta.checksum, meta.tenant, meta.parent, meta.ttl_ms, meta.tier,
            req.replace_if_corrupt, req.route, tokens, req.retain,
        )  # fmt: skip
        status, put_ids, node_ids, failed = self._start_rows([row], req.checksum_at_commit)
        if failed:
            raise failed[0][1]
        Reply = master_pb2.PutStartReply
        if status[0] == _NOT_ADMITTED:
            return Reply(status=_NOT_ADMITTED)
        if status[0] != _STARTED:
            return Reply(status=status[0], node=self._endpoint(node_ids[0]))
        return Reply(
            status=_STARTED,
            put_id=put_ids[0],
            node=self._endpoint(node_ids[0]),
            deadline_ms=self.config.put_deadline_ms,
            epoch=self.epoch,
            shard=self.config.shard,
        )

    def _start_rows(
        self, rows: Iterable[StartRow], checksum_at_commit: bool
    ) -> tuple[list[int], list[str], list[str], list[tuple[int, StoreError]]]:
        """Start the put of each row (a :data:`StartRow`: a PutStart's fields); the one path of PutStart and
        PutStartBatch. Per row: its status (0 where it failed), put id ("" unless STARTED) and node id (""
        unless STARTED, EXISTS or IN_PROGRESS); and every row that failed with the typed error it failed
        with, by index: one bad row never stops the others. A key that appears twice fails the second time
        (``ObjectExistsError``): the writer learns one of its own objects was dropped instead of taking it
        for another writer's put.

        Why one loop over plain values: per object, the master's own work (decode, check, record, answer)
        cost more than the index's insert when each object was a message and a call of its own; here a
        batch's objects are run straight off its columns, with what stays the same hoisted out."""
        status: list[int] = []
        put_ids: list[str] = []
        node_ids: list[str] = []
        failed: list[tuple[int, StoreError]] = []
        seen: set[bytes] = set()
        owned: set[bytes] = set()  # routes (or keys) this shard was found to own
        index = self.index
        get, insert, put_again, absorb = index.get, index.insert, index.put_again, self._absorb_index_events
        puts, put_of_key = self._puts, self._put_of_key
        shards, shard = self.config.shards, self.config.shard
        sharded = shards.sharded
        deadline = self._clock() + self.config.put_deadline_ms / 1000.0
        prefix = f"{self.instance}-"
        for i, (key, kind, size, checksum, tenant, parent, ttl_ms, tier, replace, route, tokens, retain) in (
            enumerate(rows)
        ):  # fmt: skip
            status.append(0)
            put_ids.append("")
            node_ids.append("")
            try:
                if key in seen:
                    raise ObjectExistsError("key appears twice in one batch")
                seen.add(key)
                if checksum_at_commit and checksum:
                    raise BadRequestError(_CHECKSUM_TWICE)
                if len(tenant) > MAX_TENANT_CHARS:
                    _check_tenant(tenant)
                # a chain's objects by its route (checked once per route), anything else by its key
                if sharded and (route or key) not in owned:
                    shards.require_owner(route or key, shard)
                    owned.add(route or key)
                existing = get(key)
                replacing: str | None = None
                if existing is not None:
                    answer = self._start_existing(existing, key, kind, size, ttl_ms, checksum, replace)
                    if answer == _EXISTS:  # the writer used it: a put refreshes, as in the simulator
                        put_again(key)
                    if answer:
                        status[i] = answer
                        node_ids[i] = existing.node_id
                        continue
                    replacing = existing.node_id
                # the index checks the object first: key, size, TTL, a kind that agrees with the key's tag
                try:
                    node_id = insert(
                        key,
                        kind,
                        size,
                        tier=Tier.SSD if tier == _SSD else Tier.DRAM,
                        tenant=tenant,
                        parent=parent,
                        checksum=checksum,
                        ttl_ms=ttl_ms,
                        pending=True,
                        avoid_node=replacing,
                        admit=not retain,
                    )
                except BadObjectError as exc:
                    raise BadRequestError(str(exc)) from None
                except NotAdmittedError:
                    status[i] = _NOT_ADMITTED
                    continue
                except (CapacityError, QuotaExceededError) as exc:
                    self.count("puts_refused")
                    raise CapacityExceededError(str(exc)) from None
                finally:
                    absorb()
            except StoreError as exc:
                failed.append((i, exc))
                continue
            self._put_seq += 1
            put_id = prefix + str(self._put_seq)
            puts[put_id] = OpenPut(put_id, key, node_id, deadline, checksum_at_commit, tokens)
            put_of_key[key] = put_id
            status[i] = _STARTED
            put_ids[i] = put_id
            node_ids[i] = node_id
        for answer, counter in _START_COUNTERS.items():
            self.count(counter, status.count(answer))
        return status, put_ids, node_ids, failed

    def _start_existing(
        self,
        existing: ObjectInfo,
        key: bytes,
        kind: int,
        size: int,
        ttl_ms: int,
        checksum: int,
        replace_if_corrupt: bool,
    ) -> int:
        """A put of a key the index holds: IN_PROGRESS or EXISTS (nothing to write), or 0 once a copy a
        reader found corrupt was dropped (``replace_if_corrupt``) and the new one is to be placed."""
        try:  # a malformed object is refused, never answered EXISTS (a new key's insert checks the same)
            _check_object(key, kind, size, ttl_ms, checksum)
        except BadObjectError as exc:
            raise BadRequestError(str(exc)) from None
        if not existing.committed:
            return _IN_PROGRESS
        if not replace_if_corrupt:
            return _EXISTS
        # drop it and place the new copy elsewhere if any node can take it, so the delete of the bad copy
        # cannot race with the new bytes on the same node
        self._forget(existing)
        self.count("puts_replacing_corrupt")
        return 0

    def put_commit(self, req: master_pb2.PutCommitRequest) -> master_pb2.PutCommitReply:
        """One put's commit: a batch of one (:meth:`_commit_rows`)."""
        failed = self._commit_rows([req.put_id], [req.checksum])
        if failed:
            raise failed[0][1]
        return master_pb2.PutCommitReply()

    def _commit_rows(self, put_ids: Sequence[str], checksums: Sequence[int]) -> list[tuple[int, StoreError]]:
        """Commit each put (with its checksum: required when it was started with checksum_at_commit, else 0
        or ignored); the one path of PutCommit and PutCommitBatch. Returns the puts that failed, by index,
        with the typed error each failed with; the others are committed."""
        failed: list[tuple[int, StoreError]] = []
        puts, take, commit = self._puts, self._take_put, self.index.commit
        absorb, events = self._absorb_index_events, self.events
        restore_pins = self.state.has_pins()
        for i, (put_id, checksum) in enumerate(zip(put_ids, checksums, strict=True)):
            try:
                if not checksum and put_id in puts and puts[put_id].checksum_at_commit:
                    raise BadRequestError(
                        f"put {put_id!r} was started with checksum_at_commit: commit needs it"
                    )
                put = take(put_id)
                try:
                    commit(put.key, checksum if put.checksum_at_commit else None)
                except UnknownKeyError:  # its TTL ran out before the commit (the node was told to delete it)
                    raise ObjectNotFoundError(f"put {put_id!r} expired before its commit") from None
                if restore_pins:
                    self._restore_pin(put.key)
                if events is not None:
                    events.stored(put.key, put.token_ids)
                absorb()
            except StoreError as exc:
                failed.append((i, exc))
        self.count("puts_committed", len(put_ids) - len(failed))
        return failed

    def put_start_batch(self, req: master_pb2.PutStartBatchRequest) -> master_pb2.PutStartBatchReply:
        """A whole push (one prefill's MLA blocks and checkpoint) in one exchange instead of one per object.

        Column-wise both ways: object i is the request's ``keys[i]`` with the i-th value of every other
        column, started by :meth:`_start_rows` (what :meth:`put_start` runs), and its answer is the i-th
        entry of the reply's columns; the reply lists only the objects that failed, each with its own
        ``ItemError``. A column of the wrong length fails the whole batch (``BadRequestError``) before
        anything is started."""
        self._check_shard_set(req.shard_set, "the writer")
        keys = req.keys
        n = len(keys)
        if n > MAX_KEYS_PER_CALL:
            raise BadRequestError(f"more than {MAX_KEYS_PER_CALL} keys in one PutStartBatch")
        rows = zip(  # StartRow's fields, in its order
            keys,
            _column(req.kinds, n, "kinds", 0),
            _column(req.sizes, n, "sizes", 0),
            _column(req.checksums, n, "checksums", 0),
            _column(req.tenants, n, "tenants", ""),
            _column(req.parents, n, "parents", b""),
            _column(req.ttl_ms, n, "ttl_ms", 0),
            _column(req.tiers, n, "tiers", 0),
            _column(req.replace_if_corrupt, n, "replace_if_corrupt", False),
            _column(req.routes, n, "routes", b""),
            self._token_lists(req.token_ids, req.token_counts, n),
            _column(req.retain, n, "retain", False),
            strict=True,
        )
        status, put_ids, node_ids, failed = self._start_rows(rows, req.checksum_at_commit)
        endpoints, node = self._node_column(node_ids, status, failed)
        self.count("put_batches")
        return master_pb2.PutStartBatchReply(
            status=status,
            put_ids=put_ids,
            nodes=endpoints,
            node=node,
            deadline_ms=self.config.put_deadline_ms,
            epoch=self.epoch,
            shard=self.config.shard,
            errors=[_item_error(exc, i) for i, exc in sorted(failed, key=lambda f: f[0])],
        )

    def _node_column(
        self, node_ids: list[str], status: list[int], failed: list[tuple[int, StoreError]]
    ) -> tuple[list[common_pb2.NodeEndpoint], list[int]]:
        """Each node the rows name, once, and each row's index into them (0 for a row without a node). A
        row whose node is no longer registered fails (``failed``, status 0), as the single call would."""
        first = next((node_id for node_id in node_ids if node_id), "")
        if first and node_ids.count(first) + node_ids.count("") == len(node_ids):  # the common push: one node
            try:
                return [self._endpoint(first)], [0] * len(node_ids)
            except StoreError:
                pass  # answered row by row below
        endpoints: list[common_pb2.NodeEndpoint] = []
        at: dict[str, int] = {}
        node = [0] * len(node_ids)
        for i, node_id in enumerate(node_ids):
            if not node_id:
                continue
            if node_id not in at:
                try:
                    endpoints.append(self._endpoint(node_id))
                except StoreError as exc:
                    status[i] = 0
                    failed.append((i, exc))
                    continue
                at[node_id] = len(endpoints) - 1
            node[i] = at[node_id]
        return endpoints, node

    def _token_lists(self, token_ids: Sequence[int], counts: Sequence[int], n: int) -> list[list[int] | None]:
        """Each object's token ids (None: none sent, or no KV events to keep them for), from the batch's
        concatenated ``token_ids`` and ``token_counts``; checked even when they are not kept."""
        if not counts:
            if token_ids:
                raise BadRequestError(f"PutStartBatch: {len(token_ids)} token_ids without token_counts")
            return [None] * n
        per_object = _column(counts, n, "token_counts", 0)
        if sum(per_object) != len(token_ids):
            raise BadRequestError(
                f"PutStartBatch: token_counts add up to {sum(per_object)}, not the {len(token_ids)} token_ids"
            )
        if self.events is None:
            return [None] * n
        flat = list(token_ids)
        out: list[list[int] | None] = []
        pos = 0
        for count in per_object:
            out.append(flat[pos : pos + count] or None)
            pos += count
        return out

    def put_commit_batch(self, req: master_pb2.PutCommitBatchRequest) -> master_pb2.PutCommitBatchReply:
        """Commit many puts in one exchange (:meth:`_commit_rows`, what :meth:`put_commit` runs); the reply
        lists only the puts that failed, each with its own error."""
        put_ids = req.put_ids
        if req.checksums and len(req.checksums) != len(put_ids):
            raise BadRequestError(f"{len(req.checksums)} checksums for {len(put_ids)} put ids")
        if len(put_ids) > MAX_KEYS_PER_CALL:
            raise BadRequestError(f"more than {MAX_KEYS_PER_CALL} put ids in one PutCommitBatch")
        failed = self._commit_rows(put_ids, req.checksums or [0] * len(put_ids))
        return master_pb2.PutCommitBatchReply(errors=[_item_error(exc, i) for i, exc in failed])

    def put_abort(self, req: master_pb2.PutAbortRequest) -> master_pb2.PutAbortReply:
        self._drop_put(self._take_put(req.put_id))
        self.count("puts_aborted")
        return master_pb2.PutAbortReply()

    def _take_put(self, put_id: str) -> OpenPut:
        if not put_id:
            raise BadRequestError("put_id is empty")
        put = self._puts.pop(put_id, None)
        if put is None or self._put_of_key.get(put.key) != put_id:
            # unknown, finished, or superseded: its pending entry expired and another put took the key
            raise ObjectNotFoundError(
                f"no pending put {put_id!r} (unknown, committed, aborted or past its deadline)"
            )
        del self._put_of_key[put.key]
        return put

    def _drop_put(self, put: OpenPut) -> None:
        """Undo a started put: the pending entry goes (if it is still this put's) and the node is told to
        delete whatever bytes of it landed."""
        info = self.index.get(put.key)
        if info is not None and not info.committed and info.node_id == put.node_id:
            self.index.remove(put.key, reason="aborted")
        self._queue(put.node_id, NodeAction.DELETE, put.key)

    def match_prefix(self, req: master_pb2.MatchPrefixRequest) -> master_pb2.MatchPrefixReply:
        hashes = req.block_hashes
        if len(hashes) > MAX_BLOCKS_PER_MATCH:
            raise BadRequestError(f"more than {MAX_BLOCKS_PER_MATCH} block hashes")
        _check_tenant(req.tenant)
        self._check_shard_set(req.shard_set, "the caller")
        if self.config.shards.sharded:
            self.config.shards.require_owner(
                req.route or self.config.shards.route_of_chain(hashes), self.config.shard
            )
        lease_ms = self._lease_ms(req.lease_ms)
        try:
            m = self.index.match_prefix(
                hashes, require_checkpoint=req.require_checkpoint, touch=req.acquire, resume=req.resume
            )
        except BadObjectError as exc:
            raise BadRequestError(str(exc)) from None
        self.count("match_prefix")
        self.count("match_prefix_resume", int(req.resume))  # decode's reads, which teach the index nothing
        self.count("match_blocks_asked", len(hashes))
        self.count("match_blocks_usable", m.usable_blocks)
        self.count("match_blocks_lost_to_checkpoint", m.blocks_lost_to_checkpoint)
        counts = {
            "usable_blocks": m.usable_blocks,
            "mla_run_blocks": m.mla_run_blocks,
            "checkpoint_blocks": m.checkpoint_blocks,
        }
        if not m.slots:
            return master_pb2.MatchPrefixReply(**counts)
        sizes, sums, tiers, node_ids = self.index.columns(m.slots)
        on_ssd = tiers[: m.usable_blocks].count(_SSD) if _SSD in tiers else 0
        lease_id = ""
        if req.acquire:
            keys = [*m.mla_keys, m.checkpoint_key] if m.checkpoint_key is not None else list(m.mla_keys)
            # pin first: making DRAM room for promotions must not evict what this fetch is about to read
            lease = self.index.acquire(keys, lease_ms)
            if lease is not None:
                lease_id = f"{self.instance}:{lease.lease_id}"
            if _SSD in tiers:
                self._promote_on_hit([r for r in self.index.rows(keys) if r.tier == Tier.SSD])
                sizes, sums, tiers, node_ids = self.index.columns(m.slots)  # promoted: DRAM now
        elif req.counts_only:
            return master_pb2.MatchPrefixReply(**counts, usable_blocks_on_ssd=on_ssd)
        endpoints, node = self._located_nodes(node_ids)
        # one constructor call: the columns are filled in C, not appended field by field
        return master_pb2.MatchPrefixReply(
            **counts,
            usable_blocks_on_ssd=on_ssd,
            lease_id=lease_id,
            nodes=endpoints,
            node=node,
            size=sizes,
            checksum=sums,
            tier=tiers,
        )

    def _located_nodes(self, node_ids: list[str]) -> tuple[list[common_pb2.NodeEndpoint], list[int]]:
        """Each node of a match's objects once, and each object's index into them."""
        first = node_ids[0]
        if node_ids.count(first) == len(node_ids):  # a chain on one node: no per-object lookups
            return [self._endpoint(first)], [0] * len(node_ids)
        at: dict[str, int] = {}
        endpoints: list[common_pb2.NodeEndpoint] = []
        for node_id in node_ids:
            if node_id not in at:
                at[node_id] = len(endpoints)
                endpoints.append(self._endpoint(node_id))
        return endpoints, [at[n] for n in node_ids]

    def lookup(self, req: master_pb2.LookupRequest) -> master_pb2.LookupReply:
        keys = _check_keys(req.keys)
        if req.exists_only:  # a probe: a membership test per key, and no location to build or decode
            if req.acquire:
                raise BadRequestError("exists_only lookups cannot acquire: they return no location to read")
            index = self.index
            reply = master_pb2.LookupReply(missing=[k for k in keys if k not in index])
            self.count("lookups")
            return reply
        lease_ms = self._lease_ms(req.lease_ms)
        infos = self.index.lookup(keys, touch=req.acquire)
        reply = master_pb2.LookupReply()
        found = [i for i in infos if i is not None]
        if req.acquire and found:
            lease = self.index.acquire([i.key for i in found], lease_ms)
            if lease is not None:
                reply.lease_id = f"{self.instance}:{lease.lease_id}"
            self._promote_on_hit([i for i in found if i.tier == Tier.SSD])
            infos = self.index.lookup(keys)
        endpoints: dict[str, common_pb2.NodeEndpoint] = {}
        for key, info in zip(keys, infos, strict=True):
            if info is None:
                reply.missing.append(key)
            else:
                _fill_location(reply.found.add(), info, self._endpoint_cached(info.node_id, endpoints))
        self.count("lookups")
        return reply

    def release(self, req: master_pb2.ReleaseRequest) -> master_pb2.ReleaseReply:
        instance, _, num = req.lease_id.partition(":")
        if not num.isdigit():
            raise BadRequestError(f"malformed lease_id {req.lease_id!r}")
        # an unknown or expired lease is not an error: the deadline already released it
        if instance != self.instance or not self.index.release(int(num)):
            self.count("releases_late")
        return master_pb2.ReleaseReply()

    def _lease_ms(self, asked: int) -> int:
        if asked > self.config.max_lease_ms:
            raise BadRequestError(f"lease_ms {asked} exceeds the maximum {self.config.max_lease_ms}")
        return asked or self.config.lease_ms

    def _promote_on_hit(self, on_ssd: list[ObjectInfo] | list[LocationRow]) -> None:
        """A fetch is coming: bring SSD objects back to DRAM in the index and tell their nodes."""
        for obj in on_ssd:
            if self.index.promote(obj.key):
                if self.events is not None:
                    self.events.moved(obj.key, Tier.SSD)
                self._queue(obj.node_id, NodeAction.PROMOTE, obj.key)
                self.count("promotions")
        self._absorb_index_events()

    def remove(self, req: master_pb2.RemoveRequest) -> master_pb2.RemoveReply:
        removed = 0
        for key in _check_keys(req.keys):
            info = self.index.get(key)
            if info is None:
                continue
            put_id = self._put_of_key.pop(key, None)
            if put_id is not None:
                self._puts.pop(put_id, None)
            self._forget(info)
            removed += 1
        self.count("removed", removed)
        return master_pb2.RemoveReply(removed=removed)

    def pin(self, req: master_pb2.PinRequest) -> master_pb2.PinReply:
        """Pin (or unpin) keys for a session, or end a session. Only operators' pins (no session) are
        persisted: a client's retention is a hint, and a new master starts without it."""
        if len(req.session) > MAX_SESSION_CHARS:
            raise BadRequestError(f"session is {len(req.session)} characters, at most {MAX_SESSION_CHARS}")
        if req.end_session:
            _check_tenant(req.tenant)
            released = self.index.end_session(req.tenant, req.session)
            self.count("sessions_ended")
            return master_pb2.PinReply(pinned=released)
        keys = _check_keys(req.keys)
        if req.ttl_ms > MAX_PIN_MS:
            raise BadRequestError(f"ttl_ms {req.ttl_ms} exceeds the maximum {MAX_PIN_MS}")
        found = [k for k in keys if k in self.index]
        if req.session and req.ttl_ms and len(found) < len(keys):
            return master_pb2.PinReply()  # a client's chain is pinned whole or not at all: a part is no hit
        pinned = self.index.pin(found, req.ttl_ms, req.session)
        if found and req.ttl_ms and not pinned:
            return master_pb2.PinReply(refused=True)  # over the pin budget (the index counts it)
        if not req.session:
            self.state.set_pins(found, req.ttl_ms)
        return master_pb2.PinReply(pinned=pinned)

    def set_quota(self, req: master_pb2.SetQuotaRequest) -> master_pb2.SetQuotaReply:
        _check_tenant(req.tenant)
        self.index.set_quota(req.tenant, req.max_bytes)
        self.state.set_quota(req.tenant, req.max_bytes)
        self._absorb_index_events()
        return master_pb2.SetQuotaReply()

    def stats(self, req: master_pb2.StatsRequest | None = None) -> master_pb2.StatsReply:
        st = self.index.stats()
        return master_pb2.StatsReply(
            objects=st.objects,
            bytes=st.bytes,
            capacity_bytes=st.capacity_bytes,
            evictions=st.evictions,
            evicted_bytes=st.evicted_bytes,
            nodes=st.nodes,
            active_leases=st.active_leases,
            pending_puts=len(self._puts),
            bytes_per_tier=st.bytes_per_tier,
            bytes_per_tenant=st.bytes_per_tenant,
            policy=st.policy,
            counters={
                **self.counters,
                **cluster_auth.rejection_counters(),
                **(self.events.counters() if self.events is not None else {}),
            },
            demotions=st.demotions,
            expired=st.expired,
            admission_rate=None if self.index.admission is None else self.index.admission.rate,
            rss_bytes=process_rss_bytes(),
            index_slots=self.index.allocated_slots,
            max_objects=self.config.max_objects,
            pinned_bytes=st.pinned_bytes,
            pins_refused=st.pins_refused,
            pin_budget_earned=st.pin_budget_earned,
        )

    def sweep(self) -> None:
        """Periodic duties (the server calls this every few hundred ms): drop nodes whose heartbeats
        stopped, abort puts past their deadline, retire leases/pins/TTLs."""
        now = self._clock()
        stalled = now - self._last_sweep - 2 * self.config.sweep_ms / 1000.0  # one period of jitter is fine
        self._last_sweep = now
        if stalled > 0:
            # the master itself was not listening (a long adoption, a big eviction, a GC pause): heartbeats
            # queued behind it are not the nodes' fault, so the silence window restarts after the stall
            for rec in self._nodes.values():
                rec.last_heartbeat += stalled
            self.count("sweep_stalls")
        timeout = self.config.node_timeout_ms / 1000.0
        for node_id in [n for n, r in self._nodes.items() if now - r.last_heartbeat > timeout]:
            lost = self._forget_node(node_id, reason="node_lost")
            self.count("nodes_lost")
            log.warning("node %s silent for %.1fs: dropped with %d objects", node_id, timeout, lost)
        for put in [p for p in self._puts.values() if p.deadline <= now]:
            del self._puts[put.put_id]
            if self._put_of_key.get(put.key) == put.put_id:
                del self._put_of_key[put.key]
                self._drop_put(put)
            self.count("puts_abandoned")
        self.index.expire()
        self._absorb_index_events()
        self._release_adoption_garbage()

    def take_actions(self) -> list[PendingActions]:
        """Everything queued for nodes since the last call, grouped per node and action."""
        if not self._outbox:  # after most calls
            return []
        out: list[PendingActions] = []
        for node_id, queued in self._outbox.items():
            rec = self._nodes.get(node_id)
            if rec is None or not queued:
                continue
            pending = PendingActions(rec.endpoint, epoch=self.epoch)
            for key, action in queued.items():
                pending.keys.setdefault(action, []).append(key)
            out.append(pending)
        self._outbox = {}
        return out

    def node_could_not(self, node_id: str, action: NodeAction, keys: list[bytes]) -> None:
        """A node reported keys it could not act on. A failed demotion leaves the object in the node's
        DRAM while the index counts it on SSD: drop it from the index and order a delete, so both agree.
        A failed promotion is left alone (the node serves it from SSD; the index over-counts DRAM, which
        only makes placement conservative). Missing deletes need nothing."""
        if action != NodeAction.DEMOTE:
            return
        for key in keys:
            info = self.index.get(key)
            if info is not None and info.node_id == node_id and info.tier == Tier.SSD:
                self._forget(info, reason="demote_failed")
                self.count("demotions_failed")

    def _forget(self, info: ObjectInfo, reason: str = "removed") -> None:
        """The one path of every explicit removal (a client's Remove, a corrupt copy being replaced, a failed
        demotion): out of the index, out of the routers' view (KV events, if it was ever stored) and off its
        node."""
        self.index.remove(info.key, reason=reason)
        if self.events is not None and info.committed:
            self.events.removed(info.key, info.tier)
        self._queue(info.node_id, NodeAction.DELETE, info.key)

    def _queue(self, node_id: str, action: NodeAction, key: bytes) -> None:
        if node_id in self._nodes:
            self._outbox.setdefault(node_id, {})[key] = action

    def _absorb_index_events(self) -> None:
        for ev in self.index.drain_events():
            self._on_removal(ev)

    def _on_removal(self, ev: Removal) -> None:
        if ev.reason == "node_lost":
            return
        if self.events is not None and ev.key not in self._put_of_key:  # (a pending put was never stored)
            if ev.demoted:
                self.events.moved(ev.key, ev.tier)
            else:
                self.events.removed(ev.key, ev.tier)
        self._queue(ev.node_id, NodeAction.DEMOTE if ev.demoted else NodeAction.DELETE, ev.key)

    def _endpoint(self, node_id: str) -> common_pb2.NodeEndpoint:
        rec = self._nodes.get(node_id)
        if rec is None:
            raise StoreError(f"node {node_id!r} is not registered")
        return rec.endpoint

    def _endpoint_cached(
        self, node_id: str, cache: dict[str, common_pb2.NodeEndpoint]
    ) -> common_pb2.NodeEndpoint:
        ep = cache.get(node_id)
        if ep is None:
            ep = cache[node_id] = self._endpoint(node_id)
        return ep


def _item_error(exc: StoreError, index: int) -> master_pb2.ItemError:
    """Object ``index`` of a batch failed with ``exc``: what the batch reply says about it."""
    return master_pb2.ItemError(index=index, code=exc.code, message=f"{type(exc).__name__}: {exc}")


def _column(values: Sequence[T], n: int, name: str, default: T) -> Sequence[T]:
    """A batch column as one value per object: no value gives every object ``default``, one value gives
    every object that value; any other length than ``n`` is a malformed batch."""
    m = len(values)
    if m == n:
        return values
    if m == 0:
        return [default] * n
    if m == 1:
        return [values[0]] * n
    raise BadRequestError(f"PutStartBatch: {m} {name} for {n} keys (a column holds 0, 1 or one per key)")


def _copy_endpoint(ep: common_pb2.NodeEndpoint) -> common_pb2.NodeEndpoint:
    out = common_pb2.NodeEndpoint()
    out.CopyFrom(ep)
    return out


def _fill_location(loc: common_pb2.ObjectLocation, info: ObjectInfo, ep: common_pb2.NodeEndpoint) -> None:
    m = loc.meta
    m.key = info.key
    m.kind = int(info.kind)
    m.size = info.size
    m.checksum = info.checksum
    m.tenant = info.tenant
    m.parent = info.parent
    m.ttl_ms = info.ttl_ms
    m.tier = int(info.tier)
    loc.node.CopyFrom(ep)


def _check_key(key: bytes) -> None:
    if not key or len(key) > MAX_KEY_BYTES:
        raise BadRequestError(f"key must be 1..{MAX_KEY_BYTES} bytes, got {len(key)}")


def _check_keys(keys: Iterable[bytes]) -> list[bytes]:
    out = list(keys)
    if len(out) > MAX_KEYS_PER_CALL:
        raise BadRequestError(f"more than {MAX_KEYS_PER_CALL} keys in one call")
    for key in out:
        _check_key(key)
    return out


def _check_tenant(tenant: str) -> None:
    if len(tenant) > MAX_TENANT_CHARS:
        raise BadRequestError(f"tenant name longer than {MAX_TENANT_CHARS} characters")
