"""The master process's pieces, assembled: the wire listener (every master call), the node notifier and the
sweep loop.

A background task runs :meth:`MasterCore.sweep` (dead nodes, abandoned puts, lease/pin/TTL expiry) every
``sweep_interval_s``; with HA only while this master may act (``may_sweep``). The one listener is the master
wire (``wire_server``): its address is what everyone passes as ``--master``, and its ``Describe`` call is what
health probes ask.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from kvpool.kvstore.master.config import MasterConfig
from kvpool.kvstore.master.core import MasterCore, NodeAction
from kvpool.kvstore.master.node_notifier import NodeNotifier
from kvpool.kvstore.master.wire_server import MasterWireServer

log = logging.getLogger(__name__)


class MasterServer:
    """A running master: ``port = await server.start()`` ... ``await server.stop()``."""

    def __init__(self, config: MasterConfig | None = None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.config = config or MasterConfig()
        self.host = host
        self.requested_port = port
        timeout_s = self.config.node_call_timeout_ms / 1000.0
        self.notifier = NodeNotifier(timeout_s, lambda name, n: self.core.count(name, n), self._on_missing)
        self.wire = MasterWireServer(MasterCore(self.config), self.notifier)
        # HA (``ha.HaMaster``): whether sweeps may act now
        self.may_sweep: Callable[[], bool] = lambda: True
        self.sweep_interval_s = self.config.sweep_ms / 1000.0
        self.port = 0
        self._sweeper: asyncio.Task[None] | None = None

    @property
    def core(self) -> MasterCore:
        """The core serving now (with HA, a new one per election)."""
        return self.wire.core

    def replace_core(self, core: MasterCore) -> None:
        """HA: serve from ``core`` from now on; the old one's state (and unsent node orders) is dropped."""
        self.core.take_actions()
        self.wire.core = core

    async def start(self) -> int:
        """Listen; returns the bound port (``port`` 0 picks a free one). Raises OSError."""
        self.port = await self.wire.start(self.host, self.requested_port)
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep_loop())
        log.info("master serving on %s:%d (policy %s)", self.host, self.port, self.config.policy)
        return self.port

    async def stop(self, grace_s: float = 1.0) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        await self.wire.close()
        await self.notifier.idle(timeout_s=grace_s)
        await self.notifier.close()

    def _on_missing(self, node_id: str, action: NodeAction, keys: list[bytes]) -> None:
        self.core.node_could_not(node_id, action, keys)
        self.wire.flush()

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.sweep_interval_s)
            if not self.may_sweep():  # an HA standby, or a leader not sure it still leads: act on nothing
                continue
            try:
                self.core.sweep()
                self.wire.flush()
            except Exception:  # keep sweeping: one bad pass must not stop dead-node detection
                log.exception("master sweep failed")
                self.core.count("sweep_errors")
