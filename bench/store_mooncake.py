"""Mooncake Store processes for the store bench; runs under ``bench/.venv-mooncake/bin/python`` only.

Two roles, both started by ``store_baselines.section_mooncake``:

* ``owner MASTER_ADDR SEGMENT_BYTES``: mounts a segment, prints ``{"ready": true}``, holds it until its
  stdin closes (or a hard deadline passes, so an orphan never lingers).
* ``client MASTER_ADDR PLAN_JSON``: mounts 0 bytes (every object crosses TCP to the owner), times
  put/get and the zero-copy put_from/get_into with the bench's shared rules (``store_common``), verifies
  every rep and prints one JSON line with the rows.

It imports only numpy, the stdlib and ``mooncake`` so it works in the Mooncake venv, which does not have
the project installed.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

import numpy as np
from store_common import (
    HOST,
    MB,
    Plan,
    Row,
    VerifyError,
    check_equal,
    gbps,
    make_payload,
    stamp,
    time_reps,
)

OWNER_MAX_LIFETIME_S = 1800.0
LOCAL_BUFFER = 512 * MB  # transfer buffer of the bytes API; must exceed the largest object


def _store(master: str, segment: int) -> Any:
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(HOST, "P2PHANDSHAKE", segment, LOCAL_BUFFER, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def owner(master: str, segment: int) -> None:
    store = _store(master, segment)
    print(json.dumps({"ready": True, "segment_bytes": segment}), flush=True)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    done.wait(OWNER_MAX_LIFETIME_S)
    store.close()


def _check_rc(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} returned {rc}")


def _bytes_api(store: Any, plan: Plan, size: int) -> tuple[float, float]:
    """put(key, bytes) / get(key) -> bytes at one size; returns (put, get) GB/s; removes its keys after."""
    n = size * MB
    reps = plan.reps_for(size)
    src = make_payload(n)
    keys = [f"bench-b-{size}-{i}" for i in range(plan.warmup + reps)]
    blob: dict[int, bytes] = {}

    def put_prep(i: int) -> None:
        stamp(src, i)
        blob.clear()
        blob[i] = src.tobytes()

    def put_op(i: int) -> None:
        _check_rc(store.put(keys[i], blob[i]), "put")

    def put_verify(i: int) -> None:
        check_equal(store.get(keys[i]), src, "mooncake put")

    got: dict[int, bytes] = {}

    def get_op(i: int) -> None:
        got[i] = store.get(keys[i])

    def get_verify(i: int) -> None:
        stamp(src, i)
        check_equal(got.pop(i), src, "mooncake get")

    try:
        put = gbps(n, time_reps(put_op, put_verify, plan.warmup, reps, put_prep))
        blob.clear()
        get = gbps(n, time_reps(get_op, get_verify, plan.warmup, reps))
    finally:
        _remove(store, keys)
    return put, get


def _zero_copy_api(store: Any, plan: Plan, size: int) -> tuple[float, float]:
    """put_from / get_into on registered buffers at one size; returns (put, get) GB/s."""
    n = size * MB
    reps = plan.reps_for(size)
    src = make_payload(n)
    dst = np.zeros(n, dtype=np.uint8)
    keys = [f"bench-z-{size}-{i}" for i in range(plan.warmup + reps)]

    def get_into(i: int) -> None:
        if store.get_into(keys[i], dst.ctypes.data, n) != n:
            raise VerifyError("mooncake get_into short read")

    def put_prep(i: int) -> None:
        stamp(src, i)

    def put_op(i: int) -> None:
        _check_rc(store.put_from(keys[i], src.ctypes.data, n), "put_from")

    def put_verify(i: int) -> None:
        dst[:8] = 0
        get_into(i)
        check_equal(dst, src, "mooncake put_from")

    def get_prep(i: int) -> None:
        dst[:8] = 0
        dst[-8:] = 0

    def get_verify(i: int) -> None:
        stamp(src, i)
        check_equal(dst, src, "mooncake get_into")

    for buf in (src, dst):
        _check_rc(store.register_buffer(buf.ctypes.data, n), "register_buffer")
    try:
        put = gbps(n, time_reps(put_op, put_verify, plan.warmup, reps, put_prep))
        get = gbps(n, time_reps(get_into, get_verify, plan.warmup, reps, get_prep))
    finally:
        for buf in (src, dst):
            store.unregister_buffer(buf.ctypes.data)
        _remove(store, keys)
    return put, get


def _remove(store: Any, keys: list[str]) -> None:
    """Free the segment for the next size. A key read a moment ago is under a lease (OBJECT_HAS_LEASE)
    for a few seconds, so retry briefly; whatever stays is covered by the segment's headroom."""
    left = list(keys)
    end = time.monotonic() + 10
    while left and time.monotonic() < end:
        left = [k for k in left if store.remove(k) not in (0, -704)]  # -704: already gone
        if left:
            time.sleep(0.5)


def client(master: str, plan: Plan) -> dict[str, Any]:
    """Measure both APIs size by size; one API failing keeps the other's (verified) cells."""
    store = _store(master, 0)
    rows = [
        Row(
            "mooncake",
            "Mooncake Store put/get",
            note="mooncake-transfer-engine-non-cuda 0.3.13.post1, tcp, 0-byte client",
        ),
        Row("mooncake_zc", "Mooncake Store put_from/get_into", note="zero-copy API, registered buffers"),
    ]
    measure = {"mooncake": _bytes_api, "mooncake_zc": _zero_copy_api}
    failed: dict[str, str] = {}
    for size in plan.sizes_mb:
        for row in rows:
            if row.id in failed:
                continue
            try:
                row.put[size], row.get[size] = measure[row.id](store, plan, size)
            except Exception as exc:  # the row stops here; its cells so far were verified
                failed[row.id] = f"at {size} MB: {type(exc).__name__}: {exc}"
    store.close()
    kept = [r for r in rows if r.put or r.get]
    return {"rows": [r.to_json() for r in kept], "skipped": failed}


def main() -> int:
    role, master = sys.argv[1], sys.argv[2]
    if role == "owner":
        owner(master, int(sys.argv[3]))
        return 0
    plan = Plan.from_json(json.loads(sys.argv[3]))
    t0 = time.monotonic()
    try:
        res = client(master, plan)
    except Exception as exc:  # reported to the parent as a skip reason, never a number
        res = {"rows": [], "error": f"{type(exc).__name__}: {exc}"}
    res["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
