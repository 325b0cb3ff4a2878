"""The knobs of each synthetic workload (``generators``): one frozen dataclass per workload, its defaults
the documented mix, and ``make_params``, which applies CLI overrides (strings converted to each field's
type) and refuses a parameter that does not exist or a value that would make an empty or infinite workload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from kvpool.workloads.errors import GeneratorParamError


@dataclass(frozen=True, slots=True)
class ChatParams:
    system_prompts: int = 4
    system_tokens: int = 1024
    turns: float = 6.0  # mean turns per conversation (geometric, >= 1)
    user_tokens: int = 300
    output_tokens: int = 350
    think_s: float = 30.0


@dataclass(frozen=True, slots=True)
class AgentParams:
    toolsets: int = 3
    system_tokens: int = 3000
    tool_schema_tokens: int = 6000
    steps: float = 8.0  # mean tool-calling steps per run
    task_tokens: int = 400
    call_tokens: int = 120  # model output per step: the tool call
    result_tokens: int = 900  # tool result appended to the history
    think_s: float = 3.0


@dataclass(frozen=True, slots=True)
class AgentLoopParams:
    """An autonomous agent loop: a long prefix shared by every run of a deployment (system prompt, tool
    schemas, instructions), then tool calls back to back, each 1-3 s after the previous one returns."""

    prefixes: int = 2  # deployments (each its own shared prefix)
    prefix_tokens: int = 16_000
    task_tokens: int = 300
    steps: float = 25.0  # mean tool calls per run (geometric)
    call_tokens: int = 80  # model output per step: the tool call
    result_tokens: int = 500  # tool result appended to the history
    min_gap_s: float = 1.0  # a step follows the previous one after a uniform gap in [min_gap_s, max_gap_s]
    max_gap_s: float = 3.0


@dataclass(frozen=True, slots=True)
class CodingParams:
    repos: int = 6
    repo_tokens: int = 40_000
    turns: float = 10.0
    user_tokens: int = 250
    output_tokens: int = 600
    file_tokens: int = 1500  # fresh file contents read in per turn
    think_s: float = 20.0


@dataclass(frozen=True, slots=True)
class RagParams:
    documents: int = 200
    document_tokens: int = 8000
    zipf_s: float = 1.1
    system_tokens: int = 500
    question_tokens: int = 120
    output_tokens: int = 250
    questions: float = 3.0  # mean questions per user session
    think_s: float = 15.0


@dataclass(frozen=True, slots=True)
class OneshotParams:
    input_tokens: int = 2000
    output_tokens: int = 200


PARAMS: dict[str, type] = {
    "chat": ChatParams,
    "agent": AgentParams,
    "agent_loop": AgentLoopParams,
    "coding": CodingParams,
    "rag": RagParams,
    "oneshot": OneshotParams,
}


def make_params(workload: str, overrides: dict[str, Any] | None = None) -> Any:
    """Parameters for ``workload`` with ``overrides`` (strings from the CLI are converted) applied."""
    try:
        cls = PARAMS[workload]
    except KeyError:
        raise GeneratorParamError(f"unknown workload {workload!r}; choose one of {sorted(PARAMS)}") from None
    names = {f.name: f for f in fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in (overrides or {}).items():
        if key not in names:
            raise GeneratorParamError(f"{workload} has no parameter {key!r}; known: {sorted(names)}")
        default = getattr(cls(), key)
        try:
            kwargs[key] = type(default)(value)
        except (TypeError, ValueError):
            raise GeneratorParamError(f"{workload}.{key} must be a {type(default).__name__}") from None
    params = cls(**kwargs)
    for f in fields(params):
        v = getattr(params, f.name)
        if not math.isfinite(v) or v < 0 or (v == 0 and f.name not in ("think_s", "min_gap_s")):
            raise GeneratorParamError(
                f"{workload}.{f.name} must be > 0 (think_s and min_gap_s >= 0), got {v!r}"
            )
    if isinstance(params, ChatParams | CodingParams) and params.turns < 1:
        raise GeneratorParamError(f"{workload}.turns must be >= 1")
    if isinstance(params, AgentParams | AgentLoopParams) and params.steps < 1:
        raise GeneratorParamError(f"{workload}.steps must be >= 1")
    if isinstance(params, AgentLoopParams) and params.min_gap_s > params.max_gap_s:
        raise GeneratorParamError("agent_loop.min_gap_s must not exceed max_gap_s")
    if isinstance(params, RagParams) and params.questions < 1:
        raise GeneratorParamError("rag.questions must be >= 1")
    return params
