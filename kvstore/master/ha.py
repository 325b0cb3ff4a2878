"""High availability of the master: an etcd session, the leader election over it, and the HA master that
gates one :class:`~kvpool.kvstore.master.server.MasterServer` by that election (``docs/design/ha.md``).

**The etcd session.** ``aetcd`` talks to one member; a member that is down (or cut off from its quorum) must
not stall the master, so every call runs under ``timeout_s`` and, on failure, is tried once on each other
member before :class:`EtcdUnavailableError` is raised. Writes and lease keep-alives need a quorum, so with
most members down they fail within the deadline too, which is exactly what the leadership loop needs to see.

**The election.**

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

**The HA master.** Every master of a group runs one. The elected one serves; the others are standbys that
answer every call with ``NotLeaderError`` naming the leader (clients, nodes and the gateway hold the group's
address list and move there; ``protocol.master_link``). Why a standby holds no copy of the index: the index
is derived state the storage nodes hold authoritatively (each RegisterNode carries the node's inventory), so
a new leader rebuilds it in one registration round, as a restarted master always has; replicating it would
put an etcd or follower round trip on every put and lookup, the master's hot path, to save that round.

On election the server gets a fresh core with the group's quotas and pins read from etcd and the new epoch
(stamped on every put placement and node order, which nodes fence by); on deposition the core is replaced by
an empty one and unsent node orders are dropped. Quota and pin changes are written to etcd in a transaction
that succeeds only while this master's leader key still exists with its epoch, so a deposed leader's late
write cannot land.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aetcd
import grpc
from kvpool.kvstore.errors import StoreUnavailableError
from kvpool.kvstore.master.core import MasterCore
from kvpool.kvstore.master.server import MasterServer
from kvpool.kvstore.master.state import StateStore
from kvpool.kvstore.shards import ShardSet, ShardSetError

log = logging.getLogger(__name__)
T = TypeVar("T")

SAFE_SHARE = 0.75  # act for at most this share of the TTL after the last refresh was sent
# Calls a leader that lost etcd (read-only) still answers: reads, and the nodes' own registration and
# heartbeats (refusing them would make nodes leave for a standby that cannot be elected either).
READ_ONLY_CALLS = frozenset({"match_prefix", "lookup", "release", "stats", "register_node", "heartbeat"})
STATE_RETRY_S = 0.2


# -- the etcd session ------------------------------------------------------------------------------------
class EtcdUnavailableError(StoreUnavailableError):
    """No etcd member answered within the deadline (down, partitioned, or without a quorum)."""


def parse_members(spec: str) -> list[tuple[str, int]]:
    """``"http://a:2379,b:2381"`` -> [("a", 2379), ("b", 2381)]; ValueError on a malformed entry."""
    members = []
    for raw in spec.split(","):
        entry = raw.strip().removeprefix("http://")
        if not entry:
            continue
        host, sep, port = entry.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"etcd member {raw.strip()!r} is not HOST:PORT")
        members.append((host, int(port)))
    if not members:
        raise ValueError(f"no etcd member in {spec!r}")
    return members


class EtcdSession:
    """``await session.run(lambda client: client.get(key))``: the result, or ``EtcdUnavailableError``."""

    def __init__(self, members: str, timeout_s: float = 1.0) -> None:
        self.members = parse_members(members)
        self.timeout_s = timeout_s
        self._at = 0
        self._client: aetcd.Client | None = None

    @property
    def member(self) -> str:
        host, port = self.members[self._at]
        return f"{host}:{port}"

    async def run(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        last: BaseException | None = None
        for _ in range(len(self.members)):
            try:
                return await asyncio.wait_for(self._on_member(op), self.timeout_s)
            except (TimeoutError, aetcd.exceptions.ClientError, grpc.RpcError, OSError) as exc:
                last = exc
                log.debug("etcd member %s failed: %r", self.member, exc)
                await self._drop()
                self._at = (self._at + 1) % len(self.members)
        raise EtcdUnavailableError(f"no etcd member of {len(self.members)} answered: {last!r}")

    async def _on_member(self, op: Callable[[aetcd.Client], Awaitable[T]]) -> T:
        """Connect if needed and run ``op``, both inside the caller's deadline."""
        return await op(await self._connected())

    async def _connected(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.members[self._at]
            self._client = aetcd.Client(host=host, port=port, timeout=self.timeout_s)
            await self._client.connect()
        return self._client

    async def _drop(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.close(), self.timeout_s)

    async def close(self) -> None:
        await self._drop()


# -- the election ----------------------------------------------------------------------------------------
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
        return _leader_address(responses[0][0][0])
    except (IndexError, TypeError):
        return None


def _leader_address(value: bytes) -> str | None:
    """The address in a leader key's value (None if unreadable)."""
    try:
        return str(json.loads(value)["address"])
    except (KeyError, TypeError, ValueError):
        return None


# -- the HA master ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HaConfig:
    etcd: str  # "host:port[,host:port...]"
    group: str  # masters of one cluster share it
    advertise: str = ""  # host:port of this master's wire, as clients reach it (default: given to start)
    lease_ttl_s: int = 2
    etcd_timeout_s: float = 0.5


class HaMaster:
    """Made before the server starts (so no call is ever served ungated); ``await ha.start(address)`` once
    the server is bound, ``await ha.stop()`` before stopping it."""

    def __init__(self, server: MasterServer, ha: HaConfig) -> None:
        if not ha.group or "/" in ha.group:
            raise ValueError(f"--ha-group {ha.group!r} must be a non-empty name without '/'")
        self.server = server
        self.ha = ha
        self.advertise = ha.advertise
        self.session = EtcdSession(ha.etcd, ha.etcd_timeout_s)
        # master shards: each shard is its own HA group under the fleet's group; the fleet's shard set is
        # one key of the fleet's group, which every master of every shard must agree with
        shards = server.config.shards
        self.group = f"{ha.group}-shard{server.config.shard}" if shards.sharded else ha.group
        self._shard_set_key = f"/kvpool/{ha.group}/shard-set".encode()
        self.leadership = Leadership(
            self.session, self.group, ha.advertise, ha.lease_ttl_s, self._elected, self._deposed
        )
        self._state_key = f"/kvpool/{self.group}/state".encode()
        self._config = dataclasses.replace(server.config, state_path=None)
        self._state_body: str | None = None
        self._state_writer: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._map_task: asyncio.Task[None] | None = None
        server.wire.shard_map = lambda: self.shard_map
        self.shard_map = ""  # master shards: the fleet's shard leaders "a;b;c" as etcd last said (Describe)
        server.replace_core(self._core(StateStore(None), epoch=0))
        server.wire.gate = self
        server.wire.leadership = self.describe
        server.may_sweep = self.leadership.may_write

    async def start(self, bound_address: str) -> None:
        """Check the fleet's shard set in etcd (``ShardSetError`` naming both when it disagrees with this
        master's flags: nothing is started or written), then campaign. With etcd not answering yet, the check
        is retried in the background before the first campaign (a standby meanwhile, as before)."""
        try:
            await self._agree_on_shard_set()
            agreed = True
        except EtcdUnavailableError as exc:
            log.warning("etcd does not answer yet (%s): the shard set is checked before campaigning", exc)
            agreed = False
        self.advertise = self.leadership.address = self.advertise or bound_address
        self._task = asyncio.get_running_loop().create_task(self._lead(agreed))
        if self.server.config.shards.sharded:
            self._map_task = asyncio.get_running_loop().create_task(self._follow_shard_leaders())

    async def _lead(self, agreed: bool) -> None:
        while not agreed:
            await asyncio.sleep(self.leadership.period_s)
            try:
                await self._agree_on_shard_set()
                agreed = True
            except EtcdUnavailableError:
                continue
            except ShardSetError as exc:
                log.error("%s: this master stays a standby and never campaigns", exc)
                return
        await self.leadership.run()

    async def _follow_shard_leaders(self) -> None:
        """Keep ``shard_map``: every shard's leader address from its leader key, refreshed each lease
        period. A client whose shard set is stale asks Describe for it and follows (client side)."""
        count = self.server.config.shards.count
        keys = [leader_key(f"{self.ha.group}-shard{i}") for i in range(count)]
        while True:
            try:
                got = [await self.session.run(lambda c, k=k: c.get(k)) for k in keys]
                addresses = [_leader_address(g.value) if g is not None else None for g in got]
                if all(addresses):
                    self.shard_map = ";".join(a for a in addresses if a)
            except EtcdUnavailableError:
                pass
            await asyncio.sleep(self.leadership.period_s)

    async def _agree_on_shard_set(self) -> None:
        """The first master of a fleet records its shard set (``COUNTxDEPTH``); every later one must match."""
        mine = self.server.config.shards
        key, value = self._shard_set_key, str(mine).encode()

        async def txn(c):
            tx = c.transactions
            return await c.transaction(
                compare=[tx.create(key) == 0], success=[tx.put(key, value)], failure=[tx.get(key)]
            )

        created, responses = await self.session.run(txn)
        if not created:
            recorded = ShardSet.parse(bytes(responses[0][0][0]).decode())
            recorded.require_same(mine, f"etcd's {key.decode()}", "this master's flags")

    async def stop(self) -> None:
        for task in (self._task, self._state_writer, self._map_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.leadership.resign()
        await self.session.close()

    # -- the gate and Describe -------------------------------------------------------------------------------
    def refusal(self, method: str) -> str | None:
        lead = self.leadership
        if lead.may_write() or (method in READ_ONLY_CALLS and lead.may_read()):
            return None
        what = {
            Role.STANDBY: "a standby",
            Role.READ_ONLY: "read-only (etcd unreachable)",
            Role.LEADER: "a leader re-checking its lease",
        }[lead.role]
        other = lead.leader_address if lead.leader_address not in (None, self.advertise) else None
        return f"master {self.advertise} is {what}" + (f"; leader={other}" if other else "")

    def describe(self) -> tuple[int, bool, str]:
        """``(epoch, leader?, leader address)`` for the wire's Describe (epoch 0 while not leading)."""
        lead = self.leadership
        return lead.epoch if lead.may_read() else 0, lead.may_read(), lead.leader_address or ""

    # -- transitions -----------------------------------------------------------------------------------------
    async def _elected(self, epoch: int) -> None:
        got = await self.session.run(lambda c: c.get(self._state_key))
        text = got.value.decode() if got is not None else None
        self.server.replace_core(self._core(StateStore(None, text=text, on_save=self._save_state), epoch))
        log.info("leader with epoch %d: %s", epoch, "state restored from etcd" if text else "no saved state")

    async def _deposed(self) -> None:
        self.server.replace_core(self._core(StateStore(None), epoch=0))
        await self.server.notifier.close()  # orders of the old epoch are not sent (nodes would refuse them)

    def _core(self, state: StateStore, epoch: int) -> MasterCore:
        return MasterCore(self._config, state=state, epoch=epoch)

    # -- quotas and pins in etcd -----------------------------------------------------------------------------
    def _save_state(self, body: str) -> None:
        self._state_body = body
        if self._state_writer is None or self._state_writer.done():
            self._state_writer = asyncio.get_running_loop().create_task(self._write_state())

    async def _write_state(self) -> None:
        epoch = self.leadership.epoch
        key = self.leadership.key  # this shard's group (the fleet's own without shards)
        while self._state_body is not None and self.leadership.epoch == epoch:
            body = self._state_body

            async def txn(c, body: str = body):
                tx = c.transactions
                return await c.transaction(
                    compare=[tx.create(key) == epoch],
                    success=[tx.put(self._state_key, body.encode())],
                    failure=[],
                )

            try:
                written, _ = await self.session.run(txn)
            except EtcdUnavailableError:
                await asyncio.sleep(STATE_RETRY_S)
                continue
            if not written:
                log.warning("state change not saved: epoch %d no longer holds the leader key", epoch)
                return
            if self._state_body is body:
                self._state_body = None
