"""Generators: deterministic per seed, statistics match their parameters, and each workload has the
reuse structure it claims (measured by the independent prefix computation in ``trace_stats``)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest
from kvpool.workloads.errors import GeneratorParamError
from kvpool.workloads.generators import generate, generate_mix, parse_mix
from kvpool.workloads.stats import trace_stats
from kvpool.workloads.trace import Request, read_kvpool
from kvpool.workloads.workload_params import PARAMS, make_params

from kvpool.commands.main import main


def _small(workload: str) -> object:
    small = {
        "chat": {"system_tokens": 300, "user_tokens": 100, "output_tokens": 100},
        "agent": {"system_tokens": 500, "tool_schema_tokens": 800, "result_tokens": 200},
        "agent_loop": {"prefix_tokens": 1000, "result_tokens": 100},
        "coding": {"repo_tokens": 4000, "file_tokens": 150, "user_tokens": 50, "output_tokens": 60},
        "rag": {"document_tokens": 1000, "documents": 30},
        "oneshot": {"input_tokens": 500},
    }
    return make_params(workload, small[workload])


@pytest.mark.parametrize("workload", sorted(PARAMS))
def test_deterministic_valid_and_sorted(workload: str) -> None:
    a = generate(workload, 120, rate=5.0, seed=3, vocab=1000, params=_small(workload))
    b = generate(workload, 120, rate=5.0, seed=3, vocab=1000, params=_small(workload))
    c = generate(workload, 120, rate=5.0, seed=4, vocab=1000, params=_small(workload))
    assert a == b and a != c and len(a) == 120
    for r in a:
        r.validate()
        assert r.tokens is not None and max(r.tokens) < 1000 and r.workload == workload
    assert [r.arrival_ms for r in a] == sorted(r.arrival_ms for r in a)


def test_oneshot_lengths_rate_and_no_reuse() -> None:
    reqs = generate("oneshot", 3000, rate=20.0, seed=1, vocab=32000, params=make_params("oneshot"))
    lengths = np.array([r.input_length for r in reqs])
    assert lengths.mean() == pytest.approx(2000, rel=0.05)
    assert np.mean([r.output_length for r in reqs]) == pytest.approx(200, rel=0.05)
    span_s = (reqs[-1].arrival_ms - reqs[0].arrival_ms) / 1000
    assert len(reqs) / span_s == pytest.approx(20.0, rel=0.1)
    assert trace_stats(reqs, block_size=64)["infinite_token_hit_rate"] == 0.0


def _turns(reqs: list[Request]) -> dict[str, list[Request]]:
    out: dict[str, list[Request]] = {}
    for r in sorted(reqs, key=lambda r: (r.conversation_id, r.turn)):
        out.setdefault(str(r.conversation_id), []).append(r)
    return out


def test_chat_turns_extend_the_previous_turn() -> None:
    reqs = generate("chat", 400, rate=2.0, seed=2, vocab=5000, params=_small("chat"))
    checked = 0
    for turns in _turns(reqs).values():
        for prev, cur in itertools.pairwise(turns):
            assert cur.turn == prev.turn + 1
            history = (prev.tokens or []) + (prev.output_tokens or [])
            assert cur.tokens is not None and cur.tokens[: len(history)] == history
            checked += 1
    assert checked > 100
    # with no think time every turn of a session arrives at its start, so the window truncates nothing
    flat = make_params(
        "chat", {"think_s": "0", "system_tokens": "50", "user_tokens": "20", "output_tokens": "20"}
    )
    sessions = _turns(generate("chat", 3000, 50.0, seed=5, vocab=500, params=flat))
    assert np.mean([len(t) for t in sessions.values()]) == pytest.approx(6.0, rel=0.15)


def test_coding_reuses_at_least_90_percent() -> None:
    reqs = generate("coding", 300, rate=1.0, seed=1, vocab=32000, params=make_params("coding"))
    fractions = []
    for turns in _turns(reqs).values():
        for prev, cur in itertools.pairwise(turns):
            fractions.append((prev.input_length + prev.output_length) / cur.input_length)
    assert np.mean(fractions) >= 0.9
    assert trace_stats(reqs, block_size=64)["infinite_token_hit_rate"] >= 0.9


def test_rag_prompts_are_system_plus_document_plus_question() -> None:
    p = make_params(
        "rag", {"documents": 20, "document_tokens": 800, "system_tokens": 100, "question_tokens": 50}
    )
    reqs = generate("rag", 300, rate=5.0, seed=1, vocab=32000, params=p)
    system = reqs[0].tokens[:64]  # type: ignore[index]
    assert all((r.tokens or [])[:64] == system for r in reqs)
    expected = (100 + 800) / (100 + 800 + 50)  # shared part of a prompt once its document was seen
    hit = trace_stats(reqs, block_size=64)["infinite_token_hit_rate"]
    assert 0.6 < hit < expected


def test_agent_history_grows_by_call_and_result() -> None:
    p = _small("agent")
    reqs = generate("agent", 300, rate=5.0, seed=1, vocab=32000, params=p)
    grown = 0
    for steps in _turns(reqs).values():
        for prev, cur in itertools.pairwise(steps):
            history = (prev.tokens or []) + (prev.output_tokens or [])
            assert (cur.tokens or [])[: len(history)] == history and cur.input_length > len(history)
            grown += 1
    assert grown > 100
    assert len({tuple((r.tokens or [])[:256]) for r in reqs}) == 1  # one system prompt for every toolset
    assert trace_stats(reqs, block_size=64)["infinite_token_hit_rate"] > 0.8


def test_mix_and_trace_driven_arrivals() -> None:
    mix = parse_mix("chat=2,rag=1,oneshot=1")
    assert mix == pytest.approx({"chat": 0.5, "rag": 0.25, "oneshot": 0.25})
    params = {w: _small(w) for w in mix}
    reqs = generate_mix(mix, 200, rate=10.0, seed=1, vocab=1000, params=params, tenants=3)
    assert len(reqs) == 200 and {r.workload for r in reqs} == set(mix)
    assert {r.tenant for r in reqs} == {"t0", "t1", "t2"}
    times = [0.0, 10.0, 10.0, 25.0, 40.0]
    driven = generate("oneshot", 5, rate=1.0, seed=1, vocab=100, params=_small("oneshot"), arrivals_ms=times)
    assert [r.arrival_ms for r in driven] == times


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: make_params("poems"), "unknown workload"),
        (lambda: make_params("chat", {"colour": "1"}), "no parameter 'colour'"),
        (lambda: make_params("chat", {"turns": "0.5"}), "turns must be >= 1"),
        (lambda: make_params("rag", {"documents": "-3"}), "must be > 0"),
        (lambda: make_params("chat", {"turns": "many"}), "must be a float"),
        (lambda: generate("chat", 0, 1.0), "requests must be a positive integer"),
        (lambda: generate("chat", 10, 0.0), "rate must be > 0"),
        (lambda: parse_mix("chat=x"), "bad weight"),
        (lambda: generate("oneshot", 5, 1.0, arrivals_ms=[0.0]), "1 arrival times for 5 requests"),
    ],
)
def test_bad_parameters(call: object, message: str) -> None:
    with pytest.raises(GeneratorParamError, match=message):
        call()  # type: ignore[operator]


def test_cli_generate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chat.jsonl.gz"
    argv = [
        "trace",
        "generate",
        "--workload",
        "chat",
        "--requests",
        "50",
        "--rate",
        "5",
        "--vocab",
        "1000",
        "--param",
        "chat.system_tokens=200",
        "--param",
        "chat.user_tokens=50",
        "-o",
        str(out),
    ]
    assert main(argv) == 0
    assert len(read_kvpool(out)) == 50
    assert main(["trace", "generate", "--workload", "chat", "--param", "chat.nope=1", "-o", str(out)]) == 2
    assert "no parameter 'nope'" in capsys.readouterr().err
    assert main(["replay", str(out), "--spec", "tiny", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["requests"] == 50 and d["token_hit_rate"] > 0.3 and d["config"]["block_size"] == 64
    assert d["tenants"]["t0"]["requests"] == 50


def test_agent_loop_steps_every_one_to_three_seconds_over_a_shared_prefix() -> None:
    reqs = generate("agent_loop", 200, rate=4.0, seed=2, vocab=32000, params=_small("agent_loop"))
    runs = _turns(reqs)
    gaps = [(b.arrival_ms - a.arrival_ms) / 1000 for run in runs.values() for a, b in itertools.pairwise(run)]
    assert gaps and all(0.999 <= g <= 3.001 for g in gaps)
    for run in runs.values():
        for a, b in itertools.pairwise(run):
            assert b.tokens[: a.input_length] == a.tokens  # each step extends the previous prompt
    firsts = [run[0].tokens[:900] for run in runs.values()]
    assert len({tuple(f) for f in firsts}) <= 2  # one long prefix per deployment
    with pytest.raises(GeneratorParamError, match="min_gap_s"):
        make_params("agent_loop", {"min_gap_s": "4"})
