"""Token selection: greedy, or temperature / top-k / top-p with a seed.

Why per-step generators: the first token is chosen on the prefill node and the rest on the decode node, so
randomness must not live in a generator object that would have to travel. Step ``k`` of a request draws from
a generator seeded by ``(seed, k)`` alone, so the same request gives the same tokens whichever process
samples which step (and colocated == disaggregated for sampled output too).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from kvpool.worker.errors import BadRequestError

MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI-style knobs. ``temperature == 0`` is greedy (argmax, lowest id on ties)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False

    def validate(self) -> SamplingParams:
        """Raise `BadRequestError` naming the bad field; returns self for chaining."""
        if not (math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0):
            raise BadRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise BadRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise BadRequestError(f"top_k must be >= 0, got {self.top_k}")
        if not 1 <= self.max_tokens <= 1 << 20:
            raise BadRequestError(f"max_tokens must be in [1, 2**20], got {self.max_tokens}")
        if self.seed < 0 or self.seed >= 1 << 63:
            raise BadRequestError(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise BadRequestError(f"stop: at most {MAX_STOP_STRINGS} non-empty strings")
        return self


def _generator(seed: int, step: int) -> torch.Generator:
    digest = hashlib.sha256(f"kvpool-sample\0{seed}\0{step}".encode()).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def sample(logits: torch.Tensor, params: SamplingParams, step: int) -> int:
    """The token for output position ``step`` (0 = first token, chosen by prefill) from ``logits [V]``."""
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    scores = logits.detach().to("cpu", torch.float64) / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < params.top_p  # always keeps the top token
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[order[keep]] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return int(torch.multinomial(probs, 1, generator=_generator(params.seed, step)))


class StopChecker:
    """Stop strings over the decoded text (tokenizer-aware): ``push`` says whether generation must end and
    ``text`` is the output with the stop string and anything after it cut (OpenAI semantics).

    ``visible(final)`` is what may be streamed so far: it holds back a trailing replacement character (an
    incomplete multi-byte character that the next token may complete) and any tail that could be the start
    of a stop string, so streamed deltas never have to be taken back and always add up to ``text``."""

    def __init__(self, tokenizer: object, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.tokens: list[int] = []
        self.text = ""

    def push(self, token: int) -> bool:
        self.tokens.append(token)
        if self.tokenizer is None:
            return False
        full = self.tokenizer.decode(self.tokens)  # type: ignore[attr-defined]
        self.text = full
        if not self.stop:
            return False
        cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = full[:cut]
            return True
        return False

    def visible(self, final: bool) -> str:
        if final:
            return self.text
        text = self.text.rstrip("\ufffd")
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return text[: len(text) - hold]


class OutputText:
    """One output's text as its tokens arrive: whether token k ends the generation and the text delta it
    shows (``visible`` deltas, so they add up to ``text``).

    Prefill runs it for the first token (its reply carries that token's delta, which the gateway streams at
    once) and decode for every token from the same first one on, so decode's later deltas continue exactly
    where the first one stopped."""

    def __init__(self, tokenizer: object, params: SamplingParams, eos: Iterable[int]) -> None:
        self.params = params
        self.eos = frozenset(eos)
        self.stop = StopChecker(tokenizer, params.stop)
        self.shown = ""

    @property
    def text(self) -> str:
        return self.stop.text

    def add(self, token: int) -> tuple[str, str]:
        """(text delta, finish reason: "stop" | "length" | "" = go on) after ``token``."""
        finish = ""
        if self.stop.push(token) or (token in self.eos and not self.params.ignore_eos):
            finish = "stop"
        elif len(self.stop.tokens) >= self.params.max_tokens:
            finish = "length"
        visible = self.stop.visible(final=bool(finish))
        delta, self.shown = visible[len(self.shown) :], visible
        return delta, finish
