"""``--ray`` (the optional extra ``kvpool[ray]``): without Ray installed (as ``make test`` leaves it) the
flag is one clear error naming it and the install; a local stand-in for Ray gives the local pool's rows
(task order, the shared data put once and unpickled once per worker). The real cluster check is
scripts/ray_check.sh."""

from __future__ import annotations

import importlib.util
import sys
import types
from typing import Any

import pytest
from kvpool.worker.checkpoint_policy import CheckpointPolicy
from kvpool.workloads import parallel_ray
from kvpool.workloads.errors import ReplayError
from kvpool.workloads.specs import get_spec
from kvpool.workloads.sweep import capacity_sweep
from kvpool.workloads.trace import bundled_trace, read_mooncake

from kvpool.commands.main import main

GiB = 2**30


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="Ray is installed here")
def test_without_ray_the_flag_names_the_extra(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    args = ["replay", "conversation", "--limit", "100", "--policy", "lru,bound", "--capacity-bytes",
            "29GiB,89GiB", "--ray", "auto", "--no-progress", "--out-dir", str(tmp_path)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--ray" in err and "kvpool[ray]" in err


class _Ref:
    def __init__(self, value: Any) -> None:
        self.value = value

    def hex(self) -> str:
        return f"{id(self):x}"


class _FakeRay(types.ModuleType):
    """Just enough of Ray's API, run in this process: put once, remote, wait, get."""

    def __init__(self) -> None:
        super().__init__("ray")
        self.puts = 0
        self.shared_gets = 0  # gets of what was put (a task's result is got too)
        self.shared: set[int] = set()

    def is_initialized(self) -> bool:
        return True

    def put(self, value: Any) -> Any:
        self.puts += 1
        ref = _Ref(value)
        self.shared.add(id(ref))
        return ref

    def remote(self, **_: Any) -> Any:
        def wrap(fn: Any) -> Any:
            # arguments pass as Ray passes them: a top-level ref would be resolved, one in a list is not
            return types.SimpleNamespace(remote=lambda f, box, t: _Ref(fn(f, box, t)))

        return wrap

    def wait(self, refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> Any:
        assert timeout is not None and timeout > 0  # the sweep never waits without a deadline
        return refs[-num_returns:], refs[:-num_returns]  # finish out of order on purpose

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        self.shared_gets += id(ref) in self.shared
        return ref.value


def test_ray_tasks_give_the_local_rows_with_the_trace_put_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeRay()
    monkeypatch.setitem(sys.modules, "ray", fake)
    reqs = sorted(read_mooncake(bundled_trace("conversation")), key=lambda r: r.arrival_ms)[:400]
    k3 = get_spec("k3")
    args = (reqs, k3, [29 * GiB, 89 * GiB], "bytes", ["lru", "reference"], CheckpointPolicy(), 512)
    local = capacity_sweep(*args, jobs=1)
    remote = capacity_sweep(*args, ray="auto")
    assert remote == local and fake.puts == 1
    assert fake.shared_gets == 1  # the worker (this process) unpickled the shared data once for all tasks


def test_an_address_that_does_not_answer_is_an_error_within_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hang = types.ModuleType("ray")
    hang.is_initialized = lambda: False  # type: ignore[attr-defined]
    hang.init = lambda **_: __import__("time").sleep(30)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", hang)
    with pytest.raises(ReplayError, match=r"--ray 10\.0\.0\.1:6379: no Ray cluster answered within 0\.3 s"):
        parallel_ray.connect("10.0.0.1:6379", timeout_s=0.3)


class _FrozenRay(_FakeRay):
    """A cluster whose every node froze: tasks are submitted, none ever finishes or fails."""

    def __init__(self) -> None:
        super().__init__()
        self.waited: list[float] = []
        self.cancelled: list[Any] = []

    def remote(self, **_: Any) -> Any:
        return lambda fn: types.SimpleNamespace(remote=lambda f, box, t: _Ref(None))

    def wait(self, refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> Any:
        assert timeout is not None
        self.waited.append(timeout)
        return [], refs

    def cancel(self, ref: Any, force: bool = False) -> None:
        self.cancelled.append(ref)


def test_a_sweep_whose_points_never_finish_is_cancelled_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frozen = _FrozenRay()
    monkeypatch.setitem(sys.modules, "ray", frozen)
    with pytest.raises(ReplayError, match=r"no sweep point finished within 0\.5 s; 3 of 3 still out"):
        parallel_ray.run_points_ray(lambda shared, t: t, None, [1, 2, 3], "auto", stall_floor_s=0.5)
    assert frozen.waited == [0.5] and len(frozen.cancelled) == 3
