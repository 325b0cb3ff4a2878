"""Worker side of the connector's loads: a request's objects go from the store straight into vLLM's blocks.

``start`` builds every object's destination views (``PagedKV.target``) on the engine's thread and hands the
plan's located objects to ``StoreClient.read_in_place_soon``, which shows each object where it lies (the
node's shared-memory pool on the same host, the receive buffer over tcp/ucx); the visit checks the object's
header and payload digest, then copies it into every layer with one call (``ObjectTarget.write``): a bad
object writes nothing. No intermediate ``bytes``, no second lookup at the master
(the scheduler's ``match_prefix`` located every object). ``finish`` turns the per-object results into the
block ids vLLM must recompute: the first object that is missing, late, stale or bad fails itself and every
later object of the plan (a bad object is a miss, never wrong KV).

Asynchronous loads (``LoadPlan.asynchronous``) run on the store client's loop while the engine steps other
requests; ``done`` lists those that finished, and only then are their blocks reported or released;
``wait_any`` lets a step with nothing else to do wait for one with the GIL released.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait

import xxhash
from kvpool.integrations.vllm.chunks import GroupLayout
from kvpool.integrations.vllm.codec import BadObjectError, Part, open_object
from kvpool.integrations.vllm.metrics import ConnectorStats
from kvpool.integrations.vllm.paged import ObjectTarget, PagedKV
from kvpool.integrations.vllm.plan import LoadPlan, blocks_of
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.errors import StoreError
from kvpool.proto import common_pb2

log = logging.getLogger("kvpool.vllm")


class Loader:
    """One worker's loads: its store client, its registered KV tensors, the fingerprint, loads in flight."""

    def __init__(
        self,
        store: StoreClient,
        paged: PagedKV,
        fp: bytes,
        groups: Sequence[GroupLayout],
        stats: ConnectorStats,
    ) -> None:
        self.store, self.paged, self.fp, self.groups, self.stats = store, paged, fp, list(groups), stats
        self.in_flight: dict[str, tuple[LoadPlan, Future[list[Exception | None]], float]] = {}
        self._bytes: dict[str, int] = {}  # per load in flight: the bytes it reads

    def _visit(
        self, targets: Sequence[tuple[int, list[Part], ObjectTarget]], i: int, view: memoryview
    ) -> None:
        """Check object i's header and payload digest, then copy it into its blocks: a bad object writes
        nothing. The payload is hashed in one call just before the copy, which then reads it from cache."""
        kind, parts, target = targets[i]
        payload, want = open_object(view, self.fp, kind, parts)
        if xxhash.xxh3_64_intdigest(payload) != want:
            raise BadObjectError("payload checksum mismatch")
        target.write(payload)

    def _targets(self, load: LoadPlan) -> list[tuple[int, list[Part], ObjectTarget]]:
        """Per transfer: its kind, the parts its header must name, and its destination views, made here on
        the engine's thread so that the reading thread only checks and copies."""
        out = []
        for tr in load.transfers:
            layers = [self.groups[g].layer_names for g in tr.groups]
            out.append(
                (tr.kind, self.paged.parts(layers, tr.blocks), self.paged.target(layers, tr.blocks, tr.skips))
            )
        return out

    def start(self, load: LoadPlan) -> None:
        """Start reading the plan's objects into their blocks (``finish``/``done`` collect the outcome)."""
        locations: list[common_pb2.ObjectLocation] = []
        if not load.transfers or not all(tr.location for tr in load.transfers):
            future: Future[list[Exception | None]] = Future()
            why = StoreError("not located by the scheduler's lookup")
            future.set_result([None if tr.location else why for tr in load.transfers])
        else:
            locations = [common_pb2.ObjectLocation.FromString(tr.location) for tr in load.transfers]
            try:
                targets = self._targets(load)
                future = self.store.read_in_place_soon(locations, lambda i, v: self._visit(targets, i, v))
            except StoreError as exc:
                future = Future()
                future.set_result([exc] * len(locations))
        self.in_flight[load.req_id] = (load, future, time.perf_counter())
        self._bytes[load.req_id] = sum(loc.meta.size for loc in locations)

    def finish(self, req_id: str) -> set[int]:
        """Wait for the request's load; the block ids left for vLLM to recompute."""
        load, future, t0 = self.in_flight.pop(req_id)
        nbytes = self._bytes.pop(req_id, 0)
        try:
            results = future.result()
        except StoreError as exc:  # the whole call passed its deadline or the client closed
            results = [exc] * len(load.transfers)
        for i, err in enumerate(results):
            if err is None:
                continue
            if not isinstance(err, StoreError | BadObjectError):
                log.error("request %s: loading object %d failed unexpectedly: %r", req_id, i + 1, err)
            failed = blocks_of(load, i)
            self.stats.add("load_errors", len(load.transfers) - i)
            self.stats.add("loaded_objects", i)
            log.warning(
                "request %s: object %d of %d not loaded (%s); vLLM recomputes %d blocks",
                req_id,
                i + 1,
                len(load.transfers),
                err,
                len(failed),
            )
            return failed
        self.stats.add("loaded_objects", len(load.transfers))
        self.stats.add("loaded_bytes", nbytes)
        if load.unloadable:
            log.warning("request %s: hit not mapped to objects; vLLM recomputes it", req_id)
            return set(load.unloadable)
        seconds = time.perf_counter() - t0
        log.info(
            "request %s: %d objects, %d B loaded in %.2f ms (%.2f GB/s)",
            req_id,
            len(results),
            nbytes,
            1e3 * seconds,
            nbytes / max(seconds, 1e-9) / 1e9,
        )
        return set()

    def wait_any(self, timeout_s: float) -> None:
        """Block (GIL released) until a load in flight finishes or ``timeout_s`` passes."""
        futures = [future for _, future, _ in self.in_flight.values()]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def done(self) -> list[str]:
        """Requests whose asynchronous load has finished (successfully or not)."""
        return [rid for rid, (_, future, _) in self.in_flight.items() if future.done()]

    def close(self) -> None:
        """Wait for loads in flight (each is bounded by the store client's deadline)."""
        for rid in list(self.in_flight):
            self.finish(rid)
