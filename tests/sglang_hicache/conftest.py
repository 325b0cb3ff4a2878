"""The SGLang HiCache backend's contract tests: SGLang's own storage code (installed without its CUDA
dependencies in the vLLM test venv, ``make test``) against kvpool's real store processes.

Collected only with ``KVPOOL_VLLM_TESTS=1`` (the suite that runs in ``.venv-vllm``, where SGLang is): the
main suite's venv has no SGLang.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

collect_ignore_glob = [] if os.environ.get("KVPOOL_VLLM_TESTS") == "1" else ["test_*.py"]

if not collect_ignore_glob:
    # Importing SGLang sets third-party cache directories in os.environ (TORCHINDUCTOR_CACHE_DIR, ...). The
    # vLLM suite runs in the same pytest process and its engines are children that inherit os.environ:
    # import SGLang once here, at collection, and put the environment back as it was.
    _environ = dict(os.environ)
    import sglang  # noqa: F401

    os.environ.clear()
    os.environ.update(_environ)

MODULE = "kvpool.integrations.sglang.hicache"


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sglang-store")


@pytest.fixture(scope="session")
def store(store_dir: Path) -> Iterator[Any]:
    """One kvpool master and one storage node (real processes, the launcher's command lines)."""
    from tests.harness.store_procs import start_master, start_node

    master = start_master(store_dir)
    node = start_node(store_dir, master.address, "256MiB", "tcp,shm", prefault=False)
    yield master
    for p in (node, master):
        if p.alive():
            p.stop()


@pytest.fixture
def file_dir() -> Iterator[Path]:
    """HiCacheFile's directory, on tmpfs where the machine has one (as its benchmarks use it)."""
    root = "/dev/shm" if os.path.isdir("/dev/shm") else None
    path = Path(tempfile.mkdtemp(prefix="hicache-file-", dir=root))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def storage_config(master: str, file_dir: Path, model: str, **kw: Any) -> Any:
    """One ``HiCacheStorageConfig`` both backends are built from: SGLang's dynamic-backend fields, kvpool's
    fields and HiCacheFile's directory side by side in ``extra_config``, as one engine's JSON would hold
    them."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    extra = {
        "backend_name": "kvpool",
        "module_path": MODULE,
        "class_name": "KvpoolHiCacheStorage",
        "interface_v1": 1,
        "master": master,
        "salt": kw.pop("salt", "tenant-a"),
        "deadline_s": kw.pop("deadline_s", 5),
        "file_storage_path": str(file_dir),
    }
    extra.update(kw.pop("extra", {}))
    fields = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": True,
        "enable_storage_metrics": False,
        "is_page_first_layout": True,
        "model_name": model,
    }
    fields.update(kw)
    return HiCacheStorageConfig(**fields, extra_config=extra)


@pytest.fixture
def backends(store: Any, file_dir: Path, request: pytest.FixtureRequest) -> Iterator[Callable[..., tuple]]:
    """``make(pool, **config) -> (kvpool, file)``: both backends built by SGLang's ``StorageBackendFactory``
    from the same ``HiCacheStorageConfig`` and registered with the same host pool(s), as SGLang's cache
    controller does (``create_backend``, ``register_mem_pool_host``, ``register_mem_host_pool_v2``)."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    made: list[Any] = []
    model = f"test/{request.node.name}"

    def make(pool: Any, side_pools: dict | None = None, **kw: Any) -> tuple:
        kw.setdefault("model", model)
        cfg = storage_config(store.address, file_dir, kw.pop("model"), **kw)
        pair = []
        for name in ("dynamic", "file"):
            b = StorageBackendFactory.create_backend(name, cfg, pool)
            b.register_mem_pool_host(pool)
            for pool_name, side in (side_pools or {}).items():
                b.register_mem_host_pool_v2(side, pool_name)
            b.on_host_pools_registered()
            pair.append(b)
        made.append(pair[0])
        return tuple(pair)

    yield make
    for b in made:
        b.close()
