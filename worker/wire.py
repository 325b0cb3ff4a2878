"""Proto <-> dataclass conversions for the worker contracts (proto/prefill.proto, proto/decode.proto).

Kept in one place so both workers and every client (verify, bench, gateway) read the same defaults:
``top_p == 0`` means 1 (off) and ``max_tokens == 0`` means 16, because proto3 cannot tell unset from 0.
"""

from __future__ import annotations

import torch
from kvpool.proto import prefill_pb2
from kvpool.worker.handoff import Handoff, PrefillRequest, RetainSpan
from kvpool.worker.sampling import SamplingParams

DEFAULT_MAX_TOKENS = 16


def sampling_to_pb(p: SamplingParams) -> prefill_pb2.SamplingParams:
    return prefill_pb2.SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        seed=p.seed,
        max_tokens=p.max_tokens,
        stop=list(p.stop),
        ignore_eos=p.ignore_eos,
    )


def sampling_from_pb(m: prefill_pb2.SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=float(m.temperature),
        top_p=float(m.top_p) if m.top_p > 0 else 1.0,
        top_k=int(m.top_k),
        seed=int(m.seed),
        max_tokens=int(m.max_tokens) or DEFAULT_MAX_TOKENS,
        stop=tuple(m.stop),
        ignore_eos=bool(m.ignore_eos),
    )


def request_to_pb(r: PrefillRequest, return_logits: bool = False) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=r.request_id,
        prompt_ids=r.prompt_ids,
        tenant=r.tenant,
        sampling=sampling_to_pb(r.sampling),
        no_cache=not r.use_cache,
        return_logits=return_logits,
        session=r.session,
        retain=[prefill_pb2.RetainSpan(upto_tokens=s.upto_tokens, ttl_ms=s.ttl_ms) for s in r.retain],
    )


def request_from_pb(m: prefill_pb2.PrefillRequest) -> PrefillRequest:
    return PrefillRequest(
        request_id=m.request_id,
        prompt_ids=list(m.prompt_ids),
        tenant=m.tenant,
        sampling=sampling_from_pb(m.sampling),
        use_cache=not m.no_cache,
        session=m.session,
        retain=tuple(RetainSpan(int(s.upto_tokens), int(s.ttl_ms)) for s in m.retain),
    )


def handoff_to_pb(h: Handoff) -> prefill_pb2.Handoff:
    return prefill_pb2.Handoff(
        request_id=h.request_id,
        prompt_ids=h.prompt_ids,
        tenant=h.tenant,
        first_token=h.first_token,
        sampling=sampling_to_pb(h.sampling),
        block_hashes=h.block_hashes,
        tail_key=h.tail_key,
        tail_stored=h.tail_stored,
        cached_tokens=h.cached_tokens,
        no_cache=not h.use_cache,
        session=h.session,
        retain_ms=h.retain_ms,
    )


def handoff_from_pb(m: prefill_pb2.Handoff) -> Handoff:
    return Handoff(
        request_id=m.request_id,
        prompt_ids=list(m.prompt_ids),
        tenant=m.tenant,
        first_token=int(m.first_token),
        sampling=sampling_from_pb(m.sampling),
        block_hashes=[bytes(h) for h in m.block_hashes],
        tail_key=bytes(m.tail_key),
        tail_stored=bool(m.tail_stored),
        cached_tokens=int(m.cached_tokens),
        use_cache=not m.no_cache,
        session=m.session,
        retain_ms=int(m.retain_ms),
    )


def logits_from_reply(reply: prefill_pb2.PrefillReply) -> torch.Tensor:
    """The float32 first-token logits a ``return_logits`` reply carries (bit-exact)."""
    return torch.frombuffer(bytearray(reply.first_logits), dtype=torch.float32)
