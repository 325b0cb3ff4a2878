"""Fixtures shared by the vLLM connector tests: one tiny random Llama, one real kvpool store, and the
baseline answers of an engine without any connector (every test compares against them)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.harness.store_procs import start_master, start_node
from tests.vllm_connector.engines import Engine, close_all, prompts_of
from tests.vllm_connector.make_model import make_tiny_llama
from tests.vllm_connector.pd_example import start as start_pd_example

# several 64-token chunks each, and not multiples of 64 (the last chunk is the engine's to compute)
PROMPTS = prompts_of([300, 450, 200], seed=1)
PD_PROMPTS = prompts_of([260, 390], seed=2)  # the producer/consumer pair's own prompts
LMCACHE_PROMPTS = prompts_of([700, 1100], seed=3)  # 2 + 4 of LMCache's 256-token chunks, and a partial one


@pytest.fixture(scope="session")
def vllm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@pytest.fixture(scope="session")
def model_dir(vllm_dir: Path) -> Path:
    return make_tiny_llama(vllm_dir / "tiny-llama")


@contextlib.contextmanager
def running_store(log_dir: Path, transports: str) -> Iterator[tuple]:
    """A master and a 256 MiB node, their logs in ``log_dir``, stopped on the way out."""
    log_dir.mkdir(exist_ok=True)
    master = start_master(log_dir)
    node = start_node(log_dir, master.address, "256MiB", transports, prefault=False)
    try:
        yield master, node
    finally:
        for p in (node, master):
            if p.alive():
                p.stop()


@pytest.fixture(scope="session")
def store(vllm_dir: Path):
    with running_store(vllm_dir, "tcp,shm,ucx") as pair:
        yield pair


@pytest.fixture(scope="session")
def closing():
    """Engines told to exit by the module that used them, awaited at the end of the session: their
    shutdowns (seconds of teardown each) overlap the tests that follow."""
    engines: list[Engine] = []
    yield engines
    close_all(*engines)


@pytest.fixture(scope="session")
def pd_example(model_dir: Path, vllm_dir: Path):
    """The disaggregated example's producer and consumer runs, started in the background (a Future of
    ``pd_example.run_example``'s record): the engine tests request it first, so its engine boots overlap
    theirs; test_prefill_decode_example.py awaits it."""
    pool, future = start_pd_example(model_dir, vllm_dir / "pd", PD_PROMPTS)
    yield future
    pool.shutdown(wait=True)  # its store is stopped by the run itself, whatever happened


@pytest.fixture(scope="session")
def baseline(model_dir: Path, vllm_dir: Path, closing: list[Engine]) -> dict[str, list[list[int]]]:
    """Greedy tokens of an engine with no connector at all, for PROMPTS, PD_PROMPTS and LMCACHE_PROMPTS. With
    no connector there is nothing to pass between processes, so it runs as one process (no engine-core and
    worker children: a third of the boot) and answers token for token as the default layout does."""
    single = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}  # with executor "uni": engine core and worker in-process
    e = Engine({"model": str(model_dir), "executor": "uni"}, vllm_dir / "engine-baseline.log", env=single)
    try:
        return {
            "prompts": [o["tokens"] for o in e.run(PROMPTS)["outputs"]],
            "pd": [o["tokens"] for o in e.run(PD_PROMPTS)["outputs"]],
            "lmcache": [o["tokens"] for o in e.run(LMCACHE_PROMPTS)["outputs"]],
        }
    finally:
        e.request_exit()
        closing.append(e)
