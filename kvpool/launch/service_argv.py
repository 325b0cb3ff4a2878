"""The command lines of kvpool's services, built in one place for the launcher (``kvpool.launch.cluster``),
which ``kvpool up``, ``kvpool verify``, the tests and the benchmarks all use.

Each returns the ``python -m`` module and its flags. Store services use the store-only entry points
(``kvpool.kvstore.cli master|node``): no torch import, so they start in a fraction of the
time the full ``kvpool`` CLI needs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def master_argv(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int = -1,
    policy: str | None = None,
    heartbeat_ms: int | None = None,
    node_timeout_ms: int | None = None,
    extra: Sequence[str] = (),
) -> list[str]:
    """``kvpool store master``; a setting left at None keeps the master's own default."""
    tuned = {"--policy": policy, "--heartbeat-ms": heartbeat_ms, "--node-timeout-ms": node_timeout_ms}
    return [
        "kvpool.kvstore.cli",
        "master",
        "--host",
        host,
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        *(item for flag, value in tuned.items() if value is not None for item in (flag, str(value))),
        "--log-level",
        "WARNING",
        *extra,
    ]


def node_argv(master: str | None, capacity: str, transport: str, extra: Sequence[str] = ()) -> list[str]:
    """``kvpool store node`` registered with ``master``, or standalone (``--no-master``) when it is None."""
    return [
        "kvpool.kvstore.cli",
        "node",
        *(["--master", master] if master else ["--no-master"]),
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
        "kvpool",
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


def gateway_argv(
    config: dict[str, Any], master: str, workers: Sequence[tuple[str, str]], fingerprint: str | None
) -> list[str]:
    """The gateway's flags from a ``kvpool up`` config: its ``[gateway]`` limits, and every worker as
    ``(role, address)``."""
    g, cl = config["gateway"], config["cluster"]
    argv = [
        "kvpool.gateway.cli",
        "--master",
        master,
        "--model",
        cl["model"],
        "--block-size",
        str(cl["block_size"]),
        "--host",
        g.get("host", "127.0.0.1"),
        "--port",
        str(g.get("port", 8000)),
        "--routing",
        g.get("routing", "cache"),
        "--ttft-slo-s",
        str(g.get("ttft_slo_s", 0.0)),
        "--max-prompt-tokens",
        str(g.get("max_prompt_tokens", 8192)),
        "--max-output-tokens",
        str(g.get("max_output_tokens", 1024)),
        "--max-body-bytes",
        str(g.get("max_body_bytes", 1 << 20)),
        "--max-concurrent",
        str(g.get("max_concurrent", 64)),
        "--request-timeout",
        str(g.get("request_timeout_s", 60.0)),
        "--retention-tiers",
        str(g.get("retention_tiers", "5m,1h,24h")),
        "--cache-hints" if g.get("cache_hints", True) else "--no-cache-hints",
    ]
    if g.get("served_model_name"):
        argv += ["--served-model-name", g["served_model_name"]]
    if fingerprint:
        argv += ["--fingerprint", fingerprint]
    for role, address in workers:
        argv += [f"--{role}", address]
    for key in g.get("api_keys", []):
        argv += ["--api-key", key]
    return argv
