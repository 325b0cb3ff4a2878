"""Which master to call: one address, or an HA group's list (``"host:a,host:b"``), following the leader.

Every client of the master (store clients, storage nodes, the gateway) holds one of these. With a single
address nothing ever moves. With a list, a call answered ``NotLeaderError`` (a standby: nothing was run)
moves to the leader the standby named, if it is in the list, else to the next address; a master that
cannot be reached moves to the next address too. So a failover costs each client one failed call per dead
or standby master, and nobody needs etcd or a restart to follow a new leader.
"""

from __future__ import annotations

from kvpool.kvstore.errors import BadRequestError


class MasterAddresses:
    """The masters of one cluster and the one currently believed to lead."""

    __slots__ = ("_at", "addresses")

    def __init__(self, spec: str) -> None:
        self.addresses = [a.strip() for a in spec.split(",") if a.strip()]
        if not self.addresses:
            raise BadRequestError(f"no master address in {spec!r}")
        self._at = 0

    @property
    def current(self) -> str:
        return self.addresses[self._at]

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    def follow(self, leader: str | None) -> bool:
        """Move to ``leader`` when it is one of ours, else to the next address. False with one address
        (there is nowhere to go)."""
        if not self.several:
            return False
        at = (
            self.addresses.index(leader) if leader in self.addresses else (self._at + 1) % len(self.addresses)
        )
        if at == self._at:
            at = (self._at + 1) % len(self.addresses)
        self._at = at
        return True
