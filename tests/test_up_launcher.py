"""``kvpool.launch.cluster`` launcher details that need no cluster: orphan-free children when the launcher is
killed hard, readiness deadlines with the child's log in the error, config merging, which run is current."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from kvpool.runtime.spawn import LaunchError, pid_alive, wait_ready

from kvpool.launch.cluster import Cluster
from kvpool.launch.config import load_config


def _gone(pid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_children_die_with_a_sigkilled_launcher(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from kvpool.launch.cluster import Cluster
        c = Cluster({{"cluster": {{}}}}, Path({str(tmp_path)!r}))
        child = c.start_service("sleeper", "test", ["http.server", "0", "--bind", "127.0.0.1"])
        print(child.popen.pid, flush=True)
        time.sleep(60)
    """)
    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child_pid = int(launcher.stdout.readline())  # type: ignore[union-attr]
    os.kill(child_pid, 0)  # running
    assert os.getpgid(child_pid) != os.getpgid(launcher.pid)  # own session: a terminal Ctrl-C skips it
    launcher.kill()
    launcher.wait(10)
    assert _gone(child_pid, 10), "child outlived its launcher"
    assert (tmp_path / "sleeper.log").exists()


def test_a_killed_child_not_yet_reaped_is_not_alive() -> None:
    """``kvpool status`` calls a service ``down`` when its process has exited, also while it is a zombie
    its parent has not reaped yet (it called such a service ``unhealthy`` for a moment after a kill -9)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/stat").read_bytes().split(b") ")[1][:1] != b"Z":
            assert time.monotonic() < deadline, "the killed child never became a zombie"
            time.sleep(0.01)
        assert not pid_alive(child.pid), "a zombie has exited"
    finally:
        child.kill()
        child.wait()
    assert not pid_alive(child.pid)


def test_a_child_that_exits_early_fails_fast_with_its_log(tmp_path: Path) -> None:
    c = Cluster({"cluster": {}}, tmp_path)
    child = c.start_service("broken", "test", ["kvpool.kvstore.cli", "master", "--no-such-flag"])
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match="no-such-flag"):
        wait_ready(child, 30)
    assert time.monotonic() - t0 < 15


def test_a_silent_child_hits_the_readiness_deadline(tmp_path: Path) -> None:
    c = Cluster({"cluster": {}}, tmp_path)
    child = c.start_service("silent", "test", ["http.server", "0", "--bind", "127.0.0.1"])
    try:
        with pytest.raises(LaunchError, match="not ready within 1s"):
            wait_ready(child, 1.0)
    finally:
        child.popen.send_signal(signal.SIGTERM)
        child.popen.wait(10)


def test_user_config_is_merged_over_the_defaults(tmp_path: Path) -> None:
    user = tmp_path / "mine.toml"
    user.write_text('[gateway]\nrouting = "rr"\n[decode]\ncount = 2\n')
    cfg = load_config(user, {"gateway": {"port": 0}})
    assert cfg["gateway"]["routing"] == "rr" and cfg["gateway"]["port"] == 0
    assert cfg["decode"]["count"] == 2 and cfg["prefill"]["count"] == 2  # untouched default
    assert cfg["gateway"]["max_concurrent"] == 64


def test_only_a_published_cluster_becomes_the_one_kvpool_status_shows(tmp_path: Path, monkeypatch) -> None:
    """``kvpool verify``'s and the tests' clusters (``publish=False``) leave a running ``kvpool up`` the
    current one."""
    monkeypatch.setenv("KVPOOL_RUNS", str(tmp_path / "runs"))
    Cluster(load_config(), tmp_path / "up").write_state()
    Cluster(load_config(), tmp_path / "quiet", publish=False).write_state()
    assert (tmp_path / "quiet" / "state.json").exists()
    current = json.loads((tmp_path / "runs" / "current.json").read_text())
    assert current["run_dir"] == str(tmp_path / "up")
