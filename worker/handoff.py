"""What prefill hands to decode (and what a client sends to both): plain dataclasses, wire-independent.

Why the prompt travels in the handoff: the decode node re-derives the block hashes from it (a handoff
cannot point decode at another prompt's blocks), verifies the request tail's tokens against it, and can
recompute the prompt locally if the tail or a block is lost — so correctness never depends on the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.worker.sampling import SamplingParams


@dataclass(frozen=True)
class RetainSpan:
    """A client's retention hint (docs/design/gateway.md, cache hints): keep the prompt's prefix
    ``[0, upto_tokens)`` (0 = the whole prompt, and what decode writes back after it) for ``ttl_ms``."""

    upto_tokens: int
    ttl_ms: int


@dataclass
class PrefillRequest:
    request_id: str
    prompt_ids: list[int]
    tenant: str = ""  # cache salt: part of the hash root, so tenants never share blocks
    sampling: SamplingParams = field(default_factory=SamplingParams)
    use_cache: bool = True  # False: read nothing, write no checkpoint; blocks only short-lived for decode
    session: str = ""  # the client's prompt_cache_key: groups a conversation's pins, released together
    retain: tuple[RetainSpan, ...] = ()  # the client's retention hints, pinned after the push

    @property
    def retain_whole_ms(self) -> int:
        """The TTL of a whole-prompt retention (0 = none): decode pins what it writes back for it."""
        return max((s.ttl_ms for s in self.retain if not s.upto_tokens), default=0)


@dataclass
class Handoff:
    request_id: str
    prompt_ids: list[int]
    tenant: str
    first_token: int
    sampling: SamplingParams
    block_hashes: list[bytes]  # h_i of every full prompt block (decode checks them against prompt_ids)
    tail_key: bytes  # request-scoped object: partial block latents + KDA state at the prompt end
    tail_stored: bool  # False: decode must recompute (the push failed or the cache is off)
    cached_tokens: int = 0  # prompt tokens prefill reused from the store (usage.cached_tokens)
    use_cache: bool = True  # False: decode writes nothing back either (the request opted out of the cache)
    session: str = ""  # with retain_ms: decode pins what it writes back under the client's session
    retain_ms: int = 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)
