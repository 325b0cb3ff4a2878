"""KvEventsConfig: the master's ``--kv-events*`` flags, one field each (docs/design/kv_events.md).

Apart from the publisher so the CLI can parse and check them without importing ZMQ (which only a master
that publishes needs).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.kvstore.protocol.kv_events_wire import HashFormat


class KvEventsConfigError(ValueError):
    """A KV-events setting is unusable (the CLI turns it into exit status 2)."""


@dataclass(frozen=True, slots=True)
class KvEventsConfig:
    """The ``--kv-events*`` flags, one field each."""

    endpoint: str  # PUB address to bind, e.g. tcp://*:5557 (port 0: any free port, see the readiness line)
    replay_endpoint: str | None = None  # ROUTER address to bind for replay and snapshots
    topic_prefix: str = "kvpool"
    block_size: int = 64  # tokens per block, as the workers hash them (the events' block_size)
    hash_format: HashFormat = HashFormat.BYTES
    keep_tokens: bool = False  # keep published blocks' tokens for snapshots (4 B per token per block)
    shared_medium: bool = False  # every object EXTERNAL (one shared pool) instead of CPU / STORAGE per tier
    buffer_batches: int = 10_000  # batches kept for replay
    queue_batches: int = 10_000  # batches waiting for the thread before new ones are dropped
    hwm: int = 100_000  # PUB high-water mark (messages queued per subscriber)
    # an idle stream sends an empty batch this often (0 = never): consumers learn of a restart, or of a
    # gap at the stream's end, within this time even when nothing changes in the index
    heartbeat_ms: int = 1000

    def validate(self) -> None:
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise KvEventsConfigError(
                f"--kv-events needs a ZMQ address (tcp://HOST:PORT), got {self.endpoint!r}"
            )
        if self.replay_endpoint is not None and not self.replay_endpoint.startswith(("tcp://", "ipc://")):
            raise KvEventsConfigError(
                f"--kv-events-replay needs tcp://HOST:PORT, got {self.replay_endpoint!r}"
            )
        if self.block_size <= 0:
            raise KvEventsConfigError("--kv-events-block-size must be > 0")
        if self.heartbeat_ms < 0:
            raise KvEventsConfigError("--kv-events-heartbeat-ms must be >= 0 (0 = off)")
        for name in ("buffer_batches", "queue_batches", "hwm"):
            if getattr(self, name) <= 0:
                raise KvEventsConfigError(f"kv events {name} must be > 0")
