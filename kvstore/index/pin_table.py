"""The pin table: who holds a soft pin on which indexed object, until when, and the bytes pinned.

A pin (an operator's system prompt, a client's retention hint) keeps an object from eviction while any
holder holds it. Holders are sessions of the object's tenant (``""`` = the operator, no session), each with
its own deadline; an object stays pinned while any holder's deadline is ahead. A session also lists the
objects it pins, so ``end_session`` releases them at once when the client says the conversation is over.

Why a concept of its own: the index (``prefix_index``) decides *whether* a pin is granted (the pin budget,
quotas) and keeps the ``PINNED`` flag bit its eviction reads; this table only keeps the holders, their
deadlines (a heap whose stale entries are skipped, not searched for) and the bytes per tenant that the
budget is checked against. Slots are the index's; the table never reads its columns (sizes and tenants are
passed in). Pure: no clock, the caller passes ``now`` and deadlines.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator


class PinTable:
    """Holders per pinned slot, each session's slots, pinned bytes per tenant and in all."""

    def __init__(self) -> None:
        self.holders: dict[int, dict[str, float]] = {}  # slot -> {session: deadline} ("" = no session)
        self.sessions: dict[tuple[int, str], set[int]] = {}  # (tenant id, session) -> slots it pins
        self.bytes_by_tenant: dict[int, int] = {}  # tenant id -> bytes of its pinned objects
        self.total_bytes = 0
        # (deadline, slot, session), a heap; stale ones skipped. Empty: nothing can be due (the index reads
        # it before each put to skip its retire pass)
        self.deadlines: list[tuple[float, int, str]] = []

    def __contains__(self, slot: int) -> bool:
        return slot in self.holders

    def __len__(self) -> int:
        return len(self.holders)

    def hold(self, slot: int, tenant: int, size: int, session: str, until: float) -> bool:
        """``session`` pins ``slot`` (of ``tenant``, ``size`` bytes) until ``until`` (a later deadline of
        the same holder wins); True when the slot was not pinned before (the caller sets its pinned bit)."""
        holders = self.holders.get(slot)
        new = holders is None
        if holders is None:
            holders = self.holders[slot] = {}
            self.bytes_by_tenant[tenant] = self.bytes_by_tenant.get(tenant, 0) + size
            self.total_bytes += size
        if until > holders.get(session, 0.0):
            holders[session] = until
            heapq.heappush(self.deadlines, (until, slot, session))
        if session:
            self.sessions.setdefault((tenant, session), set()).add(slot)
        return new

    def release(self, slot: int, tenant: int, size: int, session: str | None = None) -> bool:
        """Drop ``session``'s pin on ``slot`` (every holder's when None); True when no holder is left, so
        the slot is unpinned and its bytes have left the table (the caller clears its pinned bit)."""
        holders = self.holders.get(slot)
        if holders is None:
            return False
        for s in list(holders) if session is None else [session]:
            if holders.pop(s, None) is not None and s:
                members = self.sessions.get((tenant, s))
                if members is not None:
                    members.discard(slot)
                    if not members:
                        del self.sessions[(tenant, s)]
        if holders:
            return False
        del self.holders[slot]
        self.bytes_by_tenant[tenant] -= size
        self.total_bytes -= size
        return True

    def due(self, now: float) -> Iterator[tuple[int, str]]:
        """The (slot, session) pins whose deadline is at or before ``now`` and still current (not renewed,
        released or of a reused slot since); the caller releases each as it is yielded."""
        heap = self.deadlines
        while heap and heap[0][0] <= now:
            until, slot, session = heapq.heappop(heap)
            if self.holders.get(slot, {}).get(session) == until:
                yield slot, session

    def session_slots(self, tenant: int, session: str) -> list[int]:
        """The slots ``session`` of ``tenant`` pins now."""
        return list(self.sessions.get((tenant, session), ()))

    def problems(self, pinned_by_tenant: dict[int, int]) -> list[str]:
        """What disagrees with a recount (``pinned_by_tenant``: bytes of pinned live slots per tenant)."""
        out = []
        counted = {t: b for t, b in self.bytes_by_tenant.items() if b}
        if counted != pinned_by_tenant or self.total_bytes != sum(pinned_by_tenant.values()):
            out.append("pinned bytes drifted")
        if any(
            s not in self.holders or not sess or sess not in self.holders[s]
            for (_, sess), members in self.sessions.items()
            for s in members
        ):
            out.append("a session lists a slot it does not pin")
        return out
