"""Seeded synthetic workloads with the reuse structure of real LLM traffic, emitted as token-level records.

Each generator builds *sessions* (a conversation, an agent run, a coding session, a RAG user) whose
requests share prefixes the way the real workload does, then places them in time: sessions start as a
Poisson process, turns follow after exponential think times; or arrivals are taken from a trace. Every
record carries its prompt token ids (so a live replay can send them) and the reply the next turn quotes.

Lengths are lognormal with the given mean (sigma ``LENGTH_SIGMA``): heavy-tailed like real prompts, but
with a mean a test can check. Same parameters + same seed => byte-identical output.

Workloads (parameters in ``workload_params``):

- ``chat``: multi-turn chat; one of a few shared system prompts, then user/assistant turns.
- ``agent``: tool-calling agent; long system prompt + tool schemas shared per toolset, then a history
  that grows by a tool call and its (long) result per step.
- ``agent_loop``: an autonomous agent loop; a long prefix shared per deployment, then tool calls back to
  back (a uniform 1-3 s gap after each), so a run re-reads its own chain every few seconds.
- ``coding``: coding agent; a large repository context shared by the sessions on that repo, small
  increments per turn, so >= 90 % of each prompt was seen before.
- ``rag``: long-document QA; a system prompt + one document from a Zipf-popular pool + a fresh question.
- ``oneshot``: unique prompts, no reuse at all (the floor every cache should leave alone).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvpool.workloads.errors import GeneratorParamError
from kvpool.workloads.trace_record import RETENTION_TIERS_MS, Request
from kvpool.workloads.workload_params import (
    PARAMS,
    AgentLoopParams,
    AgentParams,
    ChatParams,
    CodingParams,
    OneshotParams,
    RagParams,
    make_params,
)

LENGTH_SIGMA = 0.5


# ------------------------------------------------------------------------------------------- helpers


class _Builder:
    """Draws lengths and token blocks from one seeded generator."""

    def __init__(self, seed: int, vocab: int) -> None:
        if vocab < 2:
            raise GeneratorParamError("vocab must be >= 2")
        self.rng = np.random.default_rng(seed)
        self.vocab = vocab

    def length(self, mean: float) -> int:
        mu = math.log(mean) - LENGTH_SIGMA**2 / 2
        return max(1, round(float(self.rng.lognormal(mu, LENGTH_SIGMA))))

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(0, self.vocab, size=n).tolist()

    def count(self, mean: float) -> int:
        """A count >= 1 with the given mean (geometric)."""
        return int(self.rng.geometric(1.0 / mean)) if mean > 1 else 1

    def think_ms(self, mean_s: float) -> float:
        return float(self.rng.exponential(mean_s * 1000.0)) if mean_s > 0 else 0.0


@dataclass(slots=True)
class _Turn:
    offset_ms: float
    prompt: list[int]
    output: list[int]
    shared_prefix: int = 0  # tokens of a prefix shared beyond the session (a client marks it for retention)


Session = list[_Turn]


def _chat(b: _Builder, p: ChatParams, shared: dict[str, Any]) -> Session:
    if "systems" not in shared:
        shared["systems"] = [b.tokens(b.length(p.system_tokens)) for _ in range(p.system_prompts)]
    history = list(shared["systems"][int(b.rng.integers(p.system_prompts))])
    turns, t = [], 0.0
    for _ in range(b.count(p.turns)):
        prompt = history + b.tokens(b.length(p.user_tokens))
        out = b.tokens(b.length(p.output_tokens))
        turns.append(_Turn(t, prompt, out))
        history = prompt + out
        t += b.think_ms(p.think_s)
    return turns


def _agent(b: _Builder, p: AgentParams, shared: dict[str, Any]) -> Session:
    if "toolsets" not in shared:
        system = b.tokens(b.length(p.system_tokens))
        shared["toolsets"] = [system + b.tokens(b.length(p.tool_schema_tokens)) for _ in range(p.toolsets)]
    toolset = shared["toolsets"][int(b.rng.integers(p.toolsets))]
    return _tool_calls(b, p, toolset, lambda: b.think_ms(p.think_s))


def _agent_loop(b: _Builder, p: AgentLoopParams, shared: dict[str, Any]) -> Session:
    if "prefixes" not in shared:
        shared["prefixes"] = [b.tokens(b.length(p.prefix_tokens)) for _ in range(p.prefixes)]
    prefix = shared["prefixes"][int(b.rng.integers(p.prefixes))]
    return _tool_calls(b, p, prefix, lambda: float(b.rng.uniform(p.min_gap_s, p.max_gap_s)) * 1000.0)


def _tool_calls(
    b: _Builder, p: AgentParams | AgentLoopParams, prefix: list[int], gap_ms: Callable[[], float]
) -> Session:
    """An agent's turns over its shared ``prefix``: a task, then per step a call (the turn's output) and
    its result appended to the history, ``gap_ms`` apart."""
    history = list(prefix) + b.tokens(b.length(p.task_tokens))
    turns, t = [], 0.0
    for _ in range(b.count(p.steps)):
        call = b.tokens(b.length(p.call_tokens))
        turns.append(_Turn(t, history, call, len(prefix)))
        history = history + call + b.tokens(b.length(p.result_tokens))
        t += gap_ms()
    return turns


def _coding(b: _Builder, p: CodingParams, shared: dict[str, Any]) -> Session:
    repos = shared.setdefault("repos", [b.tokens(b.length(p.repo_tokens)) for _ in range(p.repos)])
    repo = repos[int(b.rng.integers(p.repos))]
    history = list(repo)
    turns, t = [], 0.0
    for _ in range(b.count(p.turns)):
        prompt = history + b.tokens(b.length(p.file_tokens)) + b.tokens(b.length(p.user_tokens))
        out = b.tokens(b.length(p.output_tokens))
        turns.append(_Turn(t, prompt, out, len(repo)))
        history = prompt + out
        t += b.think_ms(p.think_s)
    return turns


def _rag(b: _Builder, p: RagParams, shared: dict[str, Any]) -> Session:
    if "docs" not in shared:
        shared["system"] = b.tokens(b.length(p.system_tokens))
        shared["docs"] = [b.tokens(b.length(p.document_tokens)) for _ in range(p.documents)]
        weights = 1.0 / np.arange(1, p.documents + 1) ** p.zipf_s
        shared["popularity"] = weights / weights.sum()
    turns, t = [], 0.0
    for _ in range(b.count(p.questions)):
        doc = shared["docs"][int(b.rng.choice(p.documents, p=shared["popularity"]))]
        prompt = shared["system"] + doc + b.tokens(b.length(p.question_tokens))
        turns.append(_Turn(t, prompt, b.tokens(b.length(p.output_tokens))))
        t += b.think_ms(p.think_s)
    return turns


def _oneshot(b: _Builder, p: OneshotParams, shared: dict[str, Any]) -> Session:
    return [_Turn(0.0, b.tokens(b.length(p.input_tokens)), b.tokens(b.length(p.output_tokens)))]


_SESSION: dict[str, Callable[[_Builder, Any, dict[str, Any]], Session]] = {
    "chat": _chat,
    "agent": _agent,
    "agent_loop": _agent_loop,
    "coding": _coding,
    "rag": _rag,
    "oneshot": _oneshot,
}


# ------------------------------------------------------------------------------------------- public


def generate(
    workload: str,
    requests: int,
    rate: float,
    seed: int = 0,
    vocab: int = 32_000,
    params: Any = None,
    tenants: int = 1,
    arrivals_ms: Sequence[float] | None = None,
    hints: bool = True,
) -> list[Request]:
    """``requests`` records of ``workload`` at ``rate`` requests/s on average, sorted by arrival.

    Sessions start as a Poisson process at ``rate / mean requests per session`` and are added until no
    new session could arrive among the first ``requests`` (so the first minutes ramp up while sessions
    accumulate, as after a restart); ``arrivals_ms`` (e.g.
    a trace's timestamps) replaces the times in order, keeping each session's turn order. Tenants are
    assigned per session round-robin as ``t0, t1, ...``.

    With ``hints`` (the default: the clients these workloads stand for, agent and coding tools on a
    provider API, mark their caches) each record carries what such a client sends: its session as
    ``cache_key``, ``SHORT_TIER`` retention on every turn but the session's last (of the workloads whose
    next turn extends the prompt, ``EXTENDING``), the last ending the session, and ``LONG_TIER`` retention
    of the prefix shared beyond the session (toolsets, agent prefixes, repositories). ``hints=False``
    gives the same records without them. A trace cut at ``requests`` may leave a session without its
    last turn, as a real log does.
    """
    if type(requests) is not int or requests <= 0:
        raise GeneratorParamError(f"requests must be a positive integer, got {requests!r}")
    if not math.isfinite(rate) or rate <= 0:
        raise GeneratorParamError(f"rate must be > 0 requests/s, got {rate!r}")
    if type(tenants) is not int or tenants <= 0:
        raise GeneratorParamError("tenants must be a positive integer")
    params = params if params is not None else make_params(workload)
    if type(params) is not PARAMS.get(workload):
        got = type(params).__name__
        raise GeneratorParamError(f"parameters {got} do not belong to workload {workload!r}")
    b = _Builder(seed, vocab)
    make_session = _SESSION[workload]
    shared: dict[str, Any] = {}
    pending: list[tuple[float, int, int, _Turn]] = []
    start_ms, session = 0.0, 0
    per_session = _mean_requests(params)
    while len(pending) < requests or start_ms <= _nth_time(pending, requests):
        for turn_no, turn in enumerate(make_session(b, params, shared)):
            pending.append((start_ms + turn.offset_ms, session, turn_no, turn))
        session += 1
        start_ms += float(b.rng.exponential(1000.0 * per_session / rate))
    turns_of = Counter(x[1] for x in pending)  # requests of each session, all generated before the cut
    pending.sort(key=lambda x: (x[0], x[1], x[2]))
    pending = pending[:requests]
    if arrivals_ms is not None:
        if len(arrivals_ms) < requests:
            raise GeneratorParamError(f"{len(arrivals_ms)} arrival times for {requests} requests")
        times = sorted(float(a) - float(arrivals_ms[0]) for a in arrivals_ms[:requests])
    else:
        times = [x[0] for x in pending]
    out = []
    for t, (_, s, turn_no, turn) in zip(times, pending, strict=True):
        req = Request(
            request_id=f"{workload}-{seed}-{s}-{turn_no}",
            arrival_ms=round(t, 3),
            input_length=len(turn.prompt),
            output_length=len(turn.output),
            tokens=turn.prompt,
            output_tokens=turn.output,
            tenant=f"t{s % tenants}",
            workload=workload,
            conversation_id=f"{workload}-{seed}-{s}",
            turn=turn_no,
        )
        if hints:
            _add_hints(req, turn, last=turn_no == turns_of[s] - 1, extends=workload in EXTENDING)
        out.append(req)
    return out


SHORT_TIER = "5m"  # a turn that expects a follow-up within the think time
LONG_TIER = "1h"  # a prefix shared by many sessions (system prompt + tools, a repository)


# Workloads whose next turn extends this turn's prompt: retaining the chain pays only there. A RAG user's
# next question reads another document, a one-shot prompt has no next turn.
EXTENDING = frozenset({"chat", "agent", "agent_loop", "coding"})


def _add_hints(req: Request, turn: _Turn, last: bool, extends: bool) -> None:
    """The hints a provider-API client would send with this turn (see ``generate``)."""
    req.cache_key = req.conversation_id
    if last:
        req.session_end = True
    elif extends:
        req.retention_tier, req.retention_ms = SHORT_TIER, RETENTION_TIERS_MS[SHORT_TIER]
    if turn.shared_prefix:
        req.retained_prefix_tokens = min(turn.shared_prefix, req.input_length)
        req.prefix_retention_tier, req.prefix_retention_ms = LONG_TIER, RETENTION_TIERS_MS[LONG_TIER]


def _nth_time(pending: list[tuple[float, int, int, _Turn]], n: int) -> float:
    """Arrival of the n-th earliest request: sessions starting later cannot enter the first n."""
    times = np.fromiter((x[0] for x in pending), dtype=np.float64, count=len(pending))
    return float(np.partition(times, n - 1)[n - 1])


def _mean_requests(params: Any) -> float:
    for name in ("turns", "steps", "questions"):
        if hasattr(params, name):
            return float(getattr(params, name))
    return 1.0


def parse_mix(text: str) -> dict[str, float]:
    """``"chat=0.5,rag=0.3,oneshot=0.2"`` -> weights normalised to sum 1."""
    mix: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, weight = part.partition("=")
        if name not in PARAMS:
            raise GeneratorParamError(f"unknown workload {name!r} in mix; choose from {sorted(PARAMS)}")
        try:
            w = float(weight) if weight else 1.0
        except ValueError:
            raise GeneratorParamError(f"bad weight {weight!r} for {name}") from None
        if not math.isfinite(w) or w <= 0:
            raise GeneratorParamError(f"weight of {name} must be > 0")
        mix[name] = mix.get(name, 0.0) + w
    if not mix:
        raise GeneratorParamError("empty workload mix")
    total = sum(mix.values())
    return {k: v / total for k, v in mix.items()}


def generate_mix(
    mix: dict[str, float],
    requests: int,
    rate: float,
    seed: int = 0,
    vocab: int = 32_000,
    params: dict[str, Any] | None = None,
    tenants: int = 1,
    hints: bool = True,
) -> list[Request]:
    """Several workloads interleaved: each gets its share of requests and of the rate, its own derived
    seed, and the union is sorted by arrival (ties by request id); ``hints`` as in ``generate``."""
    out: list[Request] = []
    names = sorted(mix)
    counts = [max(1, round(requests * mix[n])) for n in names]
    counts[-1] = max(1, requests - sum(counts[:-1]))
    for i, (name, n) in enumerate(zip(names, counts, strict=True)):
        p = (params or {}).get(name)
        out.extend(generate(name, n, rate * mix[name], seed * 1000 + i, vocab, p, tenants, hints=hints))
    out.sort(key=lambda r: (r.arrival_ms, r.request_id))
    return out
