"""``TransportSelector``: which data-plane transport a store client uses for which storage node.

``auto`` decides per peer, an explicit choice never falls back. ``auto``: shm when the node is on this host
(same ``host_id``) and exports its pool; else ucx when the node runs a ucx listener, ucxx imports here *and*
this machine has an RDMA device; else tcp. Without RDMA, UCX moves bytes over TCP sockets itself: it only
re-implements our tcp path, with its own failure modes (stalls in 8 ms steps under load,
docs/measurements/store_data_plane.md), so ``auto`` prefers our tcp and logs it once. An explicit
``--transport ucx`` still uses ucx. The decision is made once per node and cached. An explicit ``tcp`` /
``shm`` / ``ucx`` that cannot reach a node raises ``TransportUnavailableError`` — a silent fallback would hide
a misconfiguration behind a slower path (Mooncake issues #553, #1259).
"""

from __future__ import annotations

import logging
from pathlib import Path

from kvpool.kvstore.errors import TransportUnavailableError
from kvpool.kvstore.protocol.shm_segment import host_id
from kvpool.kvstore.transport.base import DEFAULT_DEADLINES, Deadlines, Transport
from kvpool.kvstore.transport.shm import ShmTransport
from kvpool.kvstore.transport.tcp import TcpTransport

TRANSPORT_CHOICES = ("auto", "tcp", "shm", "ucx")
RDMA_SYSFS = Path("/sys/class/infiniband")
log = logging.getLogger(__name__)


def has_rdma_device(sysfs: Path = RDMA_SYSFS) -> bool:
    """Whether a verbs-capable device (InfiniBand / RoCE) is visible: UCX then moves bytes by RDMA."""
    try:
        return any(sysfs.iterdir())
    except OSError:
        return False


class TransportSelector:
    """Owns one instance of each backend in use and maps nodes to them."""

    def __init__(
        self, choice: str = "auto", deadlines: Deadlines = DEFAULT_DEADLINES, local_host_id: str | None = None
    ) -> None:
        if choice not in TRANSPORT_CHOICES:
            raise ValueError(f"transport must be one of {TRANSPORT_CHOICES}, got {choice!r}")
        self.choice = choice
        self.deadlines = deadlines
        self.local_host_id = local_host_id or host_id()
        self.backends: dict[str, Transport] = {}
        self._decided: dict[str, str] = {}
        self.rdma = has_rdma_device()
        self._told_no_rdma = False

    def _backend(self, name: str) -> Transport:
        backend = self.backends.get(name)
        if backend is None:
            if name == "tcp":
                backend = TcpTransport(self.deadlines)
            elif name == "shm":
                control = self._backend("tcp")  # shm control frames share the tcp connection pool
                assert isinstance(control, TcpTransport)
                backend = ShmTransport(self.local_host_id, self.deadlines, control)
            else:
                from kvpool.kvstore.transport.ucx import UcxTransport, load_ucxx

                load_ucxx()  # raises TransportUnavailableError when ucxx cannot work here
                backend = UcxTransport(self.deadlines)
            self.backends[name] = backend
        return backend

    def _usable(self, name: str, node) -> str | None:  # type: ignore[no-untyped-def]
        """None when ``name`` can reach ``node``, else why not."""
        if name == "tcp":
            return None if node.tcp_port else "node has no tcp data plane"
        if name == "shm":
            if not node.shm_name:
                return "node does not export a shm pool"
            return None if node.host_id == self.local_host_id else "node is on another host"
        if not node.ucx_port:
            return "node runs no ucx listener"
        try:
            self._backend("ucx")
        except TransportUnavailableError as exc:
            return str(exc)
        return None

    @staticmethod
    def _node_key(node) -> str:  # type: ignore[no-untyped-def]
        return f"{node.node_id}|{node.host}|{node.tcp_port}|{node.shm_name}|{node.ucx_port}"

    def for_node(self, node) -> Transport:  # type: ignore[no-untyped-def]
        """The transport for ``node`` (a ``NodeEndpoint``)."""
        key = self._node_key(node)
        name = self._decided.get(key)
        if name is None:
            if self.choice == "auto":
                order = ("shm", "ucx", "tcp") if self.rdma else ("shm", "tcp", "ucx")
                name = next((n for n in order if self._usable(n, node) is None), None)
                if name == "tcp" and not self.rdma and not self._told_no_rdma and node.ucx_port:
                    self._told_no_rdma = True
                    log.info(
                        "transport auto: no RDMA device here: tcp rather than ucx (ucx would run over TCP)"
                    )
                if name is None:
                    raise TransportUnavailableError(f"no transport reaches node {node.node_id}")
            else:
                why = self._usable(self.choice, node)
                if why is not None:
                    raise TransportUnavailableError(f"{self.choice}: {why} ({node.node_id})")
                name = self.choice
            self._decided[key] = name
        return self._backend(name)

    def metrics(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, backend in self.backends.items():
            out[f"bytes_in.{name}"] = backend.bytes_in
            out[f"bytes_out.{name}"] = backend.bytes_out
            if isinstance(backend, ShmTransport):  # same-host reads with no round trip (read hints)
                out["shm.fast_hits"] = backend.fast_hits
        return out

    async def close(self) -> None:
        for backend in self.backends.values():
            await backend.close()
        self.backends.clear()
        self._decided.clear()
