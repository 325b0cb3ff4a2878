"""Bad input at engine start: one ``HiCacheConfigError`` naming the field, raised through SGLang's own
``StorageBackendFactory`` (so the engine refuses to start), never a backend that then fails while serving."""

from __future__ import annotations

import socket

import pytest
import torch
from kvpool.integrations.sglang.config import HiCacheConfigError, parse_config
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tests.sglang_hicache.conftest import storage_config
from tests.sglang_hicache.host_pools import CpuMLAHostPool


def build(store, file_dir, **kw):
    return StorageBackendFactory.create_backend(
        "dynamic", storage_config(store.address, file_dir, "config", **kw), None
    )


def field_of(excinfo) -> str:
    return excinfo.value.field


def test_fields_are_checked_by_name():
    for extra, field in [
        ('{"master": "127.0.0.1:1", ', "extra_config"),  # malformed JSON text
        ("[1, 2]", "extra_config"),
        ({}, "master"),
        ({"master": "no-port"}, "master"),
        ({"master": "h:99999"}, "master"),
        ({"master": "h:1", "salt": 7}, "salt"),
        ({"master": "h:1", "salt": None}, "salt"),
        ({"master": "h:1", "tenant": 3}, "tenant"),
        ({"master": "h:1", "transport": "rdma"}, "transport"),
        ({"master": "h:1", "deadline_s": 0}, "deadline_s"),
        ({"master": "h:1", "deadline_s": "5"}, "deadline_s"),
    ]:
        with pytest.raises(HiCacheConfigError) as e:
            parse_config(extra)
        assert field_of(e) == field, extra
        assert repr(field) in str(e.value)
    ok = parse_config('{"master": "a:1,b:2;c:3", "salt": "t", "deadline_s": 2}')
    assert (ok.master, ok.salt, ok.deadline_s) == ("a:1,b:2;c:3", "t", 2.0)


def test_salt_of_the_wrong_type_fails_the_start(store, file_dir):
    with pytest.raises(HiCacheConfigError, match="'salt'"):
        build(store, file_dir, salt=["tenant-a"])


def test_unknown_master_fails_the_start(store, file_dir):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for master in (f"127.0.0.1:{port}", "no-such-host.invalid:50051"):
        cfg = storage_config(master, file_dir, "config", deadline_s=2)
        with pytest.raises(HiCacheConfigError, match="'master'"):
            StorageBackendFactory.create_backend("dynamic", cfg, None)


class HugePages(CpuMLAHostPool):
    """A pool whose pages (as its zero-copy metadata reports them) are larger than any node of the store."""

    def get_page_buffer_meta(self, indices: torch.Tensor) -> tuple[list[int], list[int]]:
        return [self.kv_buffer.data_ptr()], [1 << 30]


def test_page_size_the_store_cannot_hold_fails_the_start(store, file_dir):
    backend = build(store, file_dir)
    try:
        with pytest.raises(HiCacheConfigError, match="'page_size'"):
            backend.register_mem_pool_host(HugePages(pages=1))
        backend.register_mem_pool_host(CpuMLAHostPool(pages=1))  # a normal pool is fine
    finally:
        backend.close()
