"""``kvpool verify``: is the disaggregated, cached path exactly the plain model?

Runs a fixed prompt set — shared system prompts, multi-turn chats, lengths crossing block and checkpoint
boundaries — through (a) the colocated engine without cache, in this process (the reference), and (b) the
disaggregated workers with the shared cache: its own master + node + prefill + decode on loopback, or the
workers given by ``--prefill/--decode``. Reports the share of requests with identical greedy tokens, the
largest first-token logit difference, how many first-token logits were bit-identical, and whether the
cached tokens each prefill reported were really reused (a multiple of the block size, the rest computed,
and at least that many blocks' bytes plus a checkpoint fetched). Second chat turns resume from
decode-computed blocks, which differ from a prefill by ~1e-7 (overview §7.3): they count in
``identical`` by tokens and in ``max_logit_diff`` but are not expected to be bitwise.

``--endpoint URL`` sends the same prompts (as token ids, greedy, ``ignore_eos``) to an OpenAI-compatible
server such as the kvpool gateway: there only the text and ``usage`` are visible, so requests are compared
on their text and completion length, cached tokens on block alignment, and no logit difference is reported.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

TOLERANCE = 1e-4  # fp32 first-token logits: decode-computed turn-2 prefixes differ by ~1e-6
SYSTEMS = (
    "You are a careful assistant. Answer briefly and cite the section you used.",
    "System: you are the support bot of a storage company. Customers ask about caches, tiers, eviction "
    "and prices; be exact, never invent numbers, and say so when a question is outside your knowledge.",
    "Context document: The pool keeps objects in DRAM and demotes cold ones to SSD. A prefix index answers "
    "the longest usable prefix of a hash chain in one call; read pins are leases with deadlines; eviction "
    "goes leaves first so every cached prefix stays usable. Checkpoints are sparse because each one costs "
    "as much as many blocks. Questions follow.",
)
QUESTIONS = (
    "\nUser: what is a block?\nAssistant:",
    "\nUser: how long does a lease live, and who releases it when a client dies?\nAssistant:",
    "\nUser: summarise the eviction rule in one line.\nAssistant:",
    "\nUser: why are checkpoints sparse? Give the cost ratio if you know it, otherwise say you do not.\n"
    "Assistant:",
)
FOLLOW_UPS = (
    "\nUser: and in more detail?\nAssistant:",
    "\nUser: thanks. One more: what about SSD?\nAssistant:",
)


@dataclass
class Case:
    name: str
    text: str
    max_tokens: int = 4
    follow_up: str | None = None  # a second chat turn built from this case's output


@dataclass
class Row:
    name: str
    prompt_tokens: int
    cached_tokens: int
    identical: bool
    bitwise_logits: bool | None  # None: not observable (endpoint mode)
    max_logit_diff: float | None
    cached_verified: bool
    resume_path: str


@dataclass
class Report:
    requests: int = 0
    identical: int = 0
    identical_fraction: float = 0.0
    max_logit_diff: float | None = 0.0
    bitwise_first_logits: int | None = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_verified: bool = True
    mode: str = "disaggregated"
    elapsed_s: float = 0.0
    rows: list[Row] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (
            self.requests > 0
            and self.identical == self.requests
            and (self.max_logit_diff is None or self.max_logit_diff <= TOLERANCE)
            and self.cached_tokens_verified
        )

    def summarize(self, t0: float) -> Report:
        rows = self.rows
        self.requests = len(rows)
        self.identical = sum(r.identical for r in rows)
        self.identical_fraction = self.identical / max(len(rows), 1)
        diffs = [r.max_logit_diff for r in rows if r.max_logit_diff is not None]
        self.max_logit_diff = max(diffs, default=0.0) if diffs or not rows else None
        bits = [r.bitwise_logits for r in rows if r.bitwise_logits is not None]
        self.bitwise_first_logits = sum(bits) if bits or not rows else None
        self.prompt_tokens = sum(r.prompt_tokens for r in rows)
        self.cached_tokens = sum(r.cached_tokens for r in rows)
        self.cached_tokens_verified = all(r.cached_verified for r in rows)
        self.elapsed_s = time.perf_counter() - t0
        return self


def prompt_set() -> list[Case]:
    """Fixed cases: every system prompt x every question (shared prefixes), chats with a second turn, and
    a long prompt spanning several blocks."""
    cases = [Case(f"s{i}q{j}", s + q) for i, s in enumerate(SYSTEMS) for j, q in enumerate(QUESTIONS)]
    for i, s in enumerate(SYSTEMS):
        cases.append(Case(f"chat{i}", s + QUESTIONS[i], 24, FOLLOW_UPS[i % 2]))
    cases.append(Case("long", " ".join(SYSTEMS) + QUESTIONS[3], 6))
    return cases


def _check_cached(reply_usage: object, schema: object, block_size: int) -> bool:
    """Reported cached tokens really reused: block-aligned, the rest computed, their bytes fetched."""
    cached, computed = reply_usage.cached_tokens, reply_usage.computed_tokens  # type: ignore[attr-defined]
    if cached % block_size or cached + computed != reply_usage.prompt_tokens:  # type: ignore[attr-defined]
        return False
    if cached == 0:
        return True
    need = schema.mla_block_bytes() * (cached // block_size) + schema.kda_checkpoint_bytes()  # type: ignore
    return reply_usage.bytes_fetched >= need  # type: ignore[attr-defined]


class _Reference:
    """The colocated no-cache run in this process, with the workers' thread count (restored on close)."""

    def __init__(self, model_name: str, block_size: int, threads: int) -> None:
        import torch

        from kvpool.colocated import Colocated
        from kvpool.model.loader import load_model
        from kvpool.model.tokenizer import load_tokenizer

        self._saved = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
        torch.set_num_threads(threads)  # the workers' --threads: same kernels on both sides
        torch.use_deterministic_algorithms(True)
        self.model = load_model(model_name)
        self.tokenizer = load_tokenizer(model_name, self.model.config)
        self.schema = self.model.cache_schema(block_size)
        self.colocated = Colocated(self.model, None, block_size=block_size, tokenizer=self.tokenizer)

    async def complete(self, name: str, ids: list[int], max_tokens: int) -> object:
        from kvpool.worker.handoff import PrefillRequest
        from kvpool.worker.sampling import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        return await self.colocated.complete(PrefillRequest(f"ref-{name}", ids, "ref", sp, use_cache=False))

    def close(self) -> None:
        import torch

        self.colocated.close()
        torch.set_num_threads(self._saved[0])
        torch.use_deterministic_algorithms(self._saved[1])


async def _drive(ref: _Reference, one) -> None:  # type: ignore[no-untyped-def]
    """Every case (and its second turn, built from the reference output) through ``one(name, ids, n)``."""
    for case in prompt_set():
        ids = ref.tokenizer.encode(case.text)
        out = await one(case.name, ids, case.max_tokens)
        if case.follow_up is not None:
            turn2 = ids + out + ref.tokenizer.encode(case.follow_up)[1:]  # no second BOS mid-conversation
            await one(f"{case.name}.turn2", turn2, 4)


async def run_verify(
    model_name: str,
    prefill: str,
    decode: str,
    block_size: int = 64,
    tenant: str | None = None,
    threads: int = 1,
) -> Report:
    """Disaggregated workers (gRPC) vs the reference: tokens, first-token logits, cached bytes."""
    import torch

    from kvpool.worker.client import DisaggClient
    from kvpool.worker.handoff import PrefillRequest
    from kvpool.worker.sampling import SamplingParams

    ref = _Reference(model_name, block_size, threads)
    client = DisaggClient(prefill, decode, timeout_s=120)
    tenant = tenant if tenant is not None else f"verify-{uuid.uuid4().hex[:8]}"
    report = Report()
    t0 = time.perf_counter()

    async def one(name: str, ids: list[int], max_tokens: int) -> list[int]:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        got = await client.complete(PrefillRequest(f"{tenant}-{name}", ids, tenant, sp))
        want = await ref.complete(name, ids, max_tokens)
        report.rows.append(
            Row(
                name=name,
                prompt_tokens=len(ids),
                cached_tokens=got.prefill.cached_tokens,
                identical=got.tokens == want.tokens,
                bitwise_logits=torch.equal(got.first_logits, want.first_logits),
                max_logit_diff=float((got.first_logits - want.first_logits).abs().max()),
                cached_verified=_check_cached(got.prefill, ref.schema, block_size),
                resume_path=got.decode.resume_path,
            )
        )
        return want.tokens

    try:
        await _drive(ref, one)
    finally:
        await client.close()
        ref.close()
    return report.summarize(t0)


async def run_verify_endpoint(
    url: str,
    model_name: str,
    block_size: int = 64,
    tenant: str | None = None,
    threads: int = 1,
    api_key: str | None = None,
) -> Report:
    """An OpenAI-compatible server vs the reference: text, completion length, cached-token alignment."""
    from kvpool.decode.endpoint_client import EndpointClient

    ref = _Reference(model_name, block_size, threads)
    client = EndpointClient(url, api_key)
    tenant = tenant if tenant is not None else f"verify-{uuid.uuid4().hex[:8]}"
    report = Report(mode="endpoint")
    t0 = time.perf_counter()

    async def one(name: str, ids: list[int], max_tokens: int) -> list[int]:
        got = await client.complete(ids, max_tokens, cache_salt=tenant)
        want = await ref.complete(name, ids, max_tokens)
        text = want.decode.text
        report.rows.append(
            Row(
                name=name,
                prompt_tokens=len(ids),
                cached_tokens=got.cached_tokens,
                identical=got.text == text and got.completion_tokens == len(want.tokens),
                bitwise_logits=None,
                max_logit_diff=None,
                cached_verified=got.prompt_tokens == len(ids)
                and got.cached_tokens % block_size == 0
                and got.cached_tokens < len(ids),
                resume_path="endpoint",
            )
        )
        return want.tokens

    try:
        await _drive(ref, one)
    finally:
        await client.close()
        ref.close()
    return report.summarize(t0)
