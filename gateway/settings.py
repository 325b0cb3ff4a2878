"""Gateway configuration (one dataclass, filled by ``kvpool gateway`` flags or by the launcher)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.gateway.cache_hints import DEFAULT_TIERS
from kvpool.kvstore.shards import DEFAULT_DEPTH


@dataclass
class GatewaySettings:
    prefill: list[str]
    decode: list[str]
    master: str | None = None  # one master, an HA group "a,b", or master shards "g0;g1;..."
    shard_depth: int = DEFAULT_DEPTH  # with master shards: blocks of a chain that choose its shard
    model: str = "tiny"  # "tiny" | "tiny8" | a checkpoint directory (tokenizer + config come from it)
    served_model_name: str | None = None  # the id clients put in "model"; default: the model name
    fingerprint_hex: str | None = None  # model fingerprint (hash root); computed from the model when absent
    block_size: int = 64
    routing: str = "cache"
    ttft_slo_s: float = 0.0  # 0 = no admission control by estimated TTFT
    api_keys: list[str] = field(default_factory=list)
    max_prompt_tokens: int = 8192
    max_output_tokens: int = 1024
    default_max_tokens: int = 16
    max_body_bytes: int = 1 << 20
    max_concurrent: int = 64
    request_timeout_s: float = 60.0
    stats_interval_s: float = 2.0
    answer_memo: int = 4096
    cache_hints: bool = True  # accept prompt_cache_key / prompt_cache_retention / cache_control
    retention_tiers: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_TIERS))  # name -> ttl_ms

    @property
    def model_id(self) -> str:
        return self.served_model_name or self.model
