"""Master leadership through etcd: campaign on a lease, keep it alive, know when it is lost.

The mechanism (``docs/design/ha.md``):

* The group's leader key ``/kvpool/<group>/leader`` exists only under the leader's lease. A master becomes
  leader by creating it in one transaction (``create_revision == 0`` -> put with its lease). Its **epoch**
  is the etcd revision of that put: every later leader's is larger, so nodes can fence by comparing numbers.
* The leader refreshes the lease every ``ttl/4`` and re-reads the key. It may act (write, order nodes) only
  while ``now < valid_until``, where ``valid_until`` = when the last successful refresh was *sent* +
  ``SAFE_SHARE`` of the TTL. A leader that was paused (SIGSTOP, a GC stall) wakes past that moment and does
  nothing until it has asked etcd again; etcd itself expires the lease a full TTL after the last refresh it
  received, so the paused leader always stops before a successor can start.
* The lease gone, or the key owned by another, means **deposed**: the master drops everything it knew and
  campaigns again as a standby.
* etcd unreachable past ``valid_until`` means **read-only**: nobody can be elected without etcd, so the
  leader keeps answering reads (a stale read is at worst a miss: objects are checked by checksum) but
  refuses writes and leadership changes until etcd answers again, and logs it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import logging
import time
from collections.abc import Awaitable, Callable

from kvpool.kvstore.master.etcd_session import EtcdSession, EtcdUnavailableError

log = logging.getLogger(__name__)

SAFE_SHARE = 0.75  # act for at most this share of the TTL after the last refresh was sent


class Role(enum.Enum):
    STANDBY = "standby"
    LEADER = "leader"
    READ_ONLY = "read_only"  # was leader; etcd cannot be reached, so nobody can take over (or confirm us)


def leader_key(group: str) -> bytes:
    return f"/kvpool/{group}/leader".encode()


class Leadership:
    """One master's side of the election. ``await run()`` forever; ask :meth:`may_write`/:meth:`may_read`
    before acting. ``on_elected(epoch)`` runs (awaited) before the role turns LEADER; ``on_deposed()`` runs
    when it is lost, before campaigning again."""

    def __init__(
        self,
        session: EtcdSession,
        group: str,
        address: str,
        ttl_s: int,
        on_elected: Callable[[int], Awaitable[None]],
        on_deposed: Callable[[], Awaitable[None]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 2:
            raise ValueError("the leader lease TTL must be at least 2 s (etcd's minimum)")
        self.session = session
        self.key = leader_key(group)
        self.address = address
        self.ttl_s = ttl_s
        self._on_elected = on_elected
        self._on_deposed = on_deposed
        self._clock = clock
        self.role = Role.STANDBY
        self.epoch = 0
        self.leader_address: str | None = None  # the current leader as last read from etcd
        self._lease_id = 0
        self._valid_until = 0.0

    @property
    def period_s(self) -> float:
        return self.ttl_s / 4

    def may_write(self) -> bool:
        return self.role is Role.LEADER and self._clock() < self._valid_until

    def may_read(self) -> bool:
        return self.may_write() or self.role is Role.READ_ONLY

    async def run(self) -> None:
        while True:
            try:
                await (self._campaign() if self.role is Role.STANDBY else self._keep())
            except EtcdUnavailableError as exc:
                self._etcd_lost(exc)
            await asyncio.sleep(self.period_s)

    async def resign(self) -> None:
        """Give the key up at once (clean shutdown), so a standby need not wait out the lease."""
        if self.role is not Role.STANDBY and self._lease_id:
            lease, self._lease_id = self._lease_id, 0
            self.role = Role.STANDBY
            try:
                await self.session.run(lambda c: c.revoke_lease(lease))
            except EtcdUnavailableError:
                log.warning("could not revoke the leader lease; a standby takes over when it expires")

    # -- states -----------------------------------------------------------------------------------------
    async def _campaign(self) -> None:
        sent = self._clock()
        lease = await self.session.run(lambda c: c.lease(self.ttl_s))
        value = json.dumps({"address": self.address}).encode()

        async def txn(c):
            tx = c.transactions
            return await c.transaction(
                compare=[tx.create(self.key) == 0],
                success=[tx.put(self.key, value, lease.id)],
                failure=[tx.get(self.key)],
            )

        won, responses = await self.session.run(txn)
        if not won:
            self.leader_address = _address_in(responses)
            with contextlib.suppress(EtcdUnavailableError):  # else it expires by itself
                await self.session.run(lambda c: c.revoke_lease(lease.id))
            return
        epoch = int(responses[0].response_put.header.revision)
        self._lease_id = lease.id
        self._valid_until = sent + SAFE_SHARE * self.ttl_s
        self.epoch = epoch
        self.leader_address = self.address
        await self._on_elected(epoch)
        self.role = Role.LEADER
        log.info("elected leader of %s with epoch %d (lease %x)", self.key.decode(), epoch, lease.id)

    async def _keep(self) -> None:
        sent = self._clock()
        reply = await self.session.run(lambda c: c.refresh_lease(self._lease_id))
        got = await self.session.run(lambda c: c.get(self.key))
        ours = got is not None and int(got.create_revision) == self.epoch
        if reply is None or reply.TTL <= 0 or not ours:
            await self._deposed("the lease expired" if ours else "another master holds the key")
            return
        if self.role is Role.READ_ONLY:
            log.warning("etcd answers again: leader with epoch %d resumes writes", self.epoch)
        self.role = Role.LEADER
        self._valid_until = sent + SAFE_SHARE * min(self.ttl_s, int(reply.TTL))

    async def _deposed(self, why: str) -> None:
        log.warning("deposed (%s): epoch %d ends; dropping all state and standing by", why, self.epoch)
        self.role = Role.STANDBY
        self._lease_id = 0
        self.leader_address = None
        await self._on_deposed()

    def _etcd_lost(self, exc: EtcdUnavailableError) -> None:
        if self.role is Role.LEADER and self._clock() >= self._valid_until:
            self.role = Role.READ_ONLY
            log.error(
                "etcd unreachable past the lease (%s): serving reads only, no writes and no leadership "
                "change until it answers",
                exc,
            )
        elif self.role is Role.STANDBY:
            log.debug("etcd unreachable: cannot campaign (%s)", exc)


def _address_in(responses: list) -> str | None:
    """The leader address in a failed campaign's ``get`` of the leader key (None if unreadable)."""
    try:
        value = responses[0][0][0]
        return str(json.loads(value)["address"])
    except (IndexError, KeyError, TypeError, ValueError):
        return None
