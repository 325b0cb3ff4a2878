"""HA master: one :class:`~kvpool.kvstore.master.server.MasterServer` under an etcd leadership.

Every master of a group runs this. The elected one serves; the others are standbys that answer every call
with ``NotLeaderError`` naming the leader (clients, nodes and the gateway hold the group's address list and
move there; ``protocol.master_link``). Why a standby holds no copy of the index: the index is derived
state the storage nodes hold authoritatively (each RegisterNode carries the node's inventory), so a new
leader rebuilds it in one registration round, as a restarted master always has; replicating it would put an
etcd or follower round trip on every put and lookup, the master's hot path, to save that round.

On election the server gets a fresh core with the group's quotas and pins read from etcd and the new epoch
(stamped on every put placement and node order, which nodes fence by); on deposition the core is replaced by
an empty one and unsent node orders are dropped. Quota and pin changes are written to etcd in a transaction
that succeeds only while this master's leader key still exists with its epoch, so a deposed leader's late
write cannot land.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

from kvpool.kvstore.master.core import MasterCore
from kvpool.kvstore.master.election import Leadership, Role, leader_key
from kvpool.kvstore.master.etcd_session import EtcdSession, EtcdUnavailableError
from kvpool.kvstore.master.server import MasterServer
from kvpool.kvstore.master.state import StateStore

log = logging.getLogger(__name__)

# Calls a leader that lost etcd (read-only) still answers: reads, and the nodes' own registration and
# heartbeats (refusing them would make nodes leave for a standby that cannot be elected either).
READ_ONLY_CALLS = frozenset({"match_prefix", "lookup", "release", "stats", "register_node", "heartbeat"})
STATE_RETRY_S = 0.2


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
        self.leadership = Leadership(
            self.session, ha.group, ha.advertise, ha.lease_ttl_s, self._elected, self._deposed
        )
        self._state_key = f"/kvpool/{ha.group}/state".encode()
        self._config = dataclasses.replace(server.config, state_path=None)
        self._state_body: str | None = None
        self._state_writer: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        server.replace_core(self._core(StateStore(None), epoch=0))
        server.wire.gate = self
        server.wire.leadership = self.describe
        server.may_sweep = self.leadership.may_write

    async def start(self, bound_address: str) -> None:
        self.advertise = self.leadership.address = self.advertise or bound_address
        self._task = asyncio.get_running_loop().create_task(self.leadership.run())

    async def stop(self) -> None:
        for task in (self._task, self._state_writer):
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
        key = leader_key(self.ha.group)
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
