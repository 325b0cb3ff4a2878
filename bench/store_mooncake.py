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


def client(master: str, plan: Plan) -> dict[str, Any]:
    store = _store(master, 0)
    plain = Row("mooncake", "Mooncake Store put/get",
                note="mooncake-transfer-engine-non-cuda 0.3.13.post1, tcp, 0-byte client")
    zcopy = Row("mooncake_zc", "Mooncake Store put_from/get_into", note="zero-copy API, registered buffers")
    for size in plan.sizes_mb:
        n = size * MB
        reps = plan.reps_for(size)
        src = make_payload(n)

        def key(i: int, api: str, size: int = size) -> str:
            return f"bench-{api}-{size}-{i}"

        # bytes API: put(key, bytes) / get(key) -> bytes
        blob: dict[int, bytes] = {}

        def put_prep(i: int, src: np.ndarray = src, blob: dict[int, bytes] = blob) -> None:
            stamp(src, i)
            blob.clear()
            blob[i] = src.tobytes()

        def put_op(i: int, blob: dict[int, bytes] = blob, key: Any = key) -> None:
            _check_rc(store.put(key(i, "b"), blob[i]), "put")

        def put_verify(i: int, src: np.ndarray = src, key: Any = key) -> None:
            check_equal(store.get(key(i, "b")), src, "mooncake put")

        plain.put[size] = gbps(n, time_reps(put_op, put_verify, plan.warmup, reps, put_prep))
        got: dict[int, bytes] = {}

        def get_op(i: int, got: dict[int, bytes] = got, key: Any = key) -> None:
            got[i] = store.get(key(i, "b"))

        def get_verify(i: int, src: np.ndarray = src, got: dict[int, bytes] = got) -> None:
            stamp(src, i)
            check_equal(got.pop(i), src, "mooncake get")

        plain.get[size] = gbps(n, time_reps(get_op, get_verify, plan.warmup, reps))
        blob.clear()

        # zero-copy API from/into registered buffers
        dst = np.zeros(n, dtype=np.uint8)
        for buf in (src, dst):
            _check_rc(store.register_buffer(buf.ctypes.data, n), "register_buffer")

        def zput_prep(i: int, src: np.ndarray = src) -> None:
            stamp(src, i)

        def zput_op(i: int, n: int = n, src: np.ndarray = src, key: Any = key) -> None:
            _check_rc(store.put_from(key(i, "z"), src.ctypes.data, n), "put_from")

        def zput_verify(i: int, n: int = n, src: np.ndarray = src, dst: np.ndarray = dst,
                        key: Any = key) -> None:
            if store.get_into(key(i, "z"), dst.ctypes.data, n) != n:
                raise VerifyError("mooncake get_into (verify) short read")
            check_equal(dst, src, "mooncake put_from")

        zcopy.put[size] = gbps(n, time_reps(zput_op, zput_verify, plan.warmup, reps, zput_prep))

        def zget_prep(i: int, dst: np.ndarray = dst) -> None:
            dst[:8] = 0
            dst[-8:] = 0

        def zget_op(i: int, n: int = n, dst: np.ndarray = dst, key: Any = key) -> None:
            if store.get_into(key(i, "z"), dst.ctypes.data, n) != n:
                raise VerifyError("mooncake get_into short read")

        def zget_verify(i: int, src: np.ndarray = src, dst: np.ndarray = dst) -> None:
            stamp(src, i)
            check_equal(dst, src, "mooncake get_into")

        zcopy.get[size] = gbps(n, time_reps(zget_op, zget_verify, plan.warmup, reps, zget_prep))
        for buf in (src, dst):
            store.unregister_buffer(buf.ctypes.data)
        for i in range(plan.warmup + reps):  # best effort: a lease can still hold a key for a few seconds
            store.remove(key(i, "b"))
            store.remove(key(i, "z"))
    store.close()
    return {"rows": [plain.to_json(), zcopy.to_json()]}


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
