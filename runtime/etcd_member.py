"""``python -m kvpool.runtime.etcd_member``: one etcd member as a launcher child, with a readiness line.

etcd prints no machine-readable "ready", and the launcher (``kvpool up --ha``) waits for children by their
JSON readiness line, so this wrapper starts ``etcd`` (tied to it by the kernel's death signal), polls the
member's ``/health`` until it reports a quorum, prints ``{"ready": true, "port": P, "etcd_pid": N, ...}``,
and then lives exactly as long as etcd does: SIGTERM is passed on, and etcd's exit code is its own.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvpool.runtime.spawn import PR_SET_PDEATHSIG

POLL_S = 0.1


def etcd_argv(name: str, data_dir: Path, host: str, port: int, peer_port: int, cluster: str) -> list[str]:
    binary = shutil.which("etcd") or "/usr/bin/etcd"
    return [
        binary,
        "--name", name,
        "--data-dir", str(data_dir),
        "--listen-client-urls", f"http://{host}:{port}",
        "--advertise-client-urls", f"http://{host}:{port}",
        "--listen-peer-urls", f"http://{host}:{peer_port}",
        "--initial-advertise-peer-urls", f"http://{host}:{peer_port}",
        "--initial-cluster", cluster,
        "--initial-cluster-state", "new",
        # loopback peers: a lost raft leader is replaced in ~0.5 s instead of ~1-2 s, well inside the
        # masters' lease margin, so one member's death never costs the master leader its writes
        "--heartbeat-interval", "50",
        "--election-timeout", "500",
        "--log-level", "warn",
    ]  # fmt: skip


def _die_with_parent() -> None:
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))


def healthy(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/health", timeout=1.0) as r:
            return json.loads(r.read()).get("health") == "true"
    except (urllib.error.URLError, OSError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpool.runtime.etcd_member", description=__doc__.splitlines()[0])
    p.add_argument("--name", required=True)
    p.add_argument("--data-dir", type=Path, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="client port")
    p.add_argument("--peer-port", type=int, required=True)
    p.add_argument("--initial-cluster", required=True, help="name=http://host:peer_port,...")
    p.add_argument("--ready-timeout", type=float, default=30.0)
    a = p.parse_args(argv)
    if shutil.which("etcd") is None and not Path("/usr/bin/etcd").exists():
        print("etcd_member: no etcd binary (scripts/sysdeps.sh installs etcd-server)", file=sys.stderr)
        return 2
    argv_ = etcd_argv(a.name, a.data_dir, a.host, a.port, a.peer_port, a.initial_cluster)
    etcd = subprocess.Popen(argv_, preexec_fn=_die_with_parent)
    signal.signal(signal.SIGTERM, lambda *_: etcd.terminate())
    deadline = time.monotonic() + a.ready_timeout
    while not healthy(a.host, a.port):
        if etcd.poll() is not None:
            return etcd.returncode or 1
        if time.monotonic() > deadline:
            etcd.kill()
            print(f"etcd_member: {a.name} not healthy within {a.ready_timeout:.0f}s", file=sys.stderr)
            return 1
        time.sleep(POLL_S)
    ready = {"ready": True, "host": a.host, "port": a.port, "peer_port": a.peer_port, "etcd_pid": etcd.pid}
    print(json.dumps(ready), flush=True)
    return etcd.wait()


if __name__ == "__main__":
    sys.exit(main())
