"""LMCache's L2 tier on kvpool, run for real: ``lmcache server`` (multiprocess mode) with
``KvpoolL2Adapter`` loaded by LMCache's own plugin loader, and vLLM engines with vLLM's
``LMCacheMPConnector``. A prompt is computed once (LMCache stores its chunks in its L1 and in kvpool); a
fresh LMCache server and a fresh engine (nothing in L1: only kvpool holds the chunks) answer the same prompt
having skipped at least 90 % of its full chunks, with the same greedy tokens as an engine without any
cache. Bad adapter params stop the server at start with one error naming the field, through LMCache's
loader."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from kvpool.kvstore.client.sync_client import StoreClient

from tests.harness.kv_events import free_port
from tests.vllm_connector.conftest import LMCACHE_PROMPTS as PROMPTS
from tests.vllm_connector.conftest import running_store
from tests.vllm_connector.engines import Engine

CHUNK = 256  # LMCache's chunk (--chunk-size): only whole chunks are stored
START_DEADLINE_S = 120.0
PLUGIN = {
    "type": "plugin",
    "module_path": "kvpool.integrations.lmcache.l2_adapter",
    "class_name": "KvpoolL2Adapter",
}
QUIET = {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "LMCACHE_DISABLE_BANNER": "1"}


class LMCacheServer:
    """``lmcache server`` as a child, its L2 our adapter over the test's kvpool master."""

    def __init__(self, log: Path, master: str) -> None:
        self.port, self.http_port = free_port(), free_port()
        self.log, self.master = log, master
        self.proc: subprocess.Popen | None = None
        self._deadline = 0.0

    def launch(self) -> LMCacheServer:
        """Start the server; ``wait_healthy`` waits for it (so several can boot at once)."""
        adapter = {**PLUGIN, "adapter_params": {"master": self.master, "deadline_s": 5}}
        lmcache = Path(sys.executable).with_name("lmcache")
        argv = [str(lmcache), "server", "--host", "127.0.0.1", "--port", str(self.port),
                "--http-host", "127.0.0.1", "--http-port", str(self.http_port), "--chunk-size", str(CHUNK),
                "--supported-transfer-mode", "engine_driven", "--l1-size-gb", "0.25",
                "--eviction-policy", "LRU", "--disable-metrics",  # its OTel exporter is not installed
                "--l2-adapter", json.dumps(adapter)]  # fmt: skip
        with open(self.log, "a") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **QUIET}
            )
        self._deadline = time.monotonic() + START_DEADLINE_S
        return self

    def wait_healthy(self) -> None:
        assert self.proc is not None
        while time.monotonic() < self._deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"lmcache server exited ({self.proc.returncode}); log: {self.log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthcheck", timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"lmcache server not healthy within {START_DEADLINE_S} s; log: {self.log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def own_store(vllm_dir: Path):
    """A master and a node of this module's own (the session's store is stopped by a dead-store test)."""
    with running_store(vllm_dir / "lmcache-store", "tcp,shm") as pair:
        yield pair


def test_a_fresh_lmcache_server_and_engine_load_the_prompt_from_kvpool(
    own_store, model_dir: Path, vllm_dir: Path, baseline: dict[str, list[list[int]]], closing: list[Engine]
) -> None:
    """Engine 1 on LMCache server A computes the prompts; engine 2 on server B, both fresh processes (B's
    L1 has never held anything, as after a restart of both), finds their chunks in kvpool. The four boot at
    once; engine 2 runs only once A's adapter has stored every whole chunk."""
    master, _ = own_store
    servers = [LMCacheServer(vllm_dir / f"lmcache-server-{n}.log", master.address).launch() for n in "ab"]
    try:
        for server in servers:
            server.wait_healthy()
        first, second = (
            Engine(
                {"model": str(model_dir), "connector": {"lmcache": server.port}},
                vllm_dir / f"engine-lmc-{n}.log",
            )
            for n, server in zip("12", servers, strict=True)
        )
        closing.extend((first, second))
        out = first.run(PROMPTS)["outputs"]
        assert [o["tokens"] for o in out] == baseline["lmcache"]
        chunks = sum(len(p) // CHUNK for p in PROMPTS)
        stored = await_adapter(servers[0], lambda c: c.get("chunks_stored", 0) >= chunks)  # stores run behind
        assert stored["chunks_stored"] == chunks and not stored.get("failures"), stored
        first.request_exit()
        out = second.run(PROMPTS)["outputs"]
        assert [o["tokens"] for o in out] == baseline["lmcache"], "loaded KV must give the same tokens"
        for prompt, o in zip(PROMPTS, out, strict=True):
            full = len(prompt) // CHUNK * CHUNK
            assert o["cached"] >= 0.9 * full, (len(prompt), o["cached"])
        loaded = await_adapter(servers[1], lambda c: c.get("chunks_loaded", 0) > 0)
        assert loaded["chunks_loaded"] >= 0.9 * chunks and not loaded.get("failures"), loaded
        with StoreClient(master.address) as probe:  # every lock LMCache took was given back
            _result(lambda: probe.stats().active_leases == 0 or None)
        second.request_exit()
    finally:
        for server in servers:
            server.stop()


def await_adapter(server: LMCacheServer, done: Callable[[dict], bool], deadline_s: float = 30.0) -> dict:
    """Our adapter's entry of LMCache's status page (``report_status``), polled until ``done`` holds."""
    end = time.monotonic() + deadline_s
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}/status", timeout=5) as reply:
            ours = _find_ours(json.load(reply))
        if ours is not None and done(ours):
            return ours
        if time.monotonic() > end:
            raise AssertionError(f"adapter status never got there: {ours}")
        time.sleep(0.2)


def _find_ours(status: object) -> dict | None:
    if isinstance(status, dict):
        if status.get("backend") == "kvpool":
            return status
        status = list(status.values())
    if isinstance(status, list):
        for item in status:
            found = _find_ours(item)
            if found is not None:
                return found
    return None


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"master": "127.0.0.1:1", "transport": "rdma"}, "transport"),
        ({}, "master"),
        ({"master": "nowhere"}, "master"),
        ({"master": "127.0.0.1:1", "connect_timeout_s": 1}, "master"),
        ({"master": "127.0.0.1:1", "salt": 7}, "salt"),
        ({"master": "127.0.0.1:1", "workers": 0}, "workers"),
    ],
)
def test_bad_adapter_params_name_the_field_through_lmcaches_loader(params: object, field: str) -> None:
    from kvpool.integrations.lmcache.l2_adapter import LMCacheConfigError
    from lmcache.v1.distributed.l2_adapters import create_l2_adapter
    from lmcache.v1.distributed.l2_adapters.config import (
        add_l2_adapters_args,
        parse_args_to_l2_adapters_config,
    )

    args = add_l2_adapters_args(argparse.ArgumentParser()).parse_args(
        ["--l2-adapter", json.dumps({**PLUGIN, "adapter_params": params})]
    )
    (config,) = parse_args_to_l2_adapters_config(args).adapters
    with pytest.raises(LMCacheConfigError) as caught:
        create_l2_adapter(config)
    assert caught.value.field == field
    assert f"field {field!r}" in str(caught.value)


def test_two_locks_of_one_chunk_keep_it_pinned_until_both_are_unlocked(own_store) -> None:
    """LMCache locks a chunk once per request that looked it up and unlocks it once per request: the
    adapter's lease pins it until the last unlock, a load between them reads it, an unlock of nothing held
    is harmless; every task's result arrives."""
    from types import SimpleNamespace

    from kvpool.integrations.lmcache.l2_adapter import KvpoolL2Adapter

    master, _ = own_store
    adapter = KvpoolL2Adapter({"master": master.address})
    leases = adapter.store.stats  # the master's Stats: its active leases
    try:
        key = SimpleNamespace(chunk_hash=bytes(range(32)), model_name="m", kv_rank=1, object_group_id=0,
                              cache_salt="")  # fmt: skip
        data = bytes(range(256)) * 64
        store_task = adapter.submit_store_task(
            [key], [SimpleNamespace(byte_array=memoryview(bytearray(data)))]
        )
        stored = _result(lambda: adapter.pop_completed_store_tasks().get(store_task))
        assert int(stored) == len(data), "stored whole"
        for _ in range(2):
            lookup_task = adapter.submit_lookup_and_lock_task([key], {})
            found = _result(lambda t=lookup_task: adapter.query_lookup_and_lock_result(t))
            assert found.test(0)
        _result(lambda: leases().active_leases == 2 or None)
        adapter.submit_unlock([key])
        _result(lambda: leases().active_leases == 1 or None)  # the other lock still pins it
        out = bytearray(len(data))
        load_task = adapter.submit_load_task([key], [SimpleNamespace(byte_array=memoryview(out))])
        loaded = _result(lambda: adapter.query_load_result(load_task))
        assert loaded.test(0) and bytes(out) == data
        adapter.submit_unlock([key])
        _result(lambda: leases().active_leases == 0 or None)  # the last unlock released it
        adapter.submit_unlock([key])  # nothing held any more
        assert not any(k.endswith("errors") for k in adapter.counters()), adapter.counters()
    finally:
        adapter.close()


def test_a_close_against_a_frozen_store_takes_one_deadline_and_ends_every_task(own_store) -> None:
    """A store that stops answering (its node frozen) with store tasks queued behind the one running: the
    close waits for that one (its call's deadline, 1 s) and ends the queued ones at once, as failures,
    instead of running each to its own deadline (5 s here before); every task's result arrives."""
    from types import SimpleNamespace

    from kvpool.integrations.lmcache.l2_adapter import KvpoolL2Adapter

    master, node = own_store
    adapter = KvpoolL2Adapter({"master": master.address, "deadline_s": 1, "workers": 1})
    data = SimpleNamespace(byte_array=memoryview(bytearray(4096)))
    fields = {"model_name": "m", "kv_rank": 1, "object_group_id": 0, "cache_salt": ""}
    keys = [SimpleNamespace(chunk_hash=bytes([i]) * 32, **fields) for i in range(8)]
    os.kill(node.pid, signal.SIGSTOP)
    try:
        tasks = [adapter.submit_store_task([k], [data]) for k in keys]
        started = time.monotonic()
        adapter.close()
        took = time.monotonic() - started
    finally:
        os.kill(node.pid, signal.SIGCONT)
    results = adapter.pop_completed_store_tasks()
    assert sorted(results) == tasks and not any(r.is_successful() for r in results.values()), results
    assert took < 3.0, f"close took {took:.1f} s: it ran the queued tasks to their deadlines"


def _result(poll: Callable[[], object], deadline_s: float = 10.0) -> object:
    """``poll()`` until it returns something other than None."""
    end = time.monotonic() + deadline_s
    while (got := poll()) is None:
        if time.monotonic() > end:
            raise AssertionError("no result within the deadline")
        time.sleep(0.02)
    return got
