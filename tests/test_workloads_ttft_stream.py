"""TTFT estimates follow the stated formula per request and tier; a streamed replay equals the loaded one,
reads lazily, and an out-of-order stream or an oversized trace fails with a message, not a wrong answer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpool.workloads import trace
from kvpool.workloads.commands import common
from kvpool.workloads.errors import ReplayError, TraceFormatError
from kvpool.workloads.sim import SimConfig, simulate
from kvpool.workloads.specs import get_spec
from kvpool.workloads.trace import Request, arrival_ordered, bundled_trace, read_mooncake
from kvpool.workloads.trace_write import write_kvpool
from kvpool.workloads.ttft import TtftModel

from kvpool.commands.main import main

K3 = get_spec("k3")


@pytest.fixture(scope="module")
def conv() -> list[Request]:
    return sorted(read_mooncake(bundled_trace("conversation")), key=lambda r: r.arrival_ms)[:400]


def test_ttft_estimate_is_load_plus_recompute_per_request(conv: list[Request]) -> None:
    model = TtftModel(dram_gbps=100, ssd_gbps=5, network_gbps=25, gpu_flops=1e15, mfu=0.5)
    d = simulate(conv, SimConfig(spec=K3, capacity=200 * 2**30, ttft=model)).to_dict(per_request=True)
    per = d["per_request"]
    assert any(c > 0 for c in per["cached"]), "the prefix of a conversation trace must hit"
    cols = ("input", "cached", "dram_bytes", "ssd_bytes", "ttft_est_ms", "ttft_nocache_ms")
    for i, c, dram, ssd, est, base in zip(*(per[k] for k in cols), strict=True):
        assert ssd == 0  # no SSD tier
        loaded = c * K3.mla_bytes_per_token + (K3.kda_bytes_per_checkpoint if c else 0)
        assert dram == loaded
        compute = (i - c) * K3.prefill_flops_per_token / 5e14
        assert est == pytest.approx(1000 * (dram / 25e9 + compute), abs=1e-3)  # the NIC bounds DRAM reads
        assert base == pytest.approx(1000 * i * K3.prefill_flops_per_token / 5e14, abs=1e-3)
        assert est <= base + 1000 * dram / 25e9
    assert d["ttft_est_ms_mean"] < d["ttft_nocache_ms_mean"]
    (wl,) = d["workloads"].values()
    assert set(wl) >= {"ttft_est_ms_p90", "ttft_nocache_ms_p50"}


def test_ssd_hits_are_charged_at_ssd_speed(conv: list[Request]) -> None:
    cfg = SimConfig(spec=K3, capacity=8 * 2**30, ssd_capacity=400 * 2**30)
    per = simulate(conv, cfg).to_dict(per_request=True)["per_request"]
    assert sum(per["ssd_bytes"]) > 0, "a small DRAM over a large SSD must serve some hits from SSD"
    m = TtftModel()
    for i, c, dram, ssd, est in zip(per["input"], per["cached"], per["dram_bytes"], per["ssd_bytes"],
                                    per["ttft_est_ms"], strict=True):  # fmt: skip
        assert est == pytest.approx(m.ttft_ms(K3, i, c, dram, ssd), abs=1e-3)


@pytest.mark.parametrize("field", ["dram_gbps", "mfu", "gpu_flops"])
def test_a_nonpositive_ttft_parameter_is_refused(field: str) -> None:
    bad = TtftModel(**{field: 0.0})
    with pytest.raises(ReplayError, match=field):
        simulate([], SimConfig(spec=K3, ttft=bad))


def test_a_streamed_replay_equals_the_loaded_one(conv: list[Request]) -> None:
    cfg = SimConfig(spec=K3, capacity=60 * 2**30)
    loaded = simulate(conv, cfg).to_dict(per_request=True)
    streamed = simulate(iter(conv), cfg).to_dict(per_request=True)
    assert streamed == loaded


def test_a_stream_is_replayed_as_it_is_read(conv: list[Request], monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulation consumes the stream as it goes: by the time request k is replayed, the reader has
    handed out no more than k + the reorder window."""
    read = 0

    def source() -> Iterator[Request]:
        nonlocal read
        for r in conv:
            read += 1
            yield r

    seen: list[tuple[int, int]] = []
    monkeypatch.setattr(trace, "REORDER_WINDOW", 8)
    simulate(source(), SimConfig(spec=K3), lambda done, _: seen.append((done, read)))
    assert all(r <= d + 8 + 1 for d, r in seen) and seen[-1][0] == len(conv)


def test_an_out_of_order_stream_is_an_error_not_a_silent_reorder(conv: list[Request]) -> None:
    late = [*conv[:20], conv[0]]  # arrives earlier than 19 records already emitted
    assert [r.request_id for r in arrival_ordered(iter(conv[:5]), window=2)] == [
        r.request_id for r in conv[:5]
    ]
    with pytest.raises(TraceFormatError, match="arrival order within 4 records"):
        list(arrival_ordered(iter(late), window=4))


def test_replay_stream_flag_matches_the_loaded_replay(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, conv: list[Request]
) -> None:
    path = tmp_path / "t.jsonl"
    write_kvpool(conv, path)
    outs = []
    for extra in ([], ["--stream"]):
        assert main(["replay", str(path), "--capacity-bytes", "60GiB", "--json", *extra]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert outs[0] == outs[1]
    assert main(["replay", str(path), "--stream", "--policy", "reference", "--capacity-bytes", "1TiB"]) == 2
    assert "--stream runs one simulation" in capsys.readouterr().err


def test_a_trace_too_large_to_load_is_streamed_or_refused_with_a_message(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, conv: list[Request], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.jsonl"
    write_kvpool(conv[:50], path)
    monkeypatch.setattr(common, "available_memory", lambda: 1000)  # "the machine has 1000 bytes free"
    assert main(["replay", str(path), "--policy", "lru,hybrid", "--capacity-bytes", "auto"]) == 2
    err = capsys.readouterr().err
    assert "needs the whole trace in memory" in err and "streams the file" in err
    monkeypatch.setattr(common, "STREAM_ABOVE_BYTES", 0)
    import kvpool.workloads.commands.replay as replay_cmd

    monkeypatch.setattr(replay_cmd, "STREAM_ABOVE_BYTES", 0)
    assert main(["replay", str(path), "--capacity-bytes", "60GiB", "--json"]) == 0  # streamed, not refused
    assert json.loads(capsys.readouterr().out)["requests"] == 50
    assert main(["replay", str(path), "--policy", "lru,hybrid", "--capacity-bytes", "60GiB,1TiB",
                 "--limit", "10", "--json", "--no-progress", "--out-dir", str(tmp_path)]) == 0  # fmt: skip
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert {int(r["requests"]) for r in rows} == {10}
