"""The client's cache hints: what a request asks the store to keep, checked into a ``CacheHints``.

Three fields, the ones clients already send to the big APIs (docs/design/gateway.md, cache hints):

* ``prompt_cache_key`` (OpenAI): a session key. It groups a conversation's (or an agent run's) retained
  chains, and ``DELETE /v1/prompt_cache/{key}`` releases them the moment the client says it is over;
* ``prompt_cache_retention`` (OpenAI: ``in_memory`` | ``24h``): keep the whole prompt, and the answer decode
  writes after it, for that long. ``in_memory`` is this deployment's shortest tier; a tier name (``5m``,
  ``1h``, ``24h``) may be given directly;
* ``cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}`` (Anthropic) on a message or on a text part:
  keep the prompt up to the end of that message or part (a breakpoint; the four deepest of a request are
  honoured: each costs a checkpoint and a pin, and a schema cannot say "four" across messages).

Why refuse instead of clamping: a client that asks for a day and silently gets five minutes is billed for
the wrong tier and plans wrong; a 400 naming the allowed values is what OpenAI and Anthropic answer too.
The store may still refuse a valid hint (its pin budget, within the tenant's quota): that never fails the
request, the usage says ``refused``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvpool.gateway.errors import InvalidRequest
from kvpool.gateway.schemas import CacheControl, ChatMessage, _Sampling
from kvpool.worker.handoff import RetainSpan

MAX_KEY_CHARS = 256  # the master's bound on a session key (kvstore/master/core.py MAX_SESSION_CHARS)
MAX_BREAKPOINTS = 4
IN_MEMORY = "in_memory"
DEFAULT_TTL = "5m"  # Anthropic's default when cache_control names no ttl
DEFAULT_TIERS = {"5m": 300_000, "1h": 3_600_000, "24h": 86_400_000}  # OpenAI's in_memory / 24h, Anthropic's
IN_MEMORY_ALIASES = ("in-memory",)  # the spelling some OpenAI SDK versions send
_DURATION = re.compile(r"^(\d+)([smh])$")
_UNIT_MS = {"s": 1000, "m": 60_000, "h": 3_600_000}


def parse_tiers(spec: str) -> dict[str, int]:
    """``"5m,1h,24h"`` -> {name: ttl_ms}, the retention tiers a deployment offers. ``ValueError`` names a
    bad part."""
    tiers: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        m = _DURATION.match(part)
        if m is None or int(m.group(1)) <= 0:
            raise ValueError(f"bad retention tier {part!r}: use a duration such as 5m, 1h or 24h")
        tiers[part] = int(m.group(1)) * _UNIT_MS[m.group(2)]
    if not tiers:
        raise ValueError("no retention tier given")
    if max(tiers.values()) > 24 * 3_600_000:
        raise ValueError("a retention tier longer than 24h is more than the store pins")
    return tiers


@dataclass(frozen=True)
class CacheHints:
    """A request's checked hints: the session, the spans to retain and the longest tier (for the bill)."""

    session: str = ""
    retain: tuple[RetainSpan, ...] = ()
    tier: str | None = None


class HintRules:
    """What this deployment accepts: whether hints are on, and its retention tiers (name -> ttl_ms)."""

    def __init__(self, enabled: bool, tiers: dict[str, int]) -> None:
        self.enabled = enabled
        self.tiers = dict(sorted(tiers.items(), key=lambda kv: kv[1]))

    def _tier(self, name: object, param: str, allowed: list[str]) -> str:
        if not isinstance(name, str) or name not in allowed:
            raise InvalidRequest(
                f"{param} {name!r} is not offered by this deployment; allowed values: {', '.join(allowed)}",
                param=param,
            )
        return next(iter(self.tiers)) if name == IN_MEMORY else name

    def _disabled(self, param: str) -> InvalidRequest:
        return InvalidRequest(f"{param}: cache hints are disabled on this deployment", param=param)

    def check_key(self, key: str | None) -> str:
        if key is None:
            return ""
        if not self.enabled:
            raise self._disabled("prompt_cache_key")
        if not isinstance(key, str) or not 0 < len(key) <= MAX_KEY_CHARS:
            raise InvalidRequest(
                f"prompt_cache_key must be a string of 1 to {MAX_KEY_CHARS} characters",
                param="prompt_cache_key",
            )
        return key

    def from_body(
        self,
        body: _Sampling,
        messages: list[ChatMessage] | None = None,
        ends: list[list[int]] | None = None,
    ) -> CacheHints:
        """The hints of a request body; for chat, ``messages`` and ``ends`` as ``render_chat`` gives them
        (per message, its text parts' end positions in tokens, then the message's end)."""
        session = self.check_key(body.prompt_cache_key)
        spans: list[RetainSpan] = []
        tiers: list[str] = []
        retention = body.prompt_cache_retention
        if retention is not None:
            if not self.enabled:
                raise self._disabled("prompt_cache_retention")
            retention = IN_MEMORY if retention in IN_MEMORY_ALIASES else retention
            tier = self._tier(retention, "prompt_cache_retention", [IN_MEMORY, *self.tiers])
            spans.append(RetainSpan(0, self.tiers[tier]))
            tiers.append(tier)
        for i, m in enumerate(messages or ()):
            for where, part, control in _controls(m, i):
                if not self.enabled:
                    raise self._disabled(where)
                tier = self._control_tier(control, where)
                assert ends is not None
                spans.append(RetainSpan(ends[i][part], self.tiers[tier]))
                tiers.append(tier)
        marks = sorted((s for s in spans if s.upto_tokens), key=lambda s: s.upto_tokens)
        if len(marks) > MAX_BREAKPOINTS:  # the deepest ones: each is a checkpoint to write and a pin to hold
            spans = [s for s in spans if not s.upto_tokens] + marks[-MAX_BREAKPOINTS:]
        longest = max(tiers, key=self.tiers.__getitem__) if tiers else None
        return CacheHints(session, tuple(spans), longest)

    def _control_tier(self, control: CacheControl, where: str) -> str:
        ttl = DEFAULT_TTL if control.ttl is None else control.ttl
        return self._tier(ttl, f"{where}.ttl", list(self.tiers))


def _controls(m: ChatMessage, i: int) -> list[tuple[str, int, CacheControl]]:
    """``cache_control`` objects on message ``i`` (part -1: the message's end) and on its text parts
    (part j), with where each was found; ``null`` is no control."""
    out: list[tuple[str, int, CacheControl]] = []
    if m.cache_control is not None:
        out.append((f"messages[{i}].cache_control", -1, m.cache_control))
    if isinstance(m.content, list):
        for j, part in enumerate(m.content):
            if part.cache_control is not None:
                out.append((f"messages[{i}].content[{j}].cache_control", j, part.cache_control))
    return out
