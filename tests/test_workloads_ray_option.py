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
        self.exceptions = types.SimpleNamespace(GetTimeoutError=TimeoutError)  # Ray's is a TimeoutError too
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


class _StallingRay(_FakeRay):
    """A cluster where the first ``finish`` tasks finish (each having taken ``seconds``) and every other one
    stays out for ever (its node froze): neither done nor failed."""

    def __init__(self, finish: int = 0, seconds: float = 1.0, get_error: BaseException | None = None) -> None:
        super().__init__()
        self.finish, self.seconds, self.get_error = finish, seconds, get_error
        self.waited: list[float] = []
        self.cancelled: list[tuple[Any, bool]] = []

    def remote(self, **_: Any) -> Any:
        return lambda fn: types.SimpleNamespace(remote=lambda f, box, t: _Ref((t, self.seconds)))

    def wait(self, refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> Any:
        assert timeout is not None
        self.waited.append(timeout)
        if self.finish:
            self.finish -= 1
            return refs[:1], refs[1:]
        return [], refs

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        if self.get_error is not None:
            raise self.get_error
        return ref.value

    def cancel(self, ref: Any, force: bool = False) -> None:
        self.cancelled.append((ref, force))


def test_a_sweep_whose_points_never_finish_is_cancelled_at_its_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    frozen = _StallingRay()
    monkeypatch.setitem(sys.modules, "ray", frozen)
    with pytest.raises(ReplayError, match=r"no sweep point finished within 0\.5 s; 3 of 3 still out"):
        parallel_ray.run_points_ray(lambda shared, t: t, None, [1, 2, 3], "auto", stall_floor_s=0.5)
    assert frozen.waited == [0.5]
    assert len(frozen.cancelled) == 3 and all(force for _, force in frozen.cancelled)


def test_the_deadline_grows_with_the_slowest_point_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    stalls = _StallingRay(finish=1, seconds=2.0)  # one point of 2 s finishes, the others never do
    monkeypatch.setitem(sys.modules, "ray", stalls)
    finished: list[int] = []
    with pytest.raises(ReplayError, match=r"within 8 s; 2 of 3 still out"):
        parallel_ray.run_points_ray(
            lambda shared, t: t,
            None,
            [1, 2, 3],
            "auto",
            lambda i, row, s: finished.append(row),
            stall_floor_s=0.5,
        )
    assert finished == [1] and stalls.waited == [0.5, 8.0]  # max(floor, 4 x the slowest so far)
    assert len(stalls.cancelled) == 2


@pytest.mark.parametrize("error", ["timeout", "failed point"])
def test_a_point_that_cannot_be_got_cancels_the_rest(monkeypatch: pytest.MonkeyPatch, error: str) -> None:
    get_error = TimeoutError("took too long") if error == "timeout" else RuntimeError("the point raised")
    broken = _StallingRay(finish=1, get_error=get_error)
    monkeypatch.setitem(sys.modules, "ray", broken)
    expected = (
        (ReplayError, r"did not arrive within 0\.5 s") if error == "timeout" else (RuntimeError, "raised")
    )
    with pytest.raises(expected[0], match=expected[1]):
        parallel_ray.run_points_ray(lambda shared, t: t, None, [1, 2, 3], "auto", stall_floor_s=0.5)
    assert len(broken.cancelled) == 2  # what was still out
