"""The client side of the worker contracts: the steps of a disaggregated completion, and `DisaggClient`,
which runs them against one fixed prefill and one decode worker.

The steps (``run_prefill``, whose reply is output token 0 (``first_chunk``), then ``start_decode`` for
tokens 1 on) are the handoff protocol in one place: the gateway runs them with its routing, retries and
streaming; ``kvpool verify``, the integration tests and the TTFT bench run them through `DisaggClient`.
Every call carries a deadline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import grpc
import torch
from kvpool.proto import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from kvpool.runtime import cluster_auth
from kvpool.worker.errors import ServingError
from kvpool.worker.handoff import PrefillRequest
from kvpool.worker.wire import logits_from_reply, request_to_pb


class DecodeStreamEndedError(ServingError):
    """A decode stream ended without its final chunk."""


async def run_prefill(
    stub: prefill_pb2_grpc.PrefillStub, request: PrefillRequest, timeout_s: float, return_logits: bool = False
) -> prefill_pb2.PrefillReply:
    """Step 1: the prompt through a prefill worker; the reply carries the handoff and output token 0."""
    return await stub.Prefill(request_to_pb(request, return_logits), timeout=timeout_s)


def first_chunk(reply: prefill_pb2.PrefillReply) -> decode_pb2.GenerateChunk:
    """Output token 0 and its text, from the prefill reply: a client streams it before decode answers."""
    return decode_pb2.GenerateChunk(index=0, token_id=reply.first_token, text=reply.first_text)


def start_decode(
    stub: decode_pb2_grpc.DecodeStub, reply: prefill_pb2.PrefillReply, timeout_s: float
) -> grpc.aio.UnaryStreamCall:
    """Step 2: hand the prefill's handoff to a decode worker; returns the open stream of tokens 1 on."""
    return stub.Generate(decode_pb2.GenerateRequest(handoff=reply.handoff), timeout=timeout_s)


@dataclass
class RemoteCompletion:
    tokens: list[int]
    text: str
    finish_reason: str
    first_logits: torch.Tensor | None
    prefill: prefill_pb2.PrefillUsage
    decode: decode_pb2.DecodeUsage
    ttft_s: float = 0.0  # client-observed: request sent -> first token received (the prefill reply)
    e2e_s: float = 0.0
    chunks: list[decode_pb2.GenerateChunk] = field(default_factory=list)  # token 0 (prefill's), 1.., final


class DisaggClient:
    def __init__(self, prefill: str, decode: str, timeout_s: float = 60.0) -> None:
        self._channels = [cluster_auth.aio_channel(prefill), cluster_auth.aio_channel(decode)]
        self.prefill_stub = prefill_pb2_grpc.PrefillStub(self._channels[0])
        self.decode_stub = decode_pb2_grpc.DecodeStub(self._channels[1])
        self.timeout_s = timeout_s

    async def prefill(self, request: PrefillRequest, return_logits: bool = True) -> prefill_pb2.PrefillReply:
        return await run_prefill(self.prefill_stub, request, self.timeout_s, return_logits)

    async def complete(self, request: PrefillRequest, return_logits: bool = True) -> RemoteCompletion:
        t0 = time.perf_counter()
        reply = await self.prefill(request, return_logits)
        ttft = time.perf_counter() - t0
        call = start_decode(self.decode_stub, reply, self.timeout_s)
        chunks = [first_chunk(reply)]
        while not chunks[-1].final and (chunk := await call.read()) is not grpc.aio.EOF:
            chunks.append(chunk)
        final = chunks[-1]
        if not final.final:
            raise DecodeStreamEndedError("decode stream ended without a final chunk")
        return RemoteCompletion(
            tokens=[c.token_id for c in chunks[:-1]],
            text=final.text,
            finish_reason=final.finish_reason,
            first_logits=logits_from_reply(reply) if return_logits else None,
            prefill=reply.usage,
            decode=final.usage,
            ttft_s=ttft,
            e2e_s=time.perf_counter() - t0,
            chunks=chunks,
        )

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()
