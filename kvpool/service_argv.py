"""The command lines of kvpool's services, built in one place for both launchers: ``kvpool up``
(``kvpool.up.Cluster``) and the local cluster tests and benches start (``kvpool.cluster.LocalCluster``).

Each returns the ``python -m`` module and its flags. Store services use the store-only entry points
(``kvpool.kvstore.cli`` / ``kvpool.kvstore.master.cli``): no torch import, so they start in a fraction of the
time the full ``kvpool`` CLI needs.
"""

from __future__ import annotations

from collections.abc import Sequence


def master_argv(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int = -1,
    policy: str = "hybrid",
    heartbeat_ms: int = 500,
    node_timeout_ms: int = 3000,
) -> list[str]:
    return [
        "kvpool.kvstore.master.cli",
        "--host",
        host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--policy",
        policy,
        "--heartbeat-ms",
        str(heartbeat_ms),
        "--node-timeout-ms",
        str(node_timeout_ms),
        "--log-level",
        "WARNING",
    ]


def node_argv(master: str, capacity: str, transport: str, extra: Sequence[str] = ()) -> list[str]:
    return [
        "kvpool.kvstore.cli",
        "node",
        "--master",
        master,
        "--capacity",
        capacity,
        "--transport",
        transport,
        *extra,
    ]


def worker_argv(
    role: str,
    master: str,
    *,
    model: str,
    block_size: int,
    threads: int,
    transport: str,
    extra: Sequence[str] = (),
) -> list[str]:
    """``kvpool prefill`` or ``kvpool decode`` on the shared store."""
    return [
        "kvpool.cli",
        role,
        "--master",
        master,
        "--model",
        model,
        "--block-size",
        str(block_size),
        "--threads",
        str(threads),
        "--transport",
        transport,
        *extra,
    ]
