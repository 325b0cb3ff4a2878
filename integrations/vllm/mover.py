"""Worker side of the connector: moves whole objects between kvpool and vLLM's paged blocks.

``load`` fetches a request's objects in one ``batch_get``, checks each with the codec and writes its blocks;
the first object that is missing, late or bad ends the load, and the block ids it and every later object
would have written are returned for vLLM to recompute (a bad object is a miss, never wrong KV). ``save``
gathers a step's new objects and puts them in one ``batch_put``; a failed save is counted and logged, a
future miss, never an error of the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvpool.integrations.vllm.chunks import GroupLayout
from kvpool.integrations.vllm.codec import BadObjectError, decode, encode
from kvpool.integrations.vllm.metrics import ConnectorStats
from kvpool.integrations.vllm.paged import PagedKV
from kvpool.integrations.vllm.plan import LoadPlan, Transfer, blocks_of
from kvpool.kvstore.client.async_client import PutItem
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.errors import ObjectNotAdmittedError, StoreError

log = logging.getLogger("kvpool.vllm")


class BlockMover:
    """One worker's loads and saves: its store client, its registered KV tensors, the fingerprint."""

    def __init__(
        self,
        store: StoreClient,
        paged: PagedKV,
        fp: bytes,
        groups: Sequence[GroupLayout],
        stats: ConnectorStats,
    ) -> None:
        self.store, self.paged, self.fp, self.groups, self.stats = store, paged, fp, list(groups), stats

    def _layers(self, tr: Transfer) -> list[tuple[str, ...]]:
        return [self.groups[g].layer_names for g in tr.groups]

    def load(self, load: LoadPlan) -> set[int]:
        """Write the plan's objects into their blocks; the block ids left for vLLM to recompute."""
        keys = [tr.key for tr in load.transfers]
        t0 = time.perf_counter()
        try:
            got: list[bytes | StoreError] = self.store.batch_get(keys, route=load.route or None)
        except StoreError as exc:
            got = [exc] * len(keys)
        for i, (tr, data) in enumerate(zip(load.transfers, got, strict=True)):
            layers = self._layers(tr)
            try:
                if isinstance(data, StoreError):
                    raise data
                payload = decode(data, self.fp, tr.kind, self.paged.parts(layers, tr.blocks))
            except (StoreError, BadObjectError) as exc:
                failed = blocks_of(load, i)
                self.stats.add("load_errors", len(load.transfers) - i)
                log.warning(
                    "request %s: object %d of %d not loaded (%s); vLLM recomputes %d blocks",
                    load.req_id,
                    i + 1,
                    len(load.transfers),
                    exc,
                    len(failed),
                )
                return failed
            self.paged.scatter(payload, layers, tr.blocks, tr.skips)
            self.stats.add("loaded_objects")
            self.stats.add("loaded_bytes", len(data))
        log.debug(
            "request %s: %d objects in %.1f ms", load.req_id, len(keys), 1e3 * (time.perf_counter() - t0)
        )
        return set()

    def save(self, transfers: Sequence[Transfer]) -> None:
        """Put the step's new objects (one batch); failures are counted, never raised."""
        items = []
        for tr in transfers:
            layers = self._layers(tr)
            parts = self.paged.parts(layers, tr.blocks)
            data = encode(self.fp, tr.kind, parts, self.paged.gather(layers, tr.blocks))
            items.append(PutItem(tr.key, data, kind=tr.kind, parent=tr.parent, route=tr.route))
        try:
            results = self.store.batch_put(items)
        except StoreError as exc:
            results = [exc] * len(items)
        for item, err in zip(items, results, strict=True):
            if err is None:
                self.stats.add("saved_objects")
                self.stats.add("saved_bytes", len(item.data))
            elif isinstance(err, ObjectNotAdmittedError):
                self.stats.add("not_admitted")
            else:
                self.stats.add("save_errors")
                log.warning("kvpool save of %s failed: %s", item.key[:9].hex(), err)
